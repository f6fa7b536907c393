"""One held-out evaluator for both sides of bench.peer: each policy folder scored the same way.

    python -m bench.peer_eval --tokenizer DIR [--n 256] [--seed 0] [--json] SIDE:WALL_S:FOLDER ...

Every policy, asyncrl's (bf16, from `asyncrl export`) or TRL's (fp32, as it trains), is an HF
folder. Each is loaded by `policy.load_hf_checkpoint` (fp32 compute on the stored weights) and plays
the project's held-out eval (`trainer.evaluate.evaluate_model`, as `[up] final_eval` does): `n`
tasks of the env's eval split (disjoint from train by operand pair), drawn with `seed`, through the
tokenizer's chat template, sampled at the training temperature with the generator seeded by `seed`,
scored by the env's verifier. Same prompts, same random stream, same code for every policy; a
folder named twice (the shared starting model) is played once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ENV = "arith-chat-12"
# the training sampling of both sides: T 0.7, no top-p/top-k cut, 24 new tokens (arith-chat-12)
SAMPLING = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 24}


def distinct_problems(n: int, seed: int, env: str = ENV) -> int:
    """How many different problems the n held-out draws hold."""
    from envs.held_out import eval_specs

    return len({s.prompt for _, s in eval_specs([env], n, seed, "eval")})


def evaluate_policies(
    entries: list[dict],
    tokenizer: str,
    n: int = 256,
    seed: int = 0,
    env: str = ENV,
    log=print,
    max_tokens: int = SAMPLING["max_tokens"],
) -> list[dict]:
    """entries: {"side", "wall_s", "policy": folder, ...}; returns each with its held-out
    `success`, `tokens` (per answer) and `eval_s` added, in the given order."""
    import torch

    from policy import load_hf_checkpoint, load_hf_tokenizer
    from trainer.evaluate import evaluate_model

    tok = load_hf_tokenizer(tokenizer)
    done: dict[str, dict] = {}
    out = []
    for e in entries:
        key = str(Path(e["policy"]).resolve())
        if key not in done:
            t0 = time.perf_counter()
            _, model = load_hf_checkpoint(key, dtype=torch.float32)
            model.eval()
            sampling = {**SAMPLING, "max_tokens": max_tokens}
            r = evaluate_model(model, tok, [env], sampling, n, seed, chat_template=True, split="eval")
            done[key] = {
                "success": r["eval_success"],
                "tokens": r["eval_tokens"],
                "eval_s": round(time.perf_counter() - t0, 1),
            }
            del model
            log(f"eval {e['side']} @ {float(e['wall_s']):.0f} s: {done[key]['success']:.3f} ({key})")
        out.append({**e, **done[key]})
    return out


def parse_entry(s: str) -> dict:
    side, wall, folder = s.split(":", 2)
    return {"side": side, "wall_s": float(wall), "policy": folder}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("entries", nargs="+", help="SIDE:WALL_S:FOLDER")
    ap.add_argument("--tokenizer", required=True, help="HF folder with the tokenizer (the base model's)")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", default=ENV)
    ap.add_argument("--max-tokens", type=int, default=SAMPLING["max_tokens"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = evaluate_policies(
        [parse_entry(x) for x in a.entries], a.tokenizer, a.n, a.seed, a.env, max_tokens=a.max_tokens
    )
    result = {
        "env": a.env,
        "n": a.n,
        "seed": a.seed,
        "distinct_problems": distinct_problems(a.n, a.seed, a.env),
    }
    if a.json:
        print(json.dumps({**result, "policies": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
