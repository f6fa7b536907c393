"""A tiny char-level model and a one-bug task for multi-turn episode tests (torch and vLLM engines)."""

from __future__ import annotations

import torch

import policy
from envs.episode import EpisodeTask

TOK = policy.CharTokenizer.default()
CFG = policy.ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=2048)
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def no_special_state(seed: int = 0) -> dict:
    """A random model that never samples pad/bos/eos: residual dim 0 is a constant 1 that no layer
    writes to, and the lm_head rows of the special ids read it with a large negative weight.
    Every turn then ends by length, so the conversation text tokenises back to the same ids."""
    torch.manual_seed(seed)
    m = policy.Transformer(CFG)
    with torch.no_grad():
        m.tok_emb.weight[:, 0] = 1.0
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p[0, :] = 0.0
        m.lm_head.weight[:3, :] = 0.0
        m.lm_head.weight[:3, 0] = -1000.0
    return policy.inference_state(m, dtype=torch.bfloat16)


def bug_task() -> EpisodeTask:
    return EpisodeTask(
        "t-add",
        "test",
        "train",
        "Fix calc.py.",
        {"calc.py": "def add(a, b):\n    return a - b\n", "test_calc.py": TESTS},
        {"test_calc.py": TESTS},
        "mini",
        ["test_calc.py"],
        ["test_calc.py::test_add"],
        [],
    )
