"""bench.bus's codec figures: the Rollout it times is a valid one that round-trips, and the figures
are per-event microseconds of that round trip (structure only: no timing is asserted)."""

import argparse

from bench import bus as bench_bus
from bus import events


def test_the_timed_rollout_round_trips():
    for n in (20, 1024):
        ev = bench_bus.rollout(n)
        assert events.decode(events.encode(ev)) == ev
        assert len(ev.completion_ids) == len(ev.logprobs) == len(ev.token_versions) == n


def test_codec_only_reports_the_four_figures():
    res = bench_bus.codec_only(argparse.Namespace(repeats=1))
    keys = {"rollout_encode_us", "rollout_decode_us", "rollout_1k_encode_us", "rollout_1k_decode_us"}
    assert keys <= set(res) and all(res[k] > 0 for k in keys)
