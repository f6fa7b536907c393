"""Scorer throughput and sandbox overhead.

    python -m bench.scorer [--json] [--arith N] [--code N]

scored_per_s: rollouts scored end to end by one in-process Scorer on a real nats-server
(fetch → verify → publish Scored, JetStream-acked → ack), for the synthetic `arith` env and for
`python-tests` with 8 unit tests per task (one sandboxed subprocess per rollout).
sandbox_overhead_ms_p50: median wall time of running an empty script in the sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, connect
from bus import topology as topo
from bus.events import Rollout
from envs import get_env
from envs.sandbox import SandboxLimits, isolation, run_python
from kernel import setup_logging
from scorer.config import ScorerConfig
from scorer.service import Scorer


def rollouts(env_name: str, n: int, seed: int = 0) -> list[Rollout]:
    env, rng = get_env(env_name), random.Random(seed)
    out = []
    for i in range(n):
        t = env.sample(rng)
        # half correct demonstrations, half a wrong/garbled answer: both verifier paths are timed
        text = (
            env.demonstration(t.spec)
            if i % 2 == 0
            else ("#0" if env_name.startswith("arith") else "def f(:\n")
        )
        k = len(text) + 1
        out.append(
            Rollout(
                rollout_id=f"b{seed}-{i}-0",
                task_id=f"b{seed}-{i}",
                env=env_name,
                sample_index=0,
                group_size=1,
                prompt=t.prompt,
                spec=t.spec,
                prompt_ids=[1] * len(t.prompt),
                completion_ids=[5] * k,
                completion_text=text,
                logprobs=[-0.5] * k,
                token_versions=[0] * k,
                sampling={"max_tokens": 64},
                sampling_mask={},
                quant={},
                finish_reason="stop",
                cost_tokens=k,
                wall_s=0.01,
                worker_id="bench",
            )
        )
    return out


async def scored_per_s(
    url: str, env_name: str, n: int, concurrency: int, threads: int, netns: bool = True
) -> float:
    env = get_env(env_name)
    if hasattr(env, "limits"):
        env.limits.netns = netns
    bus = await connect(BusConfig(servers=[url], name="bench"))
    try:
        await bus.provision()
        base = (await bus.js.stream_info(topo.SCORED)).state.messages
        await bus.publish_many(
            [(topo.rollout_subject(env_name), r) for r in rollouts(env_name, n, seed=base)]
        )
        stop = asyncio.Event()
        scorer = Scorer(
            ScorerConfig(
                bus=BusConfig(servers=[url]),
                run={"concurrency": concurrency, "verify_threads": threads, "heartbeat_s": 60},
            ),
            bus=bus,
        )
        t0 = time.perf_counter()
        run = asyncio.create_task(scorer.run(stop, handle_signals=False))
        while (await bus.js.stream_info(topo.SCORED)).state.messages < base + n:
            await asyncio.sleep(0.02)
        dt = time.perf_counter() - t0
        stop.set()
        await run
        return n / dt
    finally:
        await bus.close()


def sandbox_p50_ms(reps: int, limits: SandboxLimits) -> float:
    ts = [run_python({"main.py": "pass\n"}, "main.py", limits).wall_s for _ in range(reps)]
    return statistics.median(ts) * 1e3


async def main_async(a) -> dict:
    # sync "always" (as shipped) flushes every JetStream write before its ack; "default" is the
    # server's own policy, what the arith figures before the flush was shipped were measured under
    async with EmbeddedServer(sync=None if a.sync == "default" else a.sync) as srv:
        arith = await scored_per_s(srv.url, "arith", a.arith, concurrency=64, threads=4)
        if a.arith_only:  # the event path alone: no sandbox, so it shows the codec and the loop
            return {
                "scored_per_s_arith": round(arith, 1),
                "n_arith": a.arith,
                "arith_only": True,
                "sync": a.sync,
            }
        code = await scored_per_s(srv.url, "python-tests", a.code, concurrency=16, threads=a.threads)
        code_no_netns = await scored_per_s(
            srv.url, "python-tests", a.code, concurrency=16, threads=a.threads, netns=False
        )
    python, fresh_uid, namespaces = isolation()
    return {
        "scored_per_s_arith": round(arith, 1),
        "scored_per_s_python_tests": round(code, 2),
        "scored_per_s_python_tests_no_netns": round(code_no_netns, 2),
        "python_tests_per_task": get_env("python-tests").n_tests,
        "sandbox_overhead_ms_p50": round(sandbox_p50_ms(a.reps, SandboxLimits()), 1),
        "sandbox_overhead_ms_p50_no_netns": round(sandbox_p50_ms(a.reps, SandboxLimits(netns=False)), 1),
        "isolation": {"fresh_uid": fresh_uid, "namespaces": namespaces, "python": python},
        "n_arith": a.arith,
        "n_python_tests": a.code,
        "verify_threads": a.threads,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scorer", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--arith", type=int, default=2000, help="arith rollouts")
    ap.add_argument("--code", type=int, default=96, help="python-tests rollouts")
    ap.add_argument("--threads", type=int, default=4, help="scorer verify threads (python-tests)")
    ap.add_argument("--reps", type=int, default=30, help="sandbox overhead repetitions")
    ap.add_argument("--arith-only", action="store_true", help="only the arith path (no sandbox runs)")
    ap.add_argument(
        "--sync",
        default="always",
        help="JetStream flush policy of the bench's server: always (as shipped) or default (the server's)",
    )
    a = ap.parse_args(argv)
    setup_logging("bench", level="warning")
    res = asyncio.run(main_async(a))
    if not a.json:
        for k, v in res.items():
            print(f"{k:36s} {v}", file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
