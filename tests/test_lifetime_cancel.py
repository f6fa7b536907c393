"""cancel_and_wait: a background task that loses a cancel (as under Python 3.11's wait_for when
the reply lands first) still ends, so a process stop cannot hang on it."""

import asyncio

import pytest

from kernel.lifetime import cancel_and_wait


async def _loses_first_cancels(n: int, beats: list):
    """A heartbeat loop that swallows its first n cancels, as wait_for does when the awaited
    reply arrived before the cancel was delivered."""
    lost = 0
    while True:
        try:
            await asyncio.sleep(0.01)
            beats.append(1)
        except asyncio.CancelledError:
            if lost < n:
                lost += 1
                asyncio.current_task().uncancel()
                continue
            raise


@pytest.mark.asyncio
async def test_a_lost_cancel_hangs_a_plain_gather_but_not_cancel_and_wait():
    beats: list = []
    t = asyncio.create_task(_loses_first_cancels(1, beats))
    await asyncio.sleep(0.03)
    t.cancel()  # what the stop paths did before: one cancel, then wait
    done, _ = await asyncio.wait([t], timeout=0.3)
    assert not done, "the task should have survived one cancel (the failure mode)"
    n = len(beats)
    await asyncio.wait_for(cancel_and_wait([t], retry_s=0.05), 5)
    assert t.cancelled() and len(beats) - n < 50


@pytest.mark.asyncio
async def test_several_tasks_errors_retrieved_and_none_ignored():
    async def fails():
        raise RuntimeError("boom")

    beats: list = []
    ts = [asyncio.create_task(_loses_first_cancels(3, beats)), asyncio.create_task(fails()), None]
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cancel_and_wait(ts, retry_s=0.02), 5)
    assert ts[0].cancelled() and isinstance(ts[1].exception(), RuntimeError)
