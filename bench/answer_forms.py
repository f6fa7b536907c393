"""Which replies a chat policy gives, by length and by success: where a cost penalty can go.

    python -m bench.answer_forms --json --model <smollm2 folder> [--checkpoint runs/X/checkpoints]

Samples `--prompts` held-out prompts of a chat env `--samples` times each (temperature, max_tokens
as the learning configs use), verifies every reply, and counts them per reply length in tokens
(eos included). A cost penalty only chooses among the forms a policy samples: the shortest length
with replies that verify is the floor it can reach without the policy learning something new.
`--checkpoint` (a trainer checkpoint or its folder: the newest) replaces the model's weights, so the
same prompts show what training changed. `--forced` adds each form's greedy accuracy when it is
imposed (FORCED: a bare number, "The answer is ", "a + b = "): whether a short form the policy
rarely samples is one it could answer in. Last stdout line: one JSON object.
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


# reply forms forced by their opening words: what the policy answers when a form is imposed
# ("bare": no words, the first token restricted to a digit)
FORCED = {"bare": "", "the answer is": "The answer is ", "equation": "{a} + {b} = "}


def bare_answer(model, ids: list[int], digits: dict[int, str], most: int = 3) -> str:
    """The model's greedy number when it must start its reply with a digit: digits while its argmax
    over all tokens is one (the first one's argmax taken over digits only)."""
    import torch

    text, ids = "", list(ids)
    keys = torch.tensor(list(digits))
    for k in range(most):
        logits = model(torch.tensor([ids]))[0, -1]
        best = int(keys[logits[keys].argmax()]) if k == 0 else int(logits.argmax())
        if best not in digits:
            break
        text, ids = text + digits[best], ids + [best]
    return text


def forced_forms(model, tok, env_name: str, prompts: int, seed: int, answer_tokens: int = 4) -> dict:
    """Greedy accuracy of each form in FORCED on `prompts` held-out prompts: the form's opening
    words are appended to the prompt, the model writes the rest (`answer_tokens` at most). A form
    that is rarely sampled may still be one the model answers right when made to; a penalty can
    only reach a short form the model can answer in."""
    import torch

    from envs import get_env
    from envs.feeder import prompt_ids
    from policy import SamplingConfig, generate

    env, rng = get_env(env_name), random.Random(seed)
    tasks = [env.sample(rng, split="eval") for _ in range(prompts)]
    base = prompt_ids(tok, [t.prompt for t in tasks], True)
    out = {}
    encoded = {d: tok.encode(d) for d in "0123456789"}
    digits = {v[0]: d for d, v in encoded.items() if len(v) == 1}  # digit token id -> its digit
    with torch.no_grad():
        bare = [bare_answer(model, b, digits) for b in base]
    out["bare"] = {
        "success": sum(env.verify(x, t.spec).success >= 1.0 for x, t in zip(bare, tasks, strict=True))
        / len(tasks),
        "tokens_mean": float(np.mean([len(tok.encode(x)) + 1 for x in bare])),  # + eos
        "example": bare[0],
    }
    for name, opening in FORCED.items():
        if name == "bare":
            continue
        heads = [opening.format(**t.spec) for t in tasks]
        ids = [b + tok.encode(h) for b, h in zip(base, heads, strict=True)]
        gens = generate(
            model, ids, SamplingConfig(temperature=0.0), answer_tokens, [tok.eos_id], torch.Generator()
        )
        right, lengths = 0, []
        for g, h, t, b, i in zip(gens, heads, tasks, base, ids, strict=True):
            tail = tok.decode([x for x in g.ids if x != tok.eos_id])
            right += int(env.verify(h + tail, t.spec).success >= 1.0)
            lengths.append(len(i) - len(b) + len(g.ids))  # opening + written tokens (eos included)
        out[name] = {
            "success": right / len(tasks),
            "tokens_mean": float(np.mean(lengths)),
            "example": heads[0] + tok.decode([x for x in gens[0].ids if x != tok.eos_id]),
        }
    return out


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
    ap.add_argument(
        "--forced", action="store_true", help="also each form's greedy accuracy when imposed (FORCED)"
    )
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
    if a.forced:
        res["forced"] = forced_forms(model, tok, a.env, a.prompts, a.seed)
    if not a.json:
        for r in res["by_length"]:
            print(f"{r['tokens']:3d} tokens  {r['right']:3d} / {r['n']:3d} right   e.g. {r['example']!r:.60}")
        for name, r in res.get("forced", {}).items():
            ok, n = r["success"], r["tokens_mean"]
            print(f"forced {name!r}: {ok:.3f} right at {n:.1f} tokens, e.g. {r['example']!r}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
