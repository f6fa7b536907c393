"""The HF checkpoint folder the vLLM engine starts from: written from a model config when the
worker has no folder (weights arrive with the first keyframe), and read by header only to tell
which tensors of a keyframe differ from what vLLM loaded from disk."""

from __future__ import annotations

from pathlib import Path

import torch

import policy
from policy.hf import save_hf_checkpoint


def write_hf_dir(model_config: dict, folder: Path) -> Path:
    """An HF checkpoint folder for a policy model config (weights arrive with the first keyframe)."""
    cfg = policy.ModelConfig.from_dict(model_config)
    with torch.device("meta"):
        model = policy.Transformer(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    return save_hf_checkpoint(model, folder)


def checkpoint_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (safetensors file, shape), read from headers only."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = (str(f), tuple(fh.get_slice(k).get_shape()))
    return out


def differs_from_checkpoint(state: dict[str, torch.Tensor], hf_names: dict[str, str], index) -> list[str]:
    """Names whose bf16 bits differ from the checkpoint vLLM loaded (one tensor in memory at a time)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for k in state:
        by_file.setdefault(index[hf_names[k]][0], []).append(k)
    out = []
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as fh:
            out += [
                k for k in names if not torch.equal(state[k], fh.get_tensor(hf_names[k]).to(torch.bfloat16))
            ]
    return out
