"""Both rollout engines under `asyncrl up` on one config, side by side.

    python -m bench.engines_up --json [--config deploy/smollm2.toml] [--minutes 4] [--out DIR]
                                      [--vllm-python .venv-vllm/bin/python]

Procedure: `asyncrl up` runs twice on copies of --config (bench.agentic.with_overrides), first
with [worker.engine] kind = "torch" (this interpreter), then kind = "vllm" (`<vllm-python> -m
asyncrl.cli up`). Each run is stopped with SIGINT (up drains and writes its summary) --minutes
after the worker first reports a version >= 1; anything left of its process group is killed
(up's children run in their own sessions with PDEATHSIG SIGTERM: they follow up).
Then the worker's own metrics (<run_dir>/metrics/rollout_worker-*.jsonl, the last row; a
sliding window of 4096 steps/updates, see rollout_worker/engine.py EngineMetrics) are read:

tokens_per_busy_s          tokens / decode-step seconds, cumulative since the engine started
decode_step_ms_p50         median decode step
update_stall_ms_p50 / p99  the worker's `update_stall_ms_*`: last decode step before an update
                           -> first one after it (not `update_stall_total_ms_*`, which adds the
                           slowed steps after it)
versions_applied           the worker's `updates`; last_version its `version`
start_s                    vLLM only: "vllm engine started" start_s in logs/worker-*.log
ratios                     vllm / torch of the first three

Caveats: CPU-bound and noisy; the two runs are sequential, not interleaved, so run it alone on
the box. The window includes the warm-up before the first version. A missing vLLM venv or a
failed vLLM run gives `"vllm": {"error": ...}` and no ratios; the torch side still reports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.report import read_jsonl

from .agentic import with_overrides

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("tokens_per_busy_s", "decode_step_ms_p50", "update_stall_ms_p50", "update_stall_ms_p99")


def worker_rows(run_dir: Path) -> list[dict]:
    """The worker heartbeat rows of one run, oldest first; a clear error when there are none."""
    files = sorted((Path(run_dir) / "metrics").glob("rollout_worker-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no metrics/rollout_worker-*.jsonl under {run_dir}")
    rows = sorted((r for f in files for r in read_jsonl(f)), key=lambda r: r.get("ts", 0.0))
    if not rows:
        raise ValueError(f"worker metrics under {run_dir} are empty")
    return rows


def start_s(run_dir: Path) -> float | None:
    """vLLM's start-up seconds from the worker's structlog JSON log (None if not logged)."""
    # `up` names a worker's log after the process (logs/worker-0.log)
    for f in sorted((Path(run_dir) / "logs").glob("worker-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if "vllm engine started" in line:
                try:
                    return float(json.loads(line)["start_s"])
                except (ValueError, KeyError, TypeError):
                    continue
    return None


def summarize(run_dir: Path) -> dict:
    last = worker_rows(run_dir)[-1]
    return {
        **{k: last.get(k) for k in FIELDS},
        "versions_applied": last.get("updates"),
        "last_version": last.get("version"),
        "start_s": start_s(run_dir),
        "run_dir": str(run_dir),
    }


def ratios(torch_s: dict, vllm_s: dict) -> dict:
    return {
        f"{k}_vllm_over_torch": (
            vllm_s[k] / torch_s[k] if torch_s.get(k) and vllm_s.get(k) is not None else None
        )
        for k in FIELDS[:3]
    }


def first_version_seen(run_dir: Path) -> bool:
    try:
        return any((r.get("version") or 0) >= 1 for r in worker_rows(run_dir))
    except (FileNotFoundError, ValueError):
        return False


def run_up(python: str, config: str, run_dir: Path, minutes: float, start_timeout_s: float) -> None:
    """One `asyncrl up`, stopped by SIGINT `minutes` after the first version; its group killed after."""
    cmd = [python, "-m", "asyncrl.cli", "up", "--config", config, "--run-dir", str(run_dir), "--quiet"]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}-up.out", "wb") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t_start, t_first = time.monotonic(), None
            while p.poll() is None:
                now = time.monotonic()
                if t_first is None and first_version_seen(run_dir):
                    t_first = now
                if t_first is None and now - t_start > start_timeout_s:
                    raise TimeoutError(f"no version >= 1 within {start_timeout_s:.0f} s; see {run_dir}/logs")
                if t_first is not None and now - t_first >= minutes * 60:
                    break
                time.sleep(2.0)
            else:
                if t_first is None and not first_version_seen(run_dir):
                    raise RuntimeError(f"up exited {p.returncode} before a version; see {run_dir}/logs")
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # up drains the children and writes its summary
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            try:  # nothing of the run outlives the bench
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deploy" / "smollm2.toml"))
    ap.add_argument("--minutes", type=float, default=4.0, help="per engine, after the first version")
    ap.add_argument("--start-timeout-min", type=float, default=15.0, help="to the first version, per engine")
    ap.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="engines-up-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # the run ends on our SIGINT; up's own limits only back it up
    backstop = a.minutes + a.start_timeout_min + 5
    result: dict = {"config": a.config, "minutes": a.minutes, "out": str(out)}
    for engine, python in (("torch", sys.executable), ("vllm", a.vllm_python)):
        try:
            if not Path(python).exists():
                raise FileNotFoundError(f"{python} not found (the vLLM venv: make test-vllm's .venv-vllm)")
            conf = with_overrides(
                a.config,
                out,
                worker={"engine": {"kind": engine}},
                name=f"engines-up-{engine}.toml",
                up={"steps": 10**6, "minutes": backstop},
            )
            run_up(python, conf, out / engine, a.minutes, a.start_timeout_min * 60)
            result[engine] = summarize(out / engine)
        except Exception as e:  # one engine failing still reports the other
            result[engine] = {"error": f"{type(e).__name__}: {e}"}
    if "error" not in result["torch"] and "error" not in result["vllm"]:
        result["ratios"] = ratios(result["torch"], result["vllm"])
    print(f"{'':24}{'torch':>14}{'vllm':>14}")
    for k in (*FIELDS, "versions_applied", "start_s"):
        cells = [result[e].get(k, "error" if "error" in result[e] else None) for e in ("torch", "vllm")]
        print(f"{k:24}" + "".join(f"{c:>14.1f}" if isinstance(c, float) else f"{c!s:>14}" for c in cells))
    if a.json:
        print(json.dumps(result, default=float))
    return 0 if "error" not in result["torch"] else 1


if __name__ == "__main__":
    sys.exit(main())
