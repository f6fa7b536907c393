"""Which replies a chat policy gives, by length and by success: where a cost penalty can go.

    python -m bench.answer_forms --json --model <smollm2 folder> [--checkpoint runs/X/checkpoints]

Samples `--prompts` held-out prompts of a chat env `--samples` times each (temperature, max_tokens
as the learning configs use), verifies every reply, and counts them per reply length in tokens
(eos included). A cost penalty only chooses among the forms a policy samples: the shortest length
with replies that verify is the floor it can reach without the policy learning something new.
`--checkpoint` (a trainer checkpoint or its folder: the newest) replaces the model's weights, so the
same prompts show what training changed. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np


def reply_forms(
    model, tok, env_name: str, prompts: int, samples: int, temperature: float, max_tokens: int, seed: int
):
    import torch

    from envs import get_env
    from envs.feeder import prompt_ids
    from policy import SamplingConfig, generate

    env, rng = get_env(env_name), random.Random(seed)
    tasks = [env.sample(rng, split="eval") for _ in range(prompts) for _ in range(samples)]
    ids = prompt_ids(tok, [t.prompt for t in tasks], True)
    outs = generate(
        model,
        ids,
        SamplingConfig(temperature=temperature),
        max_tokens,
        [tok.eos_id],
        torch.Generator().manual_seed(seed),
    )
    rows: dict[int, dict] = {}
    for out, task in zip(outs, tasks, strict=True):
        text = tok.decode([i for i in out.ids if i != tok.eos_id])
        row = rows.setdefault(len(out.ids), {"tokens": len(out.ids), "n": 0, "right": 0, "example": text})
        row["n"] += 1
        row["right"] += int(env.verify(text, task.spec).success >= 1.0)
    lengths = np.array([len(o.ids) for o in outs], dtype=np.float64)
    right = [r["tokens"] for r in rows.values() if r["right"]]
    return {
        "replies": len(outs),
        "success": sum(r["right"] for r in rows.values()) / len(outs),
        "tokens_mean": float(lengths.mean()),
        "shortest_right_tokens": min(right) if right else None,
        "by_length": [rows[k] for k in sorted(rows)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.answer_forms", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="pretrained model folder (asyncrl model prepare)")
    ap.add_argument("--checkpoint", default="", help="trainer checkpoint (or folder) to load over it")
    ap.add_argument("--env", default="arith-chat")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    a = ap.parse_args(argv)

    import torch

    import policy
    from scorer.calibrate import load_policy_file

    torch.manual_seed(a.seed)
    _, model = policy.load_hf_checkpoint(a.model)
    tok, source = policy.load_hf_tokenizer(a.model), a.model
    if a.checkpoint:
        model, source = load_policy_file(a.checkpoint)
    res = reply_forms(model.eval(), tok, a.env, a.prompts, a.samples, a.temperature, a.max_tokens, a.seed)
    res = {"source": source, "env": a.env, **res}
    if not a.json:
        for r in res["by_length"]:
            print(f"{r['tokens']:3d} tokens  {r['right']:3d} / {r['n']:3d} right   e.g. {r['example']!r:.60}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
