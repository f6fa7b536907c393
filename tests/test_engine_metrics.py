"""EngineMetrics: decode steps slowed by an update being prepared beside the decode loop count as
that update's stall (in ms and in decode steps), not as the no-update baseline."""

import pytest

from rollout_worker.engine import EngineMetrics


def test_steps_slowed_by_preparation_are_stall_not_baseline():
    m = EngineMetrics(slots=4)
    for _ in range(9):
        m.step(0.008, 4, gap_s=0.010)  # baseline: 10 ms between decode steps
    m.step(0.028, 4, gap_s=0.030, preparing=True)  # two steps slowed by the preparation thread
    m.step(0.028, 4, gap_s=0.030, preparing=True)
    m.update(apply_s=0.050, stall_s=0.012, boundary_s=0.001)  # the swap itself: a 12 ms gap
    snap = m.snapshot()
    assert snap["step_gap_ms_p99"] == pytest.approx(10.0)  # the slowed gaps stay out of the baseline
    # 12 ms at the boundary + (30 - 10) x 2 ms lost by the slowed steps
    assert snap["update_stall_total_ms_p50"] == pytest.approx(52.0)
    assert snap["update_stall_steps_p50"] == pytest.approx(5.2)
    assert snap["update_stall_ms_p50"] == pytest.approx(12.0)  # the boundary gap alone, as before


def test_a_refused_preparation_charges_no_later_update():
    m = EngineMetrics(slots=1)
    for _ in range(5):
        m.step(0.008, 1, gap_s=0.010)
    m.step(0.05, 1, gap_s=0.050, preparing=True)
    m.prep_refused()
    m.update(apply_s=0.01, stall_s=0.010)
    assert m.snapshot()["update_stall_steps_p50"] == pytest.approx(1.0)
