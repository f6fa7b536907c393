"""Short supervised warm start on the environments' demonstrations, so RL starts from a policy
with non-trivial success (0 steps by default). Teacher-forced next-token NLL of the
demonstration given the prompt, with its own AdamW so the RL optimizer state stays untouched.
Multi-turn envs (`demonstration_turns`: oracle episodes) are laid out as the worker lays them out
(envs.conversation) and trained with the loss mask: observation tokens are context, never targets.

In a sharded trainer the warm start runs on every rank (`warm_start_learner`: a collective, see
trainer/commands.py), and so does anchoring the KL reference to the warm-started policy
(`anchor_reference`). An earlier run's warm start is loaded whole (`load_warm_start`,
`load_reference`: unsharded trainers)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from envs import get_env
from envs.conversation import chat_format
from kernel import get_logger
from policy import ModelConfig, SamplingConfig, load_tokenizer, sequence_logprobs

from .buckets import length_buckets
from .commands import Collective, collective
from .config import TrainerConfig
from .fsdp import is_sharded
from .learner import Learner

log = get_logger(__name__)


def demo_batch(env_names: list[str], n: int, rng: random.Random, tok, style: str = "default"):
    """(prompts, completions, loss masks): ids of n demonstrations; mask 1 where the policy is
    trained (the whole single-turn answer; an episode's model turns)."""
    prompts, completions, masks = [], [], []
    for i in range(n):
        env = get_env(env_names[i % len(env_names)])
        ts = env.sample(rng, split="train")
        if hasattr(env, "demonstration_turns"):
            prompt, parts = env.demonstration_turns(ts.spec, chat_format(tok))
            prompts.append(tok.encode(prompt, bos=True))
            ids = [tok.encode(text) for text, _ in parts]
            completions.append([t for x in ids for t in x])
            masks.append([int(model) for x, (_, model) in zip(ids, parts) for _ in x])
            continue
        prompts.append(tok.encode(ts.prompt, bos=True))
        completions.append(tok.encode(env.demonstration(ts.spec, style), eos=True))
        masks.append([1] * len(completions[-1]))
    return prompts, completions, masks


class SuccessStop:
    """The stop criterion of a warm start with [trainer.warmstart] until > 0: after every
    `check_every` steps from `check_from`, the policy plays `check_n` train-split tasks (the same
    ones each check: checks are comparable) at [trainer.tasks] sampling; the warm start stops once
    their success >= `until`. Train split on purpose: picking the stop point on the eval split
    would leak the held-out metric."""

    def __init__(self, cfg, tok, on_check: Callable[[dict], None] | None = None):
        self.cfg, self.tok, self.on_check = cfg, tok, on_check
        ws = cfg.warmstart
        self.until, self.every, self.start = float(ws.until), int(ws.check_every), int(ws.check_from)
        self.checks: list[dict] = []

    def due(self, done: int) -> bool:
        return self.until > 0 and done >= max(self.start, 1) and (done - self.start) % self.every == 0

    def __call__(self, model, done: int) -> bool:
        """Check the policy after `done` steps; True = stop here. Leaves the model in train mode."""
        from .evaluate import evaluate_model

        cfg, t = self.cfg, time.perf_counter()
        model.eval()
        try:
            ev = evaluate_model(
                model,
                self.tok,
                cfg.tasks.envs,
                cfg.tasks.sampling,
                cfg.warmstart.check_n,
                cfg.run.seed + 104729,
                cfg.tasks.chat_template,
                split="train",
            )
        finally:
            model.train()
        # not eval_* keys: the run's summary takes its held-out figures from those
        rec = {
            "warmstart_step": done,
            "warmstart_check_success": ev["eval_success"],
            "warmstart_check_n": ev["eval_n"],
            "warmstart_check_s": round(time.perf_counter() - t, 2),
        }
        self.checks.append(rec)
        log.info(
            "warm start check",
            step=done,
            success=round(ev["eval_success"], 4),
            until=self.until,
            n=ev["eval_n"],
            seconds=rec["warmstart_check_s"],
        )
        if self.on_check is not None:
            self.on_check(rec)
        return ev["eval_success"] >= self.until


def warm_start(
    model,
    cfg,
    model_cfg=None,
    tok=None,
    style: str = "default",
    after_step=None,
    on_check: Callable[[dict], None] | None = None,
) -> list[float]:
    """cfg.warmstart.steps AdamW steps of demonstration NLL; returns the loss per step (its length
    is the number of steps done). With cfg.warmstart.until > 0 the warm start stops early once a
    SuccessStop check passes (cfg.warmstart.steps is the cap); `on_check(record)` gets each check.
    `after_step(step, losses)`, when given, runs after each step (bench/swe_warmstart.py evaluates
    the policy on its way: it must leave the model in train mode)."""
    tok = tok or load_tokenizer(cfg.policy.tokenizer)
    stop = SuccessStop(cfg, tok, on_check)
    rng = random.Random(cfg.run.seed + 7919)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart.lr)
    losses = []
    model.train()
    threads = torch.get_num_threads()
    if cfg.warmstart.threads:  # nothing else computes while the policy warm-starts
        torch.set_num_threads(cfg.warmstart.threads)
    # the next step's demonstrations are drawn (multi-turn: oracle episodes played in the sandbox, the
    # first time a task comes up) while this step trains; one thread, so the draws keep their order
    pool = ThreadPoolExecutor(1, thread_name_prefix="warmstart-demos")
    try:
        nxt = pool.submit(demo_batch, cfg.tasks.envs, cfg.warmstart.batch, rng, tok, style)
        for step in range(cfg.warmstart.steps):
            prompts, completions, masks = nxt.result()
            if step + 1 < cfg.warmstart.steps:
                nxt = pool.submit(demo_batch, cfg.tasks.envs, cfg.warmstart.batch, rng, tok, style)
            losses.append(_step(model, opt, prompts, completions, masks))
            if step % 50 == 0 or step == cfg.warmstart.steps - 1:
                log.info("warm start", step=step, nll=round(losses[-1], 4))
            if after_step is not None:
                after_step(step, losses)
            if stop.due(step + 1) and step + 1 < cfg.warmstart.steps and stop(model, step + 1):
                log.info(
                    "warm start stopped",
                    step=step + 1,
                    success=stop.checks[-1]["warmstart_check_success"],
                    until=stop.until,
                    cap=cfg.warmstart.steps,
                )
                break
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)
    return losses


def _step(model, opt, prompts, completions, masks) -> float:
    """One AdamW step of masked demonstration NLL; -> the loss."""
    # a demonstration longer than the model's context cannot be trained on (nor played by it)
    fits = [
        i for i, (p, c) in enumerate(zip(prompts, completions)) if len(p) + len(c) <= model.cfg.max_seq_len
    ]
    if not fits:
        raise ValueError(f"no demonstration fits max_seq_len {model.cfg.max_seq_len}")
    prompts, completions, masks = ([x[i] for i in fits] for x in (prompts, completions, masks))
    opt.zero_grad(set_to_none=True)
    n_tokens = max(sum(map(sum, masks)), 1)
    loss = 0.0
    # padded forwards over runs of similar length: a long-tailed env would pad all to the longest
    for run in length_buckets([len(p) + len(c) for p, c in zip(prompts, completions)], len(prompts)):
        res = sequence_logprobs(
            model,
            [prompts[i] for i in run],
            [completions[i] for i in run],
            SamplingConfig(temperature=1.0),
            replay_mask=False,
        )
        part = -(res.logprobs * res.valid * _pad([masks[i] for i in run], res.logprobs)).sum() / n_tokens
        part.backward()
        loss += part.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss)


def _pad(masks: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """Loss masks as a [B, T] tensor aligned with sequence_logprobs' completion positions."""
    out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    for i, m in enumerate(masks):
        out[i, : len(m)] = torch.tensor(m, dtype=like.dtype)
    return out


# -- on every rank of a trainer ----------------------------------------------------------------------


def warm_start_learner(
    learner: Learner,
    cfg: TrainerConfig,
    model_cfg: ModelConfig | None,
    style: str = "default",
    on_check: Callable[[dict], None] | None = None,
) -> list[float]:
    """The warm start of the learner's model, on every rank: a sharded model's forward and backward
    are collectives, so rank 0 alone would wait forever for its peers. Every rank draws the same
    demonstrations (same seed) and FSDP2 averages identical gradients: the same update as one
    process. A success-stopped warm start ([trainer.warmstart] until) checks on every rank alike:
    same tasks, same sampling seed, identical logits, so every rank stops at the same step.
    `on_check` (rank 0's record of each check) is not sent to the other ranks."""
    return collective(WarmStart(cfg, model_cfg, style, on_check), learner)


def anchor_reference(learner: Learner) -> None:
    """The KL penalty's reference becomes the current policy: after a warm start RL is kept near
    the warm-started policy, not the random initial weights. Every rank copies its own shard."""
    if learner.reference is not None:
        collective(AnchorReference(), learner)


def load_reference(reference, path: str) -> bool:
    """A resumed run's KL reference from its saved warmstart.pt (whole state, unsharded trainer);
    False where that cannot be done (the reference then stays the initial weights)."""
    if reference is None or is_sharded(reference):
        return False
    reference.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
    return True


def load_warm_start(model, path: str, model_cfg: ModelConfig) -> dict:
    """An earlier run's warmstart.pt into the model (whole-state file, unsharded trainer); -> the
    saved record. A file of another model shape is refused before anything is loaded."""
    if is_sharded(model):
        raise ValueError(
            "[trainer.warmstart] reuse loads a whole-model warmstart.pt; a sharded trainer cannot use it"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("model_config") != model_cfg.to_dict():
        raise ValueError(
            f"[trainer.warmstart] reuse {path}: saved for model {saved.get('model_config')}, "
            f"this trainer's is {model_cfg.to_dict()}"
        )
    model.load_state_dict(saved["model"])
    return saved


@dataclass(frozen=True)
class WarmStart(Collective[list], on=Learner):
    """Every rank runs `warm_start` on its model (see warm_start_learner); -> the loss per step."""

    cfg: TrainerConfig
    model_cfg: ModelConfig | None
    style: str = "default"
    on_check: Callable[[dict], None] | None = None

    def wire(self) -> WarmStart:
        return replace(self, on_check=None)  # rank 0's callback stays there

    def run(self, learner: Learner) -> list[float]:
        return warm_start(learner.model, self.cfg, self.model_cfg, style=self.style, on_check=self.on_check)


@dataclass(frozen=True)
class AnchorReference(Collective[None], on=Learner):
    """Every rank copies its shard of the policy into its shard of the reference."""

    def run(self, learner: Learner) -> None:
        for m in (learner.model, learner.reference):
            if is_sharded(m):  # a forward without backward (a success check) leaves the root unsharded
                m.reshard()  # local: frees the gathered copy, so both sides are shards again
        with torch.no_grad():
            for r, p in zip(learner.reference.parameters(), learner.model.parameters()):
                r.copy_(p)
