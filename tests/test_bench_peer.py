"""bench.peer's reader on a recorded pair of runs (tests/data/peer_runs.json: held-out success of
TRL's and asyncrl's policies against training wall clock): TRL's best as the target, each side's
interpolated reach time, the ratio, a side that never reaches, the versions picked at the clock
marks, and the plot. TRL itself is not needed."""

import copy
import json
from pathlib import Path

import pytest

from bench.peer import main
from bench.peer_report import compare, curves, pick_versions, reach_point_s, reach_s

FIXTURE = Path(__file__).parent / "data" / "peer_runs.json"


@pytest.fixture
def recorded():
    return json.loads(FIXTURE.read_text())


def test_target_reach_times_and_ratio(recorded):
    r = compare(recorded["policies"])
    assert r["target"] == 0.449  # TRL's best, at 838 s (its last point, 0.441, is lower)
    assert r["trl"]["reach_s"] == 838.0 and r["trl"]["best_wall_s"] == 838.0
    # asyncrl: 0.430 at 420.1 s, 0.473 at 481.7 s: crosses 0.449 at 420.1 + 19/43 of 61.6 s
    want = 420.1 + (0.449 - 0.430) / (0.473 - 0.430) * (481.7 - 420.1)
    assert r["asyncrl"]["reach_s"] == pytest.approx(want)
    assert r["asyncrl"]["reach_point_s"] == 481.7
    assert r["ratio"] == pytest.approx(want / 838.0)
    assert r["speedup"] == pytest.approx(838.0 / want)
    assert r["asyncrl"]["best"] == 0.621 and r["asyncrl"]["start"] == r["trl"]["start"] == 0.191


def test_a_side_that_never_reaches(recorded):
    rows = copy.deepcopy(recorded["policies"])
    for p in rows:
        if p["side"] == "asyncrl":
            p["success"] = min(p["success"], 0.43)
    r = compare(rows)
    assert r["asyncrl"]["reach_s"] is None and r["asyncrl"]["reach_point_s"] is None
    assert r["ratio"] is None and r["speedup"] is None
    assert r["ratio_at_least"] == pytest.approx(896.4 / 838.0)
    assert "did not reach" in r["note"]


def test_trl_that_never_improves_gives_no_ratio(recorded):
    rows = [dict(p, success=0.1 if p["wall_s"] else 0.191) for p in recorded["policies"]]
    r = compare(rows)
    assert r["target"] == 0.191 and r["trl"]["reach_s"] == 0.0
    assert r["ratio"] is None and "never rose" in r["note"]


def test_reach_rules():
    c = [(0.0, 0.2), (60.0, 0.3), (120.0, 0.5)]
    assert reach_s(c, 0.2) == 0.0 and reach_s(c, 0.4) == pytest.approx(90.0) and reach_s(c, 0.6) is None
    assert reach_point_s(c, 0.4) == 120.0
    assert curves(
        [{"side": "trl", "wall_s": 5, "success": 0.3}, {"side": "trl", "wall_s": 0, "success": 0.2}]
    )["trl"] == [(0.0, 0.2), (5.0, 0.3)]
    with pytest.raises(ValueError, match="no evaluated asyncrl"):
        compare([{"side": "trl", "wall_s": 0, "success": 0.2}])


def test_versions_picked_at_the_clock_marks():
    # one version every ~25 s; a dropped batch repeats version 3 later (its first row counts)
    rows = [{"version": v, "lead_wall_s": 25.0 * v + 1} for v in range(1, 15)]
    rows.insert(3, {"version": 3, "lead_wall_s": 90.0})
    rows.append({"version": 15, "samples": 16})  # no clock: not a candidate
    picked = pick_versions(rows, every_s=60.0, budget_s=300.0)
    # marks 60, 120, 180, 240; then the last version within 300 s (v11 at 276 s)
    assert [(p["version"], p["wall_s"]) for p in picked] == [
        (3, 76.0),
        (5, 126.0),
        (8, 201.0),
        (10, 251.0),
        (11, 276.0),
    ]
    assert pick_versions([], 60.0, 300.0) == []


def test_reader_main_writes_the_plot_and_prints_one_json(recorded, tmp_path, capsys):
    png = tmp_path / "peer.png"
    assert main(["--from-json", str(FIXTURE), "--plot", str(png), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ratio"] == pytest.approx(compare(recorded["policies"])["ratio"])
    assert last["eval"]["distinct_problems"] >= 100 and last["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_reader_on_a_measured_pair(tmp_path, capsys):
    """A measured pair (bench.peer --minutes 8 --every-s 90 on this project's 2-core box): the reader
    gives back what the bench printed when it ran, from the recorded file alone."""
    measured = Path(__file__).parent / "data" / "peer_measured_1.json"
    recorded = json.loads(measured.read_text())
    assert recorded["eval"] == {"n": 256, "seed": 0, "distinct_problems": 168}
    assert recorded["runs"]["trl"]["steps"] == 35 and recorded["runs"]["asyncrl"]["versions"] == 53
    assert main(["--from-json", str(measured), "--plot", str(tmp_path / "p.png"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["target"] == pytest.approx(0.5586, abs=1e-4)
    assert r["trl"]["reach_s"] == pytest.approx(364.1, abs=0.1)
    assert r["asyncrl"]["best"] == pytest.approx(0.5078, abs=1e-4) and r["asyncrl"]["reach_s"] is None
    assert r["ratio"] is None and r["ratio_at_least"] == pytest.approx(473.6 / 364.1, abs=1e-3)
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_recorded_trl_side_of_another_budget_is_refused(tmp_path, capsys):
    (tmp_path / "curve.json").write_text(json.dumps({"minutes": 8.0, "every_s": 90.0, "policies": []}))
    with pytest.raises(SystemExit) as e:
        main(["--trl-from", str(tmp_path), "--minutes", "5", "--every-s", "90", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ran --minutes 8.0 --every-s 90.0 --env arith-chat-12 --max-tokens 24, not 5.0, 90.0" in err
    assert not (tmp_path / "o").exists()  # refused before anything runs
    # another task or completion length is another budget too
    rec = {"minutes": 8.0, "every_s": 90.0, "env": "arith-chat-12", "settings": {"max_new_tokens": 24}}
    (tmp_path / "curve.json").write_text(json.dumps({**rec, "policies": []}))
    with pytest.raises(SystemExit):
        main(["--trl-from", str(tmp_path), "--minutes", "8", "--every-s", "90", "--env", "python-funcs"])
    assert "--env arith-chat-12" in capsys.readouterr().err
