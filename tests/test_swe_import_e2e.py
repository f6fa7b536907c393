"""A user's SWE-bench file end to end, offline: two packages' bugs (the real inflection sdist, and a
package that needs inflection at run time) built and exported as SWE-bench instances (one git
repository per package), imported by `asyncrl tasks import --find-links` as any user's JSONL; then
per instance an honest episode (its commands apply the gold patch) and an empty one, played by the
real worker -- its built-in turn loop and mini-swe-agent on its endpoint -- and scored by the real
scorer: honest resolved (reward 1), empty not (0). Predictions of the gold and the empty patch
through `asyncrl tasks evaluate` give the same verdicts; the shipped deploy/swe-import.toml checks
against the imported set."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import types

import pytest

from asyncrl.tasks import main as tasks_main
from bench.tiny_package import TINY_SRC, write_sdist
from bus import BusConfig
from bus import topology as topo
from bus.events import Scored, Task
from envs import repo_env, swebench
from envs.episode import EpisodeTask
from envs.swe_config import SweSection
from envs.swe_env import configure
from envs.task_set import load_task_set
from policy import CharTokenizer
from tests.helpers.scripted_engine import ScriptedEngine
from tests.helpers.weights import until
from tests.helpers.worker import read_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INFLECTION = os.path.join(ROOT, "tests", "data", "sdists", "inflection-0.5.1.tar.gz")
TOK = CharTokenizer.default()
# the task set's place relative to the run's directory, as deploy/swe-import.toml names it
SET = os.path.join("tasks", "swe-import")
SPLIT = {"pypi/inflection": "train", "pypi/tinypkg": "eval"}  # the user's choice of held-out instances


def tasks(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = tasks_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The instance file (written by `tasks build` + `tasks export`, one instance per package, a
    split each), the find-links directory, and the set `tasks import` made of the file."""
    root = str(tmp_path_factory.mktemp("swe-import"))
    links = os.path.join(root, "links")
    os.makedirs(links)
    shutil.copy(INFLECTION, links)
    needs_inflection = {  # a runtime dependency of its own, declared where the builder reads it
        "tinypkg-0.1/setup.cfg": "[options]\ninstall_requires =\n    inflection>=0.5\n",
        "tinypkg-0.1/tinypkg/__init__.py": "import inflection\n" + TINY_SRC,
    }
    tiny = write_sdist(root, extra=needs_inflection)
    built, exp = os.path.join(root, "built"), os.path.join(root, "exp")
    build = ["--sdist", INFLECTION, "--sdist", tiny, "--per-package", "1", "--test-timeout", "60"]
    rc, out, err = tasks("build", "--out", built, *build, "--find-links", links)
    assert rc == 0, out + err
    rc, out, err = tasks("export", built, "--out", exp)
    assert rc == 0 and not err, err
    jsonl = out.strip()
    insts = swebench.read_jsonl(jsonl)
    assert sorted(i["repo"] for i in insts) == sorted(SPLIT), insts
    with open(jsonl, "w") as f:
        f.write("".join(json.dumps({**i, "split": SPLIT[i["repo"]]}) + "\n" for i in insts))
    rc, out, err = tasks("import", jsonl, "--out", os.path.join(root, SET), "--find-links", links)
    assert rc == 0, err
    assert "imported 2 of 2 instances" in err and "(1 train, 1 eval); 0 skipped" in err, err
    assert "environment pypi__tinypkg-0.1: inflection==0.5.1" in err, err
    return types.SimpleNamespace(
        root=root,
        jsonl=jsonl,
        links=links,
        set=os.path.join(root, SET),
        insts={i["instance_id"]: i for i in insts},
    )


def test_the_file_is_swebench_instances_over_one_repository_per_package(made):
    for iid, inst in made.insts.items():
        assert set(swebench.REQUIRED) <= set(inst) and inst["FAIL_TO_PASS"], iid
        name = inst["repo"].split("/")[1]
        assert inst["version"] == {"inflection": "0.5.1", "tinypkg": "0.1"}[name]
        repo = os.path.join(os.path.dirname(made.jsonl), "repos", f"pypi__{name}")
        git = lambda *a, repo=repo: (
            subprocess.run(  # noqa: E731
                ["git", *a], cwd=repo, check=True, capture_output=True, text=True
            ).stdout
        )
        # the bug is a commit on the pristine sdist; the gold patch goes back to it
        assert git("rev-parse", f"{inst['base_commit']}^").strip() == inst["environment_setup_commit"]
        assert git("rev-parse", "main").strip() == inst["environment_setup_commit"]
        assert git("diff", inst["base_commit"], "main") == inst["patch"] and inst["patch"].startswith(
            "diff --git"
        )
        assert inst["test_patch"] == ""  # the package's own tests judge it; they are in the tree
    by_id = {t.task_id: t for t in load_task_set(made.set)}
    assert sorted(by_id) == sorted(made.insts)
    tiny = next(t for t in by_id.values() if "tinypkg" in t.task_id)
    assert tiny.split == "eval" and tiny.env_dir == os.path.join(made.set, "envs", "pypi__tinypkg-0.1")
    assert [d["name"] for d in repo_env.read_manifest(tiny.env_dir)["installed"]] == ["inflection"]


def apply_gold(patch: str) -> str:
    """The honest turn: the gold patch applied in the workspace (base64: the patch's text may hold
    characters the toy tokenizer has no id for)."""
    return f"printf '%s' {base64.b64encode(patch.encode()).decode()} | base64 -d | git apply -"


def as_turn(command: str) -> str:
    return f"I apply the fix.\n```bash\n{command}\n```"


@pytest.mark.parametrize("harness", ["builtin", "mini-swe-agent"])
async def test_honest_resolves_empty_does_not_through_worker_and_scorer(made, harness, bus, fresh_server):
    from rollout_worker.config import WorkerConfig
    from rollout_worker.worker import Worker
    from scorer.config import ScorerConfig
    from scorer.service import Scorer

    limits = {"max_turns": 4, "turn_tokens": 4096, "command_wall_s": 60.0, "score_wall_s": 120.0}
    env = configure(SweSection(task_set=made.set, reward="resolved", limits=limits))
    try:
        specs = env.split_specs("train") + env.split_specs("eval")
    finally:
        configure(None)
    scripts = {}
    for ts in specs:  # the episode's prompt names its package: the honest policy's turns for it
        task = EpisodeTask.from_dict(ts.spec["episode"])
        scripts[task.instruction.splitlines()[0]] = [as_turn(apply_gold(made.insts[task.task_id]["patch"]))]
    submit = as_turn("submit")
    engines = {"honest": ScriptedEngine(TOK, scripts, submit), "empty": ScriptedEngine(TOK, {}, submit)}
    for mode, eng in engines.items():
        cfg = WorkerConfig(
            bus=BusConfig(servers=[fresh_server.url]),
            worker_id=f"w-{mode}",
            harness={"kind": harness},
            episodes={"task_set": made.set},
        )
        w = Worker(cfg, bus, engine=eng)
        try:
            for ts in specs:
                iid = EpisodeTask.from_dict(ts.spec["episode"]).task_id
                task = Task(task_id=f"{mode}--{iid}", env="swe", prompt=ts.prompt, spec=ts.spec,
                            sampling={"max_tokens": 4096, "n": 1, "temperature": 1.0})  # fmt: skip
                await w.handle(task, ctx=None)
        finally:
            if harness != "builtin":  # the harness's endpoint and threads
                await w.episode_runner.close()
        assert w.rollouts == len(specs) and w.parked == 0
    assert len(engines["honest"].replies) == len(engines["empty"].replies) + len(specs)  # one fix each
    stop = asyncio.Event()
    scorer = Scorer(ScorerConfig(bus=BusConfig(servers=[fresh_server.url])), bus)
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        await until(lambda: scorer.counts["scored"] >= 2 * len(specs), timeout=60)
    finally:
        stop.set()
        await run
    scored = {s.task_id: s for s in await read_stream(bus, topo.SCORED, Scored)}
    assert len(scored) == 2 * len(made.insts), sorted(scored)
    for task_id, s in scored.items():
        mode, iid = task_id.split("--")
        r = s.get_rollout()  # the rollout the worker published, as the scorer took it
        assert r.spec["reward"] == "resolved" and r.termination == "submitted", (task_id, r.episode)
        want = 1.0 if mode == "honest" else 0.0
        assert (s.success, s.score, s.infra) == (want, want, ""), (task_id, s.reason, r.episode.get("detail"))
        tests = r.episode["tests"]
        assert set(tests) == set(made.insts[iid]["FAIL_TO_PASS"] + made.insts[iid]["PASS_TO_PASS"])
        assert all(tests.values()) == (mode == "honest"), (task_id, tests)
        if harness != "builtin":
            assert r.episode["harness_exit"]["exit_status"] == "Submitted", r.episode["harness_exit"]


def test_gold_and_empty_predictions_round_trip_through_evaluate(made, tmp_path):
    ids = sorted(made.insts)
    for name, patch_of in (("gold", lambda i: made.insts[i]["patch"]), ("empty", lambda i: "")):
        preds = tmp_path / f"{name}.jsonl"
        rows = [{"instance_id": i, "model_name_or_path": name, "model_patch": patch_of(i)} for i in ids]
        preds.write_text("".join(json.dumps(p) + "\n" for p in rows))
        sources = [["--tasks", made.set]]
        if name == "gold":  # as the SWE-bench harness is given it: the instance file, imported anew
            sources.append(["--instances", made.jsonl, "--find-links", made.links])
        for source in sources:
            rc, out, err = tasks("evaluate", str(preds), *source)
            assert rc == 0, err
            rep = json.loads(out)
            assert rep["error_instances"] == 0 and rep["submitted_instances"] == 2, rep
            if name == "gold":
                assert rep["resolved_ids"] == ids, rep
                for i in ids:
                    st = rep["results"][i]["tests_status"]
                    assert st["FAIL_TO_PASS"]["failure"] == [] and st["PASS_TO_PASS"]["failure"] == [], st
            else:
                assert rep["resolved_instances"] == 0 and rep["empty_patch_ids"] == ids, rep


def test_the_shipped_config_checks_against_the_imported_set(made, monkeypatch):
    """`asyncrl config check deploy/swe-import.toml` run where the set was imported (the config names
    it relative to the run's directory); where there is none, it is refused naming the key."""
    from asyncrl.config_check import main as config_main

    for k in [k for k in os.environ if k.startswith("ASYNCRL_") and k != "ASYNCRL_CACHE"]:
        monkeypatch.delenv(k)
    toml = os.path.join(ROOT, "deploy", "swe-import.toml")
    for cwd, rc in ((made.root, 0), (os.path.dirname(made.set), 2)):
        monkeypatch.chdir(cwd)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert config_main(["check", toml]) == rc, (cwd, err.getvalue())
    assert "[trainer.tasks.swe] task_set = 'tasks/swe-import': no such directory" in err.getvalue(), (
        err.getvalue()
    )
