"""SWE-bench-format data (envs/swebench.py, `asyncrl tasks import|export|evaluate`): a round trip of
generated-repository tasks (export -> import -> evaluate: gold patch all resolved, empty none), the
SWE-bench verdict rules (test patch over the model's edits, a patch that does not apply), and bad
instances skipped with the reason while the rest import (tests/test_swe_import_errors.py: each
kind of bad input on its own)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from asyncrl.tasks import main as tasks_main
from envs import gen_repos, swebench
from envs.task_set import load_task_set, write_task_set


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("swe")
    tasks = gen_repos.build(2, seed=11, n_modules=1)
    assert len(tasks) == 2
    # a task whose tests the workspace does not hold: only the test_patch brings them
    t = tasks[0]
    tasks.append(
        dataclasses.replace(
            t,
            task_id=t.task_id + "-hidden",
            files={p: x for p, x in t.files.items() if p not in t.hidden_tests},
        )
    )
    write_task_set(str(root / "set"), tasks, {})
    assert tasks_main(["export", str(root / "set"), "--out", str(root / "exp")]) == 0
    insts = swebench.read_jsonl(str(root / "exp" / "instances.jsonl"))
    return root, tasks, insts


def _files(d: str) -> dict[str, str]:
    out = {}
    for base, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x != ".git"]
        for f in files:
            p = os.path.join(base, f)
            out[os.path.relpath(p, d)] = open(p).read()
    return out


def _evaluate(capsys, preds, tmp, *src) -> dict:
    path = os.path.join(tmp, f"preds-{len(os.listdir(tmp))}.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(p) + "\n" for p in preds))
    capsys.readouterr()
    assert tasks_main(["evaluate", path, *src]) == 0
    return json.loads(capsys.readouterr().out)


def test_round_trip_gold_resolves_empty_does_not(exported, tmp_path, capsys):
    root, tasks, insts = exported
    assert {i["instance_id"] for i in insts} == {t.task_id for t in tasks}
    for i in insts:
        assert set(swebench.REQUIRED) <= set(i) and i["patch"].startswith("diff --git")
        assert len(i["base_commit"]) == 40 and i["FAIL_TO_PASS"]
        assert bool(i["test_patch"]) == i["instance_id"].endswith("-hidden")
    assert tasks_main(["import", str(root / "exp" / "instances.jsonl"), "--out", str(tmp_path / "imp")]) == 0
    imported = {t.task_id: t for t in load_task_set(str(tmp_path / "imp"))}
    for t in tasks:  # the snapshot is the task's starting workspace; the tests the hidden ones
        it = imported[t.task_id]
        assert _files(it.base_dir) == t.files
        assert {**t.files, **it.hidden_tests} == {**t.files, **t.hidden_tests}
        assert (it.fail_to_pass, it.pass_to_pass, it.runner, it.split) == (
            t.fail_to_pass,
            t.pass_to_pass,
            t.runner,
            t.split,
        )
    gold = [
        {"instance_id": i["instance_id"], "model_patch": i["patch"], "model_name_or_path": "gold"}
        for i in insts
    ]
    rep = _evaluate(capsys, gold, str(tmp_path), "--tasks", str(tmp_path / "imp"))
    assert rep["resolved_instances"] == 3 and rep["error_instances"] == 0, rep
    # straight from the instance file (imported into a temporary set), as the SWE-bench harness takes it
    rep = _evaluate(capsys, gold, str(tmp_path), "--instances", str(root / "exp" / "instances.jsonl"))
    assert rep["resolved_ids"] == sorted(i["instance_id"] for i in insts)
    empty = [{"instance_id": i["instance_id"], "model_patch": ""} for i in insts]
    rep = _evaluate(capsys, empty, str(tmp_path), "--tasks", str(tmp_path / "imp"))
    assert rep["resolved_instances"] == 0 and rep["empty_patch_instances"] == 3


def test_verdict_rules(exported, tmp_path):
    root, tasks, insts = exported
    imported = swebench.import_instances(str(root / "exp" / "instances.jsonl"), str(tmp_path))
    t, inst = imported[0], next(i for i in insts if i["instance_id"] == imported[0].task_id)
    f2p_file = t.fail_to_pass[0].split("::")[0]
    # a patch that empties the failing test file: the hidden tests are restored over it -> unresolved
    cheat = _diff_of(os.path.join(t.base_dir, f2p_file), f2p_file, "")
    r = swebench.evaluate_patch(t, cheat)
    assert r["patch_applied"] and not r["resolved"], r
    assert r["tests_status"]["FAIL_TO_PASS"]["failure"] == t.fail_to_pass
    # a patch that does not apply
    removed = next(x for x in inst["patch"].splitlines() if x.startswith("-") and not x.startswith("---"))
    bad = inst["patch"].replace(removed + "\n", "-    this line is in no file\n", 1)
    r = swebench.evaluate_patch(t, bad)
    assert not r["patch_applied"] and not r["resolved"] and "does not apply" in r["detail"]
    r = swebench.evaluate_patch(t, inst["patch"])
    assert r["resolved"] and r["reward"] == 1.0 and r["tests_status"]["FAIL_TO_PASS"]["failure"] == []


def _diff_of(path: str, rel: str, new: str) -> str:
    old = open(path).read().splitlines(keepends=True)
    body = "".join("-" + x for x in old)
    return f"diff --git a/{rel} b/{rel}\n--- a/{rel}\n+++ b/{rel}\n@@ -1,{len(old)} +0,0 @@\n{body}" + new


def test_bad_instances_skipped_with_the_reason(exported, tmp_path, capsys):
    root, tasks, insts = exported
    good, other = insts[:2]
    cases = {
        "missing": (
            {k: v for k, v in other.items() if k != "test_patch"},
            "missing required field test_patch",
        ),
        "ids": ({**other, "FAIL_TO_PASS": ["test_one (tests.Foo)"]}, "pytest node ids"),
        "json": ({**other, "PASS_TO_PASS": "[not json"}, "not a JSON list"),
        "norepo": ({**other, "repo_path": "", "repo": "nobody/nothing"}, "no local repository"),
        "unsafe": ({**other, "instance_id": "../x"}, "instance_id"),
        "testpatch": (
            {
                **other,
                "test_patch": "diff --git a/tests/x.py b/tests/x.py\n--- a/tests/x.py\n+++ "
                "b/tests/x.py\n@@ -1 +1 @@\n-a\n+b\n",
            },
            "not in the repository",
        ),
    }
    for name, (inst, why) in cases.items():
        src = tmp_path / f"{name}.jsonl"
        where = os.path.join(root / "exp", inst["repo_path"]) if inst.get("repo_path") else ""
        inst = {**inst, "repo_path": where}
        src.write_text(
            json.dumps(good | {"repo_path": os.path.join(root / "exp", good["repo_path"])})
            + "\n"
            + json.dumps(inst)
            + "\n"
        )
        capsys.readouterr()
        assert tasks_main(["import", str(src), "--out", str(tmp_path / name)]) == 0, name
        err = capsys.readouterr().err
        assert why in err and "skipped line 2: " in err, (name, err)
        assert [t.task_id for t in load_task_set(str(tmp_path / name))] == [good["instance_id"]], name
    src = tmp_path / "dup.jsonl"
    here = good | {"repo_path": os.path.join(root / "exp", good["repo_path"])}
    src.write_text(json.dumps(here) + "\n" + json.dumps(here) + "\n")
    assert tasks_main(["import", str(src), "--out", str(tmp_path / "dup")]) == 0
    assert "instance_id repeats that of line 1" in capsys.readouterr().err
    # predictions: unknown ids and non-string patches are listed as errors, the rest still scored
    preds = [
        {"instance_id": "nope", "model_patch": "x"},
        {"instance_id": good["instance_id"], "model_patch": 3},
    ]
    rep = _evaluate(capsys, preds, str(tmp_path), "--instances", str(root / "exp" / "instances.jsonl"))
    assert rep["error_ids"] == sorted(["nope", good["instance_id"]]) and rep["resolved_instances"] == 0
    # a prediction for an instance the import skipped names why
    bad = {**good, "repo_path": os.path.join(root / "exp", good["repo_path"]), "base_commit": "0" * 40}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    rep = _evaluate(
        capsys,
        [{**preds[0], "instance_id": good["instance_id"]}],
        str(tmp_path),
        "--instances",
        str(tmp_path / "bad.jsonl"),
    )
    assert rep["errors"][good["instance_id"]].startswith(
        f"instance not imported: {good['instance_id']}: base_commit '{'0' * 40}' is not a commit"
    ), rep


PKG_SRC = (
    "def snake(name):\n    out = []\n    for i, c in enumerate(name):\n"
    "        if c.isupper() and i:\n            out.append('_')\n        out.append(c.lower())\n"
    "    return ''.join(out)\n"
)
PKG_TESTS = (
    "import pytest\nfrom minipkg import snake\n\n\n"
    "@pytest.mark.parametrize('a,b', [('FooBar', 'foo_bar'), ('x', 'x')])\n"
    "def test_snake(a, b):\n    assert snake(a) == b\n\n\n"
    "def test_empty():\n    assert snake('') == ''\n"
)


def test_package_task_round_trip_on_the_pytest_runner(tmp_path, capsys):
    """A real-package task (tier 3, built from a local sdist as `asyncrl tasks build --sdist` does):
    pytest node ids with parameters, a repository snapshot under the task set."""
    import io
    import tarfile

    from asyncrl.tasks import build_package

    sdist = tmp_path / "minipkg-0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for rel, text in {
            "minipkg-0.1/minipkg/__init__.py": PKG_SRC,
            "minipkg-0.1/tests/test_minipkg.py": PKG_TESTS,
        }.items():
            info = tarfile.TarInfo(rel)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    tasks = build_package(str(sdist), str(tmp_path / "set"), per_package=1, seed=1, test_timeout_s=60)
    assert len(tasks) == 1 and tasks[0].runner == "pytest" and tasks[0].base_dir
    write_task_set(str(tmp_path / "set"), tasks, {})
    assert tasks_main(["export", str(tmp_path / "set"), "--out", str(tmp_path / "exp")]) == 0
    inst = swebench.read_jsonl(str(tmp_path / "exp" / "instances.jsonl"))[0]
    assert any("[" in t for t in inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"])  # parametrized ids
    gold = [{"instance_id": inst["instance_id"], "model_patch": inst["patch"]}]
    rep = _evaluate(capsys, gold, str(tmp_path), "--instances", str(tmp_path / "exp" / "instances.jsonl"))
    assert rep["resolved_ids"] == [inst["instance_id"]], rep["results"]
    rep = _evaluate(
        capsys,
        [{**gold[0], "model_patch": ""}],
        str(tmp_path),
        "--instances",
        str(tmp_path / "exp" / "instances.jsonl"),
    )
    assert rep["resolved_instances"] == 0 and rep["empty_patch_instances"] == 1
