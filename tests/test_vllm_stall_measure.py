"""The vLLM engine's update stall and busy time (rollout_worker/vllm_requests.py StreamMetrics), without
vLLM: the calls VLLMEngine makes (a request submitted, a token streamed, an update loaded, a request
gone) on a made-up clock. Measured as the torch engine measures them: per request, its last token
before the update to its first token after it; idle time is neither stall nor busy."""

import pytest

from rollout_worker.engine import EngineMetrics
from rollout_worker.vllm_requests import RequestState, StreamMetrics


class Driver:
    """What VLLMEngine does around StreamMetrics: `_reqs`, `_on_output`, `_run`'s finally, `_push`."""

    def __init__(self) -> None:
        self.metrics = EngineMetrics(slots=4)
        self.stream = StreamMetrics(self.metrics)
        self.reqs: dict[str, RequestState] = {}

    def submit(self, rid: str) -> None:
        self.reqs[rid] = RequestState()

    def token(self, rid: str, t: float) -> None:
        self.stream.output(rid, self.reqs[rid], 1, len(self.reqs), t)

    def done(self, rid: str) -> None:
        del self.reqs[rid]
        self.stream.left(rid, len(self.reqs))

    def update(self, apply_s: float, t_loaded: float) -> None:
        self.stream.loaded(self.reqs, apply_s, t_loaded)


def decode(e: Driver, rid: str, t0: float, n: int, step: float = 0.010) -> float:
    for i in range(n):
        e.token(rid, t0 + i * step)
    return t0 + (n - 1) * step


def test_an_update_while_idle_records_no_stall_and_idle_is_not_busy():
    e = Driver()
    e.submit("a")
    decode(e, "a", 10.0, 11)  # 10.00 .. 10.10: 0.1 s busy
    e.done("a")
    e.update(apply_s=1.0, t_loaded=15.0)  # five idle seconds later
    assert e.metrics.updates == 1 and list(e.metrics.apply_ms) == [pytest.approx(1000.0)]
    assert not e.metrics.stall_ms and e.stream.stall is None
    e.submit("b")  # after the update: its tokens close nothing
    decode(e, "b", 15.5, 3)
    assert not e.metrics.stall_ms and e.metrics.updates == 1
    assert e.metrics.busy_s == pytest.approx(0.1 + 0.02)  # not the idle 10.1 -> 15.5


def test_an_update_mid_decode_stalls_apply_plus_one_step():
    e = Driver()
    e.submit("a")
    decode(e, "a", 10.0, 11)
    e.done("a")  # idle 10.1 -> 13.0: not part of the next stall
    e.submit("b")
    last = decode(e, "b", 13.0, 6)  # b decoding, last token at 13.05
    e.submit("c")  # submitted, still prefilling at the update: not decoding
    # pause at 13.05, loaded at 14.05 (apply 1.0 s); resume; c's first token, then b's next, one step on
    e.update(apply_s=1.0, t_loaded=14.05)
    assert e.metrics.updates == 0  # recorded with the stall
    e.token("c", 14.055)
    assert not e.metrics.stall_ms  # c had no token before the update: it closes nothing
    e.token("b", 14.06)
    assert e.metrics.updates == 1 and list(e.metrics.stall_ms) == [pytest.approx((14.06 - last) * 1e3)]
    assert e.metrics.stall_ms[0] == pytest.approx(1010.0)  # apply + one 10 ms step
    assert e.metrics.apply_ms[0] == pytest.approx(1000.0)
    e.token("b", 14.07)
    assert len(e.metrics.stall_ms) == 1  # closed once
    # busy: 0.1 (a) + 0.05 (b before) + 0.01 (loaded -> b's next, c's token between) + 0.01;
    # not the idle gap, nor the pause
    assert e.metrics.busy_s == pytest.approx(0.1 + 0.05 + 0.005 + 0.005 + 0.01)


def test_a_request_submitted_after_the_update_never_closes_an_earlier_stall():
    e = Driver()
    e.submit("a")
    decode(e, "a", 10.0, 5)  # last token at 10.04
    e.update(apply_s=0.5, t_loaded=10.55)
    e.submit("late")
    decode(e, "late", 10.6, 20)  # the next batch streams; a has not yet
    assert not e.metrics.stall_ms and e.metrics.updates == 0
    e.token("a", 10.9)
    assert list(e.metrics.stall_ms) == [pytest.approx(860.0)]  # a's own gap: 10.04 -> 10.9


def test_decoding_requests_that_end_without_a_token_after_the_update_stalled_nothing():
    e = Driver()
    e.submit("a")
    decode(e, "a", 10.0, 5)
    e.update(apply_s=0.5, t_loaded=10.55)
    e.submit("late")
    e.done("a")  # a ended at the update (e.g. cancelled)
    assert e.metrics.updates == 1 and not e.metrics.stall_ms
    decode(e, "late", 10.6, 5)
    assert not e.metrics.stall_ms  # the stall is not left open for the next batch


def test_two_updates_before_one_token_count_both_and_one_stall():
    e = Driver()
    e.submit("a")
    decode(e, "a", 10.0, 5)  # last token at 10.04
    e.update(apply_s=0.5, t_loaded=10.55)
    e.update(apply_s=0.3, t_loaded=10.90)
    e.token("a", 10.91)
    assert e.metrics.updates == 2 and list(e.metrics.apply_ms) == [pytest.approx(500.0), pytest.approx(300.0)]
    assert list(e.metrics.stall_ms) == [pytest.approx(870.0)]  # across both
