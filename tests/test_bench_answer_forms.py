"""bench.answer_forms on the real SmolLM2: every reply counted once, by its length, verified."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from asyncrl import model as M

    cache = None  # the one cache (asyncrl.model.cache_dir)
    if not M.is_prepared("smollm2", cache):
        pytest.skip("smollm2 not prepared (make models)")
    return M.model_dir("smollm2", cache)


def test_reply_forms_count_every_reply_by_length(smollm2, capsys):
    from bench.answer_forms import main

    assert (
        main(["--json", "--model", str(smollm2), "--prompts", "3", "--samples", "2", "--max-tokens", "6"])
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = res["by_length"]
    assert res["replies"] == 6 == sum(r["n"] for r in rows)
    assert [r["tokens"] for r in rows] == sorted({r["tokens"] for r in rows})
    assert all(1 <= r["tokens"] <= 6 and 0 <= r["right"] <= r["n"] for r in rows)
    assert res["success"] == sum(r["right"] for r in rows) / 6
    right = [r["tokens"] for r in rows if r["right"]]
    assert res["shortest_right_tokens"] == (min(right) if right else None)


def test_bad_checkpoint_is_a_clear_error(smollm2, tmp_path):
    from bench.answer_forms import main

    with pytest.raises(FileNotFoundError, match="no ckpt"):
        main(["--json", "--model", str(smollm2), "--checkpoint", str(tmp_path)])


def test_forced_forms_impose_their_opening_and_verify_the_whole_reply(smollm2):
    """The equation form (opening "a + b = ") is right far more often than a bare number the model
    must start with a digit (SmolLM2 echoes the first operand): the floor a penalty cannot pass."""
    import policy
    from bench.answer_forms import FORCED, forced_forms

    _, model = policy.load_hf_checkpoint(str(smollm2))
    tok = policy.load_hf_tokenizer(str(smollm2))
    res = forced_forms(model.eval(), tok, "arith-chat", prompts=8, seed=0)
    assert set(res) == set(FORCED)
    assert res["bare"]["example"].isdigit() and 2 <= res["bare"]["tokens_mean"] <= 4
    assert res["equation"]["example"].split("=")[0].count("+") == 1  # the imposed opening is kept
    assert res["the answer is"]["example"].startswith("The answer is ")
    assert res["equation"]["success"] >= 0.75 > res["bare"]["success"]
