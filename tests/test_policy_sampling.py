"""Sampling transform: the shipped mask rebuilds exactly the kept set; behaviour logprobs are
the truncated, renormalised ones; wire form round-trips and bad forms are refused."""

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import FULL, SamplingConfig, SamplingMask, sample
from tests.helpers.tolerance import elementwise_rtol, sum_rtol


def reference_kept(logits_row: np.ndarray, cfg: SamplingConfig) -> set[int]:
    """Independent per-row reference in float64: smallest prefix of the sorted dist reaching top_p."""
    if cfg.temperature == 0:
        return {int(np.argmax(logits_row))}
    z = logits_row.astype(np.float64) / cfg.temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z.max())
    p /= p.sum()
    n = len(p) if cfg.top_p >= 1 else int(np.searchsorted(np.cumsum(p), cfg.top_p) + 1)
    if cfg.top_k:
        n = min(n, cfg.top_k)
    return {int(i) for i in order[: max(n, 1)]}


CFGS = [
    SamplingConfig(1.0, 0.9, 0),
    SamplingConfig(0.7, 1.0, 5),
    SamplingConfig(1.3, 0.5, 3),
    SamplingConfig(0.0, 1.0, 0),
    SamplingConfig(1.0, 1.0, 0),
    SamplingConfig(2.0, 0.95, 40),
]


def test_mask_rebuilds_exact_kept_set_and_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CFGS) * 20, 300, generator=g) * 3
    cfgs = CFGS * 20
    out = sample(logits, cfgs, torch.Generator().manual_seed(1))
    mask = SamplingMask.from_wire(msgpack.unpackb(msgpack.packb(out.mask.to_wire())))
    keep = mask.keep_matrix(300)
    for i, cfg in enumerate(cfgs):
        ref = reference_kept(logits[i].numpy(), cfg)
        got = set(torch.nonzero(keep[i])[:, 0].tolist())
        # float32 vs float64 may disagree only when a cumulative mass sits on top_p itself
        assert got == ref, (i, cfg, len(got), len(ref))
        assert int(out.tokens[i]) in got
        if not cfg.truncates:
            assert mask.counts[i] == FULL and mask.row(i) is None
        z = logits[i].double() / (cfg.temperature or 1.0)
        kept = torch.tensor(sorted(got))
        expect = z[out.tokens[i]] - torch.logsumexp(z[kept], 0)
        # why: fp32 log-softmax vs float64: a sum of <= 300 exps (log turns its relative error absolute)
        # and the scaling, subtraction and exp/log of logits up to |z| (~3 roundings each)
        tol = sum_rtol(300) + elementwise_rtol(3, cond=float(z.abs().max()))
        assert abs(float(out.logprobs[i]) - float(expect)) <= tol
    greedy = [i for i, c in enumerate(cfgs) if c.temperature == 0]
    assert torch.equal(out.tokens[greedy], logits[greedy].argmax(-1))  # why equal: integer token ids
    assert torch.all(out.logprobs[greedy] == 0)


def test_samples_follow_the_truncated_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    out = sample(logits, SamplingConfig(1.0, 0.8, 0), torch.Generator().manual_seed(3))
    freq = torch.bincount(out.tokens, minlength=4).double() / 20000
    assert freq[2] == 0 and freq[3] == 0  # outside the 0.8 nucleus: never drawn
    # why: 20000 draws: binomial sd sqrt(.625 * .375 / 20000) = 0.0034, so 0.02 is ~6 sd (false alarm < 1e-8)
    assert abs(freq[0] - 0.625) < 0.02 and abs(freq[1] - 0.375) < 0.02  # renormalised 0.5/0.8, 0.3/0.8
    # why: log of a 2-term renormalisation in fp32: ~5 roundings of inputs up to |log 0.3| = 1.2 vs log 0.625
    want = torch.tensor(np.log(0.625), dtype=torch.float32)
    assert torch.allclose(
        out.logprobs[out.tokens == 0], want, rtol=elementwise_rtol(5, cond=1.2 / 0.47), atol=0
    )


def test_large_kept_sets_ship_compressed_and_exact():
    logits = torch.randn(40, 5000, generator=torch.Generator().manual_seed(0)) * 0.5  # flat: huge nuclei
    out = sample(logits, SamplingConfig(1.0, 0.9, 0), torch.Generator().manual_seed(1))
    wire = out.mask.to_wire()
    assert wire["format"] == "csr1z" and len(wire["ids"]) < len(out.mask.ids) * 4 / 3
    back = SamplingMask.from_wire(msgpack.unpackb(msgpack.packb(wire)))
    assert back == out.mask and torch.equal(back.keep_matrix(5000), out.mask.keep_matrix(5000))
    mixed = SamplingMask.concat([out.mask[:3], SamplingMask.full(2), out.mask[3:5]])
    assert SamplingMask.from_wire(mixed.to_wire()) == mixed
    with pytest.raises(ValueError, match="decompress"):
        SamplingMask.from_wire({**wire, "ids": wire["ids"][:-7]})
    with pytest.raises(ValueError, match="do not match"):
        SamplingMask.from_wire({**wire, "counts": np.array([1] * 40, "<i4").tobytes()})


def test_untruncated_rows_ship_nothing():
    out = sample(torch.randn(8, 50), SamplingConfig(1.0, 1.0, 0), torch.Generator().manual_seed(0))
    assert out.mask.to_wire() == {"format": "full", "rows": 8}
    assert out.mask.keep_matrix(50).all()


def test_untruncated_batch_takes_the_same_numbers_without_sorting():
    """A batch with nothing truncated skips the sort: its logprobs are the plain log-softmax and
    each row's draws match a batch where another row truncates (same generator stream per row)."""
    logits = torch.randn(6, 40)
    fast = sample(logits, SamplingConfig(0.7, 1.0, 0), torch.Generator().manual_seed(3))
    ref = (logits / 0.7).log_softmax(-1).gather(1, fast.tokens[:, None])[:, 0]
    # why equal: the untruncated path is this very expression (same kernels, same shapes, rows reduced
    # independently of each other): bit-exact by construction, and this test is what shows it
    torch.testing.assert_close(fast.logprobs, ref, atol=0, rtol=0)
    slow = sample(
        logits,
        [SamplingConfig(0.7, 1.0, 0)] * 5 + [SamplingConfig(0.7, 0.5, 0)],
        torch.Generator().manual_seed(3),
    )
    assert fast.tokens[:5].tolist() == slow.tokens[:5].tolist()
    torch.testing.assert_close(
        fast.logprobs[:5], slow.logprobs[:5], atol=0, rtol=0
    )  # why equal: as above, per row
    assert len(fast.mask) == 6 and (fast.mask.counts == FULL).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(0, 12), st.integers(0, 12))
def test_mask_slicing_and_concat(counts, a, b):
    counts = np.array([c if c != 6 else FULL for c in counts], np.int32)
    ids = np.arange(int(np.clip(counts, 0, None).sum()), dtype=np.int32)
    m = SamplingMask(counts, ids)
    a, b = sorted((min(a, len(m)), min(b, len(m))))
    assert SamplingMask.concat([m[:a], m[a:b], m[b:]]) == m
    assert SamplingMask.concat([m[i] for i in range(len(m))]) == m == SamplingMask.from_rows(m.row_parts())
    for i in range(len(m)):
        row = m.row(i)
        assert (row is None) == (counts[i] == FULL)
        if row is not None:
            assert len(row) == counts[i]
    assert SamplingMask.from_wire(m.to_wire()) == m


@pytest.mark.parametrize(
    "wire,match",
    [
        ({"rows": 2}, "bad sampling mask"),
        ({"format": "zip", "rows": 1}, "unknown sampling mask format"),
        ({"format": "csr1", "rows": 1, "counts": [1], "ids": b"\0\0\0\0"}, "byte strings"),
        (
            {
                "format": "csr1",
                "rows": 2,
                "counts": np.array([1], "<i4").tobytes(),
                "ids": np.array([3], "<i4").tobytes(),
            },
            "rows",
        ),
        (
            {
                "format": "csr1",
                "rows": 1,
                "counts": np.array([2], "<i4").tobytes(),
                "ids": np.array([3], "<i4").tobytes(),
            },
            "counts sum",
        ),
        ({"format": "csr1", "rows": 1, "counts": np.array([0], "<i4").tobytes(), "ids": b""}, ">= 1"),
        (
            {"format": "csr1", "rows": 1, "counts": np.array([1], "<i4").tobytes(), "ids": b"\0\0\0"},
            "byte strings",
        ),
    ],
)
def test_bad_mask_wire_refused(wire, match):
    with pytest.raises(ValueError, match=match):
        SamplingMask.from_wire(wire)


def test_bad_sampling_inputs_refused():
    for kw, match in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**kw)
    with pytest.raises(ValueError, match="2 sampling configs for 3 rows"):
        sample(torch.randn(3, 10), [SamplingConfig()] * 2)
    with pytest.raises(ValueError, match=r"logits \[B, V\]"):
        sample(torch.randn(10), SamplingConfig())
    with pytest.raises(ValueError, match=r"non-finite logits in rows \[1\]"):
        sample(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), SamplingConfig())
    with pytest.raises(ValueError, match=r"non-finite logits in rows \[0\]"):
        sample(torch.full((1, 3), float("-inf")), SamplingConfig())
    banned = sample(torch.tensor([[0.0, float("-inf"), 0.0]]).repeat(50, 1), SamplingConfig(1.0, 0.9, 0))
    assert not (banned.tokens == 1).any() and torch.isfinite(banned.logprobs).all()
    with pytest.raises(ValueError, match="vocab size"):
        SamplingMask([1], [12]).keep_matrix(10)
    assert SamplingConfig.from_dict(
        {"temperature": 0.5, "top_p": 0.9, "top_k": 0, "max_tokens": 9, "n": 4}
    ) == SamplingConfig(0.5, 0.9, 0)
