"""Hold the sampler/learner mismatch under a target by capping the staleness allowed.

`max_k3 > 0`: after each version, the lag cap the batcher applies (samples older than it are
dropped or down-weighted, per `stale`) moves by one version: down while the batch's k3 (the
mismatch KL between the workers' behaviour logprobs and the learner's) is above max_k3, back up
towards `max_lag` once it is below half of it. The cap never goes below 1 (a lag of 0 would drop
nearly every asynchronous sample) unless max_lag itself is 0. Off (max_k3 = 0): the cap is max_lag.
"""

from __future__ import annotations


def next_lag_cap(cap: int, k3: float | None, max_k3: float, max_lag: int) -> int:
    """The lag cap for the next batch, from this version's cap and its batch's k3_mean."""
    if max_k3 <= 0:
        return max_lag
    if k3 is None:  # a version without live tokens says nothing about the mismatch
        return cap
    if k3 > max_k3:
        return max(min(1, max_lag), cap - 1)
    if k3 < max_k3 / 2:
        return min(max_lag, cap + 1)
    return cap
