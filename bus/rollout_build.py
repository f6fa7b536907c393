"""The one place a Rollout event is made from what a worker sampled: a completion (an engine
Generation) or a whole episode (its trajectory, laid out with a Generation's fields)."""

from __future__ import annotations

from bus.events import Rollout, Task


def build_rollout(
    task: Task,
    index: int,
    group_size: int,
    worker_id: str,
    prompt_ids: list[int],
    sampled,
    text: str,
    wall_s: float,
    loss_mask: list[int] | None = None,
    result=None,
    turns: int = 1,
    episode: dict | None = None,
) -> Rollout:
    """Sample `index` of `task`'s group. `sampled` has a Generation's completion_ids, logprobs,
    token_versions, sampling_mask (wire form), quant, finish_reason and epoch; `text` its decoded
    ids. An episode adds its loss mask, its envs.episode.EpisodeResult (`result`), its model turns
    and the keys `episode` adds to the result in Rollout.episode."""
    mask = list(loss_mask or [])
    ep = (
        {}
        if result is None
        else dict(
            turns=max(turns, 1),
            tool_calls=result.tool_calls,
            termination=result.termination,
            episode={**result.to_dict(), **(episode or {})},
        )
    )
    return Rollout(
        rollout_id=f"{task.task_id}-{index}",
        task_id=task.task_id,
        env=task.env,
        sample_index=index,
        group_size=group_size,
        prompt=task.prompt,
        spec=task.spec,
        prompt_ids=prompt_ids,
        completion_ids=sampled.completion_ids,
        completion_text=text,
        logprobs=sampled.logprobs,
        token_versions=sampled.token_versions,
        sampling=task.sampling,
        sampling_mask=sampled.sampling_mask,
        quant=sampled.quant,
        finish_reason=sampled.finish_reason,
        cost_tokens=sum(mask) if mask else len(sampled.completion_ids),
        wall_s=wall_s,
        worker_id=worker_id,
        split=task.split,
        epoch=sampled.epoch,
        loss_mask=mask,
        lambda_=task.lambda_,
        **ep,
    )  # lambda_: the group's λ
