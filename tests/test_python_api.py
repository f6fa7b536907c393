"""Runs from Python (asyncrl/run_handle.py): `asyncrl.up(config)` starts the same `asyncrl up` a
shell would and returns a Run whose metrics, evals and summary are the run's own files;
`asyncrl.load_run(dir)` opens it again (also through runs/latest), and a bad directory is a clear
error."""

from __future__ import annotations

import asyncio
import tomllib

import pytest

import asyncrl
from bus import BusConfig, connect
from bus import topology as topo
from tests.helpers.up import SUPERVISE


def test_up_from_python_then_load_run(tmp_path, fresh_server):
    cfg = tmp_path / "run.toml"
    cfg.write_text(SUPERVISE.replace("[up]\n", "[up]\nweights_keep = 12\n"))
    run = asyncrl.up(
        cfg, steps=4, minutes=3, run_dir=tmp_path / "runs" / "a", extra_args=["--nats", fresh_server.url]
    )
    assert not run.running and run.summary["versions"] >= 4
    assert run.version == run.summary["versions"]
    assert [r["version"] for r in run.metrics() if "samples" in r][:4] == [1, 2, 3, 4]
    assert {"up", "trainer", "worker", "scorer"} <= set(run.config)  # the sections as given
    assert any(p.name == "run.png" for p in run.plots())
    # [up] weights_keep: the WEIGHTS stream's retention, the same in every child (each provisions too)
    children = tomllib.loads((run.dir / "config" / "trainer.toml").read_text())
    assert children["bus"]["topology"] == {"weights_keep": 12}
    assert asyncio.run(weights_retention(fresh_server.url)) == 12

    again = asyncrl.load_run(tmp_path / "runs" / "latest")
    assert again.dir == run.dir and again.summary == run.summary and not again.running
    with pytest.raises(FileNotFoundError, match="not an asyncrl run directory"):
        asyncrl.load_run(tmp_path)


async def weights_retention(url: str) -> int:
    bus = await connect(BusConfig(servers=[url], name="t"))
    try:
        return (await bus.js.stream_info(topo.WEIGHTS)).config.max_msgs_per_subject
    finally:
        await bus.close()


def test_a_run_started_without_waiting_can_be_stopped(tmp_path, fresh_server):
    cfg = tmp_path / "run.toml"
    cfg.write_text(SUPERVISE)
    run = asyncrl.up(
        cfg, steps=500, minutes=3, run_dir=tmp_path / "b", wait=False, extra_args=["--nats", fresh_server.url]
    )
    assert run.running and (run.dir / "config" / "run.json").exists()
    summary = run.stop()
    assert not run.running and summary is not None and summary["stopped"]


def test_a_bad_config_raises_with_where_to_look(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[up]\nno_such_key = 1\n")
    with pytest.raises(RuntimeError, match="exited 2"):
        asyncrl.up(cfg, steps=1, run_dir=tmp_path / "c")
    assert "bad configuration" in (tmp_path / "c" / "logs" / "up.out").read_text()


def test_asyncrl_up_is_callable_after_the_cli_modules_are_imported(tmp_path):
    import asyncrl.cli  # noqa: F401
    import asyncrl.launch  # noqa: F401  (`asyncrl up`'s module: a different name, nothing shadows)

    cfg = tmp_path / "bad.toml"
    cfg.write_text("[up]\nno_such_key = 1\n")
    with pytest.raises(RuntimeError, match="exited 2"):
        asyncrl.up(cfg, steps=1, run_dir=tmp_path / "d")
