"""`python -m trainer --eval-final`: the held-out eval of the run's last checkpoint, after the run;
`--eval-initial`: the same eval of the policy the run started from (its warm start), unless the run
evaluated version 0 itself.

`asyncrl up` with `[up] final_eval = true` runs both, side by side, once the processes have stopped,
so the policy the run ended with is measured although the time limit fell between two `eval_every`
versions, and the training budget is not spent on either (`eval_every = 0`: no eval in the run).
The eval is the trainer's own (trainer/evaluate.py: the same eval-split tasks, sampling and seed
as every in-run eval) on the checkpoint's published bf16 bits, checked against the digest the
checkpoint recorded for them. Each row goes to metrics/trainer.jsonl like an in-run eval, marked
`eval_final` or `eval_initial`. The initial policy is the run's warmstart.pt, or without one the
trainer's seeded initial model (trainer/factory.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import delta_codec
from policy import ModelConfig, Transformer, inference_state, load_tokenizer

from . import checkpoint
from .config import TrainerConfig
from .evaluate import evaluate
from .factory import initial_model
from .shards import load_model_state


class FinalEvalError(RuntimeError):
    pass


def evaluate_checkpoint(cfg: TrainerConfig) -> dict:
    """-> the eval row of the newest checkpoint in cfg.checkpoint.dir (also appended to
    <cfg.run.dir>/metrics/trainer.jsonl); {} when the run already evaluated that version."""
    if cfg.tasks.eval_prompts < 1:
        raise FinalEvalError("eval_prompts must be >= 1 for a final eval")
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    if st is None:
        raise FinalEvalError(f"no checkpoint in {cfg.checkpoint.dir}: nothing to evaluate")
    rows = _rows(cfg)
    if any(r.get("eval_success") is not None and r.get("version") == st.version for r in rows):
        return {}
    mcfg = ModelConfig.from_dict(st.model_config)
    model = Transformer(mcfg)
    load_model_state(model, cfg.checkpoint.dir, st.model)  # a trainer group's shards too (DCP)
    published = inference_state(model)
    if st.digest and delta_codec.state_digest(published) != st.digest:
        raise FinalEvalError(f"checkpoint v{st.version}: bf16 state does not match its recorded digest")
    return _evaluate(cfg, published, mcfg, {"version": st.version, "epoch": st.epoch, "eval_final": True})


def evaluate_initial(cfg: TrainerConfig) -> dict:
    """-> the eval row of the policy the run started from (also appended to trainer.jsonl); {} when
    the run evaluated version 0 itself."""
    if cfg.tasks.eval_prompts < 1:
        raise FinalEvalError("eval_prompts must be >= 1 for an initial eval")
    if any(r.get("eval_success") is not None and r.get("version") == 0 for r in _rows(cfg)):
        return {}
    path = Path(cfg.run.dir) / "warmstart.pt" if cfg.run.dir else None
    if path is not None and path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        mcfg = ModelConfig.from_dict(saved["model_config"])
        model = Transformer(mcfg)
        model.load_state_dict(saved["model"])
        version = saved.get("version", 0)
    else:
        model, mcfg = initial_model(cfg)
        version = 0
    return _evaluate(cfg, inference_state(model.cpu()), mcfg, {"version": version, "eval_initial": True})


def _evaluate(cfg: TrainerConfig, published: dict, mcfg: ModelConfig, tags: dict) -> dict:
    t0 = time.time()
    cfg.configure_envs()
    ev = evaluate(
        published,
        mcfg,
        load_tokenizer(cfg.policy.tokenizer),
        cfg.tasks.envs,
        cfg.tasks.sampling,
        cfg.tasks.eval_prompts,
        cfg.run.seed,
        cfg.tasks.chat_template,
    )
    row = {**ev, **tags, "eval_s": time.time() - t0, "ts": time.time()}
    if cfg.run.dir:
        (Path(cfg.run.dir) / "metrics").mkdir(parents=True, exist_ok=True)
        with open(Path(cfg.run.dir) / "metrics" / "trainer.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def _rows(cfg: TrainerConfig) -> list[dict]:
    p = Path(cfg.run.dir) / "metrics" / "trainer.jsonl" if cfg.run.dir else None
    if p is None or not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
