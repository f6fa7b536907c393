"""asyncrl against TRL's GRPOTrainer, the synchronous peer, on one machine: `python -m bench.peer --json`.

    python -m bench.peer --json [--minutes 15] [--every-s 60] [--eval-n 256] [--eval-seed 0]
                                [--config deploy/learn-smollm2.toml] [--out DIR] [--plot PNG]
                                [--env arith-chat-12 --max-tokens 24]
    python -m bench.peer --json --config deploy/learn-smollm2-code.toml --env python-funcs
                                --max-tokens 128                                 (the code task)
                                [--peer-python .venv-peer/bin/python | --trl-from OUT/trl]
    python -m bench.peer --json --from-json OUT/peer.json [--plot PNG]     (the reader alone)

--trl-from reuses an earlier run's TRL side (same --minutes and --every-s; its policies evaluated
again by the same seeded evaluator) to compare asyncrl configs against one peer run.

Same model (SmolLM2-135M-Instruct, the HF folder `asyncrl model prepare smollm2` writes), same task
prompts and verifier (--env: `arith-chat-12`, sums of 1-2 digit numbers asked in words, or
`python-funcs`, short functions asked in words and scored by hidden tests in the sandbox; through
the chat template), same settings (4 prompts x 4 completions a step, lr 1e-5 with 2 warmup steps,
AdamW (0.9, 0.95), grad clip 1, T 0.7, --max-tokens new tokens, no KL, advantage = reward - group
mean, token mean over the batch), the same training wall-clock budget (--minutes), one after the other, alone:

1. TRL: `bench.peer_trl` in `.venv-peer` (`make peer-venv`); its clock starts with training and
   excludes the saves; a policy saved after the first step past each --every-s mark and at the end.
2. asyncrl: `asyncrl up` on --config with the env switched to arith-chat-12, no after-run eval,
   at most 64 versions (the WEIGHTS stream keeps the last 64 deltas: each version is rebuilt from
   the run's store by `asyncrl export`) and --minutes + 2 of `up` time (start-up is off the
   trainer's clock). Its clock is the trainer's `lead_wall_s`: from the moment it leads (v0 out,
   tasks fed) to the end of the version's step. The same marks pick the versions to evaluate.
3. One evaluator (`bench.peer_eval`) scores the starting policy and every saved one, both sides,
   on --eval-n held-out tasks (seed --eval-seed; the count of distinct problems is reported) at the
   training sampling, after both runs (off every clock).
4. The reader (`bench.peer_report`): TRL's best held-out success is the target; the wall time each
   side first reaches it (interpolation stated there); ratio = asyncrl / TRL (below 1: asyncrl gets
   there sooner); a PNG of success against wall clock.

OUT/peer.json holds the evaluated policies and both runs' records (re-read with --from-json).
Slow on a 2-core box: 2 x --minutes of training plus ~1 min of eval per policy. Last stdout line
with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.model import is_prepared, model_dir
from asyncrl.report import read_trainer_metrics

from .agentic import with_overrides
from .learn import run_once
from .peer_eval import ENV, distinct_problems, evaluate_policies
from .peer_report import compare, pick_versions, plot

ROOT = Path(__file__).resolve().parent.parent
# versions a run may make: its WEIGHTS stream keeps this many per subject ([up] weights_keep), so
# every version can still be rebuilt from the run's store for the evaluator
MAX_VERSIONS = 256
UP_STARTUP_MIN = 2.0  # `asyncrl up`'s own clock includes starting the processes and loading the model


def run_trl(
    python: str, model: Path, out: Path, minutes: float, every_s: float, seed: int, env: str, max_tokens: int
) -> dict:
    cmd = [python, "-m", "bench.peer_trl", "--model", str(model), "--out", str(out)]
    cmd += ["--minutes", str(minutes), "--every-s", str(every_s), "--seed", str(seed)]
    cmd += ["--env", env, "--max-new-tokens", str(max_tokens)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trl.out", "wb") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"bench.peer_trl exited {rc}; see {out / 'trl.out'}")
    return json.loads((out / "curve.json").read_text())


def run_asyncrl(config: str, out: Path, minutes: float, every_s: float, env: str, max_tokens: int) -> dict:
    from asyncrl.export import write_export

    out.mkdir(parents=True, exist_ok=True)
    up = {"steps": MAX_VERSIONS, "minutes": minutes + UP_STARTUP_MIN, "final_eval": False}
    up["weights_keep"] = MAX_VERSIONS
    sampling = {"temperature": 0.7, "top_p": 1.0, "max_tokens": max_tokens}
    tasks = {"envs": [env], "sampling": sampling}
    conf = with_overrides(config, out, name="bench-peer.toml", up=up, trainer={"tasks": tasks})
    run_dir = out / "run"
    wall = run_once(conf, run_dir, sys.executable)
    rows = [r for r in read_trainer_metrics(run_dir) if "samples" in r]
    if not any("lead_wall_s" in r for r in rows):
        raise RuntimeError(f"{run_dir}: no trained version with the trainer's clock (lead_wall_s)")
    picked = pick_versions(rows, every_s, minutes * 60)
    policies = []
    for p in picked:
        folder = out / "policies" / f"v{p['version']:05d}"
        if not (folder / "config.json").is_file():
            write_export(run_dir, folder, p["version"])
        policies.append({**p, "policy": str(folder)})
    return {
        "side": "asyncrl",
        "config": conf,
        "run_dir": str(run_dir),
        "up_wall_s": round(wall, 1),
        "versions": max((int(r["version"]) for r in rows), default=0),
        "policies": policies,
        "step_rewards": [
            {"version": r["version"], "wall_s": r.get("lead_wall_s"), "reward": r.get("success_mean")}
            for r in rows
        ],
    }


def report(recorded: dict, plot_path: Path | None) -> dict:
    result = compare(recorded["policies"])
    if plot_path is not None:
        result["plot"] = str(plot(recorded["policies"], result, plot_path))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="training wall clock per side")
    ap.add_argument("--every-s", type=float, default=60.0, help="evaluate the policy at these clock marks")
    ap.add_argument("--env", default=ENV, help="the task: arith-chat-12, or python-funcs (the code task)")
    ap.add_argument("--max-tokens", type=int, default=24, help="new tokens per completion, both sides")
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--eval-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="TRL's seed (its task order and sampling)")
    ap.add_argument("--config", default=str(ROOT / "deploy" / "learn-smollm2.toml"))
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"))
    ap.add_argument("--out", default=None, help="runs, policies and peer.json go here (default: a temp dir)")
    ap.add_argument("--plot", default=None, help="PNG of success vs wall clock (default: OUT/peer.png)")
    ap.add_argument("--from-json", default=None, help="a recorded OUT/peer.json: report and plot only")
    ap.add_argument(
        "--trl-from",
        default=None,
        help="a recorded TRL side (an earlier OUT/trl: curve.json and its policies) instead of a new "
        "TRL run: asyncrl configs compared against one peer run",
    )
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)

    if a.from_json:
        recorded = json.loads(Path(a.from_json).read_text())
        result = {
            **{k: v for k, v in recorded.items() if k != "policies"},
            **report(recorded, a.plot and Path(a.plot)),
        }
        if a.json:
            print(json.dumps(result, default=float))
        return 0

    trl = None
    if a.trl_from:  # its budget and marks must be this run's, or the two curves are not comparable
        trl = json.loads((Path(a.trl_from) / "curve.json").read_text())
        ran = (float(trl["minutes"]), float(trl["every_s"]), trl.get("env", ENV))
        ran += (int(trl.get("settings", {}).get("max_new_tokens", 24)),)
        if ran != (a.minutes, a.every_s, a.env, a.max_tokens):
            ap.error(
                f"--trl-from {a.trl_from} ran --minutes {ran[0]} --every-s {ran[1]} --env {ran[2]} "
                f"--max-tokens {ran[3]}, not {a.minutes}, {a.every_s}, {a.env}, {a.max_tokens}"
            )
    model = model_dir("smollm2")
    if not is_prepared("smollm2"):
        print("bench.peer: SmolLM2 is not prepared: run `make models`", file=sys.stderr)
        return 2
    if not a.trl_from and not Path(a.peer_python).is_file():
        print(f"bench.peer: no {a.peer_python}: run `make peer-venv`", file=sys.stderr)
        return 2
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-peer-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if trl is None:
        trl = run_trl(a.peer_python, model, out / "trl", a.minutes, a.every_s, a.seed, a.env, a.max_tokens)
    print(f"trl: {trl['steps']} steps, {len(trl['policies'])} policies saved", flush=True)
    ours = run_asyncrl(a.config, out / "asyncrl", a.minutes, a.every_s, a.env, a.max_tokens)
    print(f"asyncrl: {ours['versions']} versions, {len(ours['policies'])} exported", flush=True)
    entries = [{"side": s, "wall_s": 0.0, "policy": str(model)} for s in ("trl", "asyncrl")]
    entries += [{"side": "trl", **p} for p in trl["policies"]]
    entries += [{"side": "asyncrl", **p} for p in ours["policies"]]
    evaluated = evaluate_policies(
        entries,
        str(model),
        a.eval_n,
        a.eval_seed,
        a.env,
        log=lambda m: print(m, flush=True),
        max_tokens=a.max_tokens,
    )
    recorded = {
        "env": a.env,
        "max_tokens": a.max_tokens,
        "minutes": a.minutes,
        "every_s": a.every_s,
        "eval": {
            "n": a.eval_n,
            "seed": a.eval_seed,
            "distinct_problems": distinct_problems(a.eval_n, a.eval_seed, a.env),
        },
        "runs": {
            "trl": {k: v for k, v in trl.items() if k != "policies"},
            "asyncrl": {k: v for k, v in ours.items() if k != "policies"},
        },
        "policies": evaluated,
        "bench_wall_s": round(time.monotonic() - t0, 1),
        "out": str(out),
    }
    (out / "peer.json").write_text(json.dumps(recorded, indent=1, default=float))
    result = {**recorded, **report(recorded, Path(a.plot) if a.plot else out / "peer.png")}
    for side in ("trl", "asyncrl"):
        r = result[side]
        reach = f"{r['reach_s']:.0f} s" if r["reach_s"] is not None else "never"
        print(
            f"{side}: best {r['best']:.3f} at {r['best_wall_s']:.0f} s; "
            f"reaches {result['target']:.3f}: {reach}"
        )
    if a.json:
        print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
