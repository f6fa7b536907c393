"""The swe-demo warm start alone, offline: NLL per step and held-out success on the way.

    python -m bench.swe_warmstart --json [--config deploy/swe-demo.toml] [--steps N] [--lr X]
        [--batch B] [--eval-at 100,200,400] [--eval-n 32]

Builds the policy as the trainer does (the config's [trainer] section, overridden by the flags),
runs trainer/warmstart.py on the config's envs and, at each `--eval-at` step, plays `--eval-n`
held-out episodes (eval split, the config's [trainer.tasks] sampling) with envs/held_out.py's lockstep
episodes. Used to size [trainer.warmstart] steps / lr / batch so that RL starts from a
moderate held-out success within the demo's 15 minutes. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="deploy/swe-demo.toml")
    ap.add_argument("--steps", type=int, default=None, help="default: the config's [trainer.warmstart] steps")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--eval-at", default="", help="comma-separated steps (1-based) to evaluate after")
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", default="", help="write the final warm-started state here (torch.save)")
    ap.add_argument(
        "--load", default="", help="start from this --save file (with --steps 0: evaluate it alone)"
    )
    ap.add_argument(
        "--temperature", type=float, default=None, help="eval sampling temperature (default: the config's)"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import dataclasses

    import torch

    from envs.held_out import eval_specs, play_held_out
    from kernel import load_config
    from policy import SamplingConfig, load_tokenizer
    from trainer.config import TrainerConfig
    from trainer.factory import build_model
    from trainer.warmstart import warm_start

    torch.set_num_threads(a.threads)
    cfg = load_config(TrainerConfig, a.config, section="trainer")
    over = {k: v for k, v in (("steps", a.steps), ("lr", a.lr), ("batch", a.batch)) if v is not None}
    cfg = dataclasses.replace(cfg, warmstart=dataclasses.replace(cfg.warmstart, **over))
    tok = load_tokenizer(cfg.policy.tokenizer)
    model, mcfg = build_model(cfg)
    if a.load:
        model.load_state_dict(torch.load(a.load)["model"])
    sampling = {**cfg.tasks.sampling, **({"temperature": a.temperature} if a.temperature is not None else {})}
    specs = [s.spec for _, s in eval_specs(cfg.tasks.envs, a.eval_n, cfg.run.seed)]
    at = {int(x) for x in a.eval_at.split(",") if x}
    evals, t0, train_s = [], time.perf_counter(), [0.0]
    last = [time.perf_counter()]

    def after_step(step: int, losses: list[float]) -> None:
        train_s[0] += time.perf_counter() - last[0]
        if (step + 1) % 10 == 0:
            print(
                json.dumps({"step": step + 1, "nll": round(losses[-1], 4), "train_s": round(train_s[0], 1)}),
                flush=True,
            )
        if step + 1 in at:
            model.eval()
            t = time.perf_counter()
            with torch.no_grad():
                ev = play_held_out(model, tok, specs, SamplingConfig.from_dict(sampling), cfg.run.seed)
            ev.update(
                step=step + 1,
                temperature=sampling["temperature"],
                nll_last10=sum(losses[-10:]) / len(losses[-10:]),
                train_s=round(train_s[0], 1),
                eval_s=round(time.perf_counter() - t, 1),
            )
            evals.append(ev)
            print(json.dumps(ev), flush=True)
            model.train()
        last[0] = time.perf_counter()

    if cfg.warmstart.steps:
        losses = warm_start(model, cfg, mcfg, tok, cfg.warmstart.style, after_step=after_step)
    else:  # evaluate a saved policy as it is
        at, losses = {0}, [float("nan")]
        after_step(-1, losses)
    if a.save:
        torch.save({"model": model.state_dict(), "model_config": mcfg.to_dict()}, a.save)
    out = {
        "steps": cfg.warmstart.steps,
        "lr": cfg.warmstart.lr,
        "batch": cfg.warmstart.batch,
        "nll": {str(i): round(losses[i], 4) for i in range(0, len(losses), max(1, len(losses) // 20))},
        "nll_final_mean10": sum(losses[-10:]) / len(losses[-10:]),
        "train_s": round(train_s[0], 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "evals": evals,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(out)


if __name__ == "__main__":
    main()
