"""λ of the cost penalty from the trainer's side. The task feeder stamps every group with the value
of KV rl-control/lambda when it publishes it (so a group is scored with one λ); a schedule
([trainer.cost] schedule) may move that value once per version:
    fixed   the trainer never writes it (`asyncrl up --lambda`, `calibrate-cost --write`, a person)
    ramp    λ_v = target · min(1, v / ramp_versions): success is learnt before cost
    budget  λ is a dual variable: after version v, with T_v its mean tokens per answer,
            λ <- max(0, λ + budget_lr · (T_v / budget_tokens - 1)), read from and written back to KV
            (a restarted trainer carries on from the value there)
The formulas are policy/reward.py's (ramp_lambda, budget_step); this module reads and writes KV.
The KV value's format: bus/control.py.
"""

from __future__ import annotations

from bus import topology as topo
from bus.control import format_lambda, parse_lambda
from kernel import get_logger
from policy.reward import budget_step, ramp_lambda

log = get_logger(__name__)


async def read(bus, last: float | None = None) -> float | None:
    """The KV λ now; `last` when the key is absent or holds a bad value (a typo must not unprice a group)."""
    try:
        return parse_lambda(await bus.kv_get(topo.KEY_LAMBDA))
    except ValueError as e:
        if last is not None or "empty" not in str(e):
            log.warning("lambda in KV unusable; keeping the last", error=str(e), keeping=last)
        return last


class LambdaSchedule:
    """Writes λ to KV per version under `cfg.cost.schedule` (nothing under "fixed")."""

    def __init__(self, cfg):
        self.cfg = cfg

    async def start(self, bus, version: int) -> dict:
        """Before the first task is fed: a ramp's λ for this version."""
        if self.cfg.cost.schedule == "ramp":
            return await self._write(
                bus, ramp_lambda(self.cfg.cost.target, self.cfg.cost.ramp_versions, version), version
            )
        return {}

    async def after_version(self, bus, version: int, tokens_per_answer: float | None) -> dict:
        """λ for the groups fed from now on; -> metrics (lambda_next, and the budget's inputs)."""
        cfg = self.cfg
        if cfg.cost.schedule == "ramp":
            return await self._write(
                bus, ramp_lambda(cfg.cost.target, cfg.cost.ramp_versions, version), version
            )
        if cfg.cost.schedule != "budget" or tokens_per_answer is None:
            return {}
        lam = await read(bus, None) or 0.0
        new = budget_step(lam, tokens_per_answer, cfg.cost.budget_tokens, cfg.cost.budget_lr)
        log.info(
            "budget lambda",
            version=version,
            tokens_per_answer=round(tokens_per_answer, 2),
            budget_tokens=cfg.cost.budget_tokens,
            old=lam,
            new=new,
        )
        return {
            **(await self._write(bus, new, version)),
            "lambda_prev": lam,
            "budget_ratio": tokens_per_answer / cfg.cost.budget_tokens,
        }

    async def _write(self, bus, lam: float, version: int) -> dict:
        try:
            await bus.kv_put(topo.KEY_LAMBDA, format_lambda(lam))
        except Exception as e:  # the groups keep the last λ; the next version writes again
            log.warning("lambda write failed", error=str(e), version=version)
            return {}
        return {"lambda_next": lam}
