"""Micro-batches of similar length: shared by the learner's RL step and the warm start (its own
module so that neither imports the other)."""

from __future__ import annotations


def length_buckets(
    lengths: list[int], max_batch: int, overhead_tokens: int = 64, max_tokens: int = 0
) -> list[list[int]]:
    """Split sequences into padded micro-batches of similar length (indices into `lengths`).

    A padded forward costs about batch x longest tokens, plus a fixed per-call cost; with a
    long-tailed length distribution one long answer would pad every short one to its length.
    Sorted by length, the cheapest split into contiguous runs is a small dynamic programme:
    best[j] = min_i best[i] + (j - i) * len[j-1] + overhead, with runs of at most max_batch
    sequences and (max_tokens > 0) at most max_tokens padded tokens; a sequence longer than
    max_tokens runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    srt = [lengths[i] for i in order]
    n, inf = len(srt), float("inf")
    best, cut = [0.0] + [inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, max(0, j - max_batch) - 1, -1):  # longer runs as i falls
            if max_tokens and j - i > 1 and (j - i) * srt[j - 1] > max_tokens:
                break
            c = best[i] + (j - i) * srt[j - 1] + overhead_tokens
            if c <= best[j]:  # ties: the longest run (the smallest i), as before
                best[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return runs[::-1]
