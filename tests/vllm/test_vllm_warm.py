"""The delta codec is warm inside vLLM's worker process once the engine has started (before:
the first delta took ~18 s to reach the model, compiling the codec's kernels while vLLM was
paused), and the warm-up leaves the weights alone: the first delta then lands bit for bit.
(The first delta's time is bench.vllm_stall's first_apply_ms: no timing asserted on a shared box.)"""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import delta_codec  # noqa: E402
from bench.vllm_stall import changed, make_checkpoint  # noqa: E402
from bus.events import SamplingParams  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def digest(state: dict[str, torch.Tensor]) -> str:
    """As the extension's asyncrl_weights_digest hashes its bf16 copy."""
    h = hashlib.sha256()
    for n, t in sorted(state.items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{n}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


async def test_codec_is_warm_in_vllms_worker_before_the_first_delta(tmp_path):
    from rollout_worker.vllm_engine import VLLMEngine

    state = make_checkpoint(tmp_path, hidden=128, layers=2, vocab=384, arch="llama")
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(tmp_path), slots=2, max_len=128, seed=0), enforce_eager=True
    )
    try:
        await eng.load_keyframe(state, version=0, epoch=1)  # starts vLLM; no delta yet
        ready = (await eng.llm.collective_rpc("asyncrl_codec_ready"))[0]
        assert ready["loaded"] and ready["warm_s"] > 0, ready
        assert eng.worker_warm_s == pytest.approx(ready["warm_s"], abs=1e-3)
        # the first delta, decoded in vLLM's worker: lands exactly (the warm-up left the copy alone)
        new = changed(eng.state, 0.01, seed=1)
        delta = delta_codec.encode_delta(eng.state, new, from_version=0, to_version=1)
        await eng.apply_delta(delta, epoch=1)
        assert eng.version == 1 and eng.stats()["delta_transport"] == "delta"
        worker = (await eng.llm.collective_rpc("asyncrl_weights_digest"))[0]
        assert worker["shadow"] == digest(new) == digest(eng.state)
        out = await eng.generate([5, 17, 42], SamplingParams(temperature=1.0, max_tokens=8), seed=3)
        assert out.token_versions == [1] * 8
    finally:
        await eng.close()
