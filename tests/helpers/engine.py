"""Engine test helpers: a tiny model config, perturbed states (a trainer step stand-in) and
reference logprobs to check rollouts against."""

from __future__ import annotations

import torch

import policy

CFG = policy.ModelConfig.tiny(vocab_size=64, max_seq_len=128)


def perturb(state: dict, frac: float, scale: float, seed: int) -> dict:
    """A new bf16 state with `frac` of the elements moved by N(0, scale) (a trainer step stand-in)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in state.items():
        flat = v.clone().reshape(-1)
        m = torch.rand(flat.shape, generator=g) < frac
        flat[m] = (flat[m].float() + torch.randn(int(m.sum()), generator=g) * scale).to(v.dtype)
        new[k] = flat.reshape(v.shape)
    return new


def reference_logprobs(states: dict[int, dict], prompt, completion, versions, cfg=CFG) -> torch.Tensor:
    """Replays a generation one token at a time on a fresh model and cache, loading the weights of
    each token's recorded version before computing its logits (earlier KV entries are kept, as in
    the engine). Plain softmax: the tests sample with temperature 1, no truncation."""
    model = policy.Transformer(cfg).eval()
    cache = policy.KVCache(cfg, slots=1, max_len=len(prompt) + len(completion))
    out, loaded = [], None
    for i, (tok, v) in enumerate(zip(completion, versions)):
        if v != loaded:
            model.load_inference_state(states[v])
            loaded = v
        logits = (
            model.prefill(prompt, cache, 0) if i == 0 else model.decode([completion[i - 1]], cache, [0])[0]
        )
        out.append(torch.log_softmax(logits.float(), -1)[tok])
    return torch.stack(out)


class RecordingEngine:
    """The torch engine, with every Generation it returns kept in order (what the engine generated)."""

    def __init__(self, eng):
        self.eng, self.gens = eng, []

    def __getattr__(self, name):
        return getattr(self.eng, name)

    async def generate(self, *a, **kw):
        g = await self.eng.generate(*a, **kw)
        self.gens.append(g)
        return g

    async def extend(self, *a, **kw):
        g = await self.eng.extend(*a, **kw)
        self.gens.append(g)
        return g
