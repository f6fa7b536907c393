"""Bad SWE-bench-format input to `asyncrl tasks import` and to a run config's `[trainer.tasks.swe]`:
each bad instance is skipped with one line naming it and its field while the rest import; an
import with nothing to import, failing or killed mid-way leaves no half-written task set (and an
earlier set in place); a task set with an empty split, or a limit out of range or of the wrong
type, is refused before anything starts, naming the split or the key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import config_check
from asyncrl.tasks import main as tasks_main
from envs.task_set import load_task_set
from kernel.config import ConfigError
from tests.helpers.swe_sets import exported_instances

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA_TESTS = (
    "import pytest\n\n\nclass TestExtra:\n    def test_one(self):\n        assert True\n\n\n"
    "@pytest.mark.parametrize('x', [1, 2])\ndef test_param(x):\n    assert x\n"
)


@pytest.fixture(scope="module")
def insts(tmp_path_factory):
    """Three good instances, repo_path made absolute (so a file anywhere may hold them)."""
    root = str(tmp_path_factory.mktemp("swe-src"))
    jsonl, got = exported_instances(root, ("train", "train", "eval"))
    base = os.path.dirname(jsonl)
    return [{**i, "repo_path": os.path.join(base, i["repo_path"])} for i in got]


def write(path, lines: list) -> str:
    """A JSONL file of `lines` (objects as JSON, strings as they are)."""
    with open(path, "w") as f:
        f.write("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def run_import(capsys, src: str, out, *more: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = tasks_main(["import", src, "--out", str(out), *more])
    return rc, capsys.readouterr().err


def stages(out) -> list[str]:
    parent, name = os.path.split(str(out))
    return [x for x in os.listdir(parent) if x.startswith(f".{name}.writing-")]


def repo_text(rel: str, inst: dict) -> str:
    with open(os.path.join(inst["repo_path"], rel)) as f:
        return f.read()


def check_skipped(capsys, tmp_path, insts, bad: dict, line: str, field: str, where: str = "line 2"):
    """Import [good, bad, good]: exit 0, the two good ones in the set, the bad one's line on stderr
    exactly `line` and in the manifest with its field, no snapshot or stage of it left."""
    good = [insts[0], insts[2]]
    out = tmp_path / "set"
    rc, err = run_import(capsys, write(tmp_path / "in.jsonl", [good[0], bad, good[1]]), out)
    assert rc == 0, err
    shown = line if line.startswith(f"{where}:") else f"{where}: {line}"
    assert f"skipped {shown}" in err.splitlines(), err
    assert "imported 2 of 3 instances" in err, err
    assert {t.task_id for t in load_task_set(str(out))} == {i["instance_id"] for i in good}
    man = json.loads((out / "manifest.json").read_text())["report"]
    assert [(s["where"], s["field"], s["reason"]) for s in man["skipped"]] == [(where, field, line)]
    assert man["skipped"][0]["instance"] == line.split(":")[0]  # the id, else the line
    assert sorted(os.listdir(out / "repos")) == sorted(i["instance_id"] for i in good)
    assert stages(out) == []


# -- 1. base_commit -------------------------------------------------------------------------------
def test_base_commit_not_in_the_repository(capsys, tmp_path, insts):
    bad = {**insts[1], "base_commit": "0" * 40}
    iid = bad["instance_id"]
    check_skipped(
        capsys,
        tmp_path,
        insts,
        bad,
        f"{iid}: base_commit '{'0' * 40}' is not a commit of the repository {bad['repo_path']}",
        "base_commit",
    )


def test_base_commit_absent_or_not_a_commit_id(capsys, tmp_path, insts):
    bad = {k: v for k, v in insts[1].items() if k != "base_commit"}
    iid = bad["instance_id"]
    check_skipped(capsys, tmp_path, insts, bad, f"{iid}: missing required field base_commit", "base_commit")
    # an option in its place never reaches git (git archive --output= would write that file)
    target = tmp_path / "written-by-git"
    bad = {**insts[1], "base_commit": f"--output={target}"}
    (tmp_path / "set").rename(tmp_path / "first")
    check_skipped(
        capsys,
        tmp_path,
        insts,
        bad,
        f"{iid}: base_commit must be a commit id, got '--output={target}'",
        "base_commit",
    )
    assert not target.exists()


# -- 2. test_patch that does not apply -------------------------------------------------------------
def _first_line_patch(rel: str, text: str, old: str, new: str) -> str:
    """A test_patch turning the first line of `rel` (holding `text`) from `old` into `new`."""
    context = "".join(f" {x}\n" for x in text.splitlines()[1:3])
    return f"diff --git a/{rel} b/{rel}\n--- a/{rel}\n+++ b/{rel}\n@@ -1,3 +1,3 @@\n-{old}\n+{new}\n{context}"


def test_test_patch_that_does_not_apply(capsys, tmp_path, insts):
    inst = insts[1]
    iid, rel = inst["instance_id"], inst["FAIL_TO_PASS"][0].split("::")[0]
    text = repo_text(rel, inst)
    first = text.splitlines()[0]
    # the same hunk against the file's real first line applies (so it is the context that fails)
    ok = {**inst, "test_patch": _first_line_patch(rel, text, first, first + "  # touched")}
    rc, err = run_import(capsys, write(tmp_path / "ok.jsonl", [ok]), tmp_path / "ok")
    assert rc == 0, err
    assert load_task_set(str(tmp_path / "ok"))[0].hidden_tests[rel].startswith(first + "  # touched\n")
    bad = {**inst, "test_patch": _first_line_patch(rel, text, "this line is in no file", "x = 1")}
    check_skipped(
        capsys,
        tmp_path,
        insts,
        bad,
        f"{iid}: test_patch does not apply to the repository at base_commit: error: patch failed: "
        f"{rel}:1; error: {rel}: patch does not apply",
        "test_patch",
    )


# -- 3. gold patch that does not apply -------------------------------------------------------------
def test_gold_patch_that_does_not_apply(capsys, tmp_path, insts):
    inst = insts[1]
    iid, gold = inst["instance_id"], inst["patch"]
    removed = next(x for x in gold.splitlines() if x.startswith("-") and not x.startswith("---"))
    rel = next(x for x in gold.splitlines() if x.startswith("+++ b/"))[len("+++ b/") :]
    bad = {**inst, "patch": gold.replace(removed + "\n", "-    this line is in no file\n", 1)}
    hunk = next(x for x in gold.splitlines() if x.startswith("@@")).split()[1].lstrip("-").split(",")[0]
    check_skipped(
        capsys,
        tmp_path,
        insts,
        bad,
        f"{iid}: patch does not apply to the repository at base_commit: error: patch failed: "
        f"{rel}:{hunk}; error: {rel}: patch does not apply",
        "patch",
    )


# -- 4. test ids the test files do not contain ----------------------------------------------------
def _new_file_patch(rel: str, text: str) -> str:
    body = "".join(f"+{x}\n" for x in text.splitlines())
    n = len(text.splitlines())
    head = f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n--- /dev/null\n+++ b/{rel}\n"
    return f"{head}@@ -0,0 +1,{n} @@\n{body}"


@pytest.mark.parametrize(
    "field, test_id, why",
    [
        ("FAIL_TO_PASS", "{f2p_file}::test_nope", "{f2p_file} defines no 'test_nope'"),
        ("PASS_TO_PASS", "{f2p_file}::test_nope[1-2]", "{f2p_file} defines no 'test_nope'"),
        (
            "FAIL_TO_PASS",
            "tests/test_absent.py::test_x",
            "tests/test_absent.py is not in the repository nor in the test_patch",
        ),
        ("FAIL_TO_PASS", "tests/test_extra.py::TestExtra::test_two", "class TestExtra defines no 'test_two'"),
        (
            "PASS_TO_PASS",
            "tests/test_extra.py::TestNope::test_one",
            "tests/test_extra.py defines no 'TestNope'",
        ),
    ],
)
def test_unknown_test_ids(capsys, tmp_path, insts, field, test_id, why):
    inst = insts[1]
    iid, f2p_file = inst["instance_id"], inst["FAIL_TO_PASS"][0].split("::")[0]
    test_id, why = test_id.format(f2p_file=f2p_file), why.format(f2p_file=f2p_file)
    extra = {**inst, "test_patch": _new_file_patch("tests/test_extra.py", EXTRA_TESTS)}
    # ids the test_patch's new file defines (a method, a parametrised test) are known
    known = ["tests/test_extra.py::TestExtra::test_one", "tests/test_extra.py::test_param[1]"]
    ok = {**extra, "PASS_TO_PASS": extra["PASS_TO_PASS"] + known}
    rc, err = run_import(capsys, write(tmp_path / "ok.jsonl", [ok]), tmp_path / "ok")
    assert rc == 0, err
    bad = {**extra, field: extra[field] + [test_id]}
    check_skipped(
        capsys,
        tmp_path,
        insts,
        bad,
        f"{iid}: {field} names tests the test files do not contain: {test_id} ({why})",
        field,
    )


# -- 5. required fields, types --------------------------------------------------------------------
DROP = object()  # the field left out


@pytest.mark.parametrize(
    "change, line, field",
    [
        ({"instance_id": DROP}, "line 2: instance_id missing (a required field)", "instance_id"),
        ({"repo": DROP}, "{iid}: missing required field repo", "repo"),
        ({"FAIL_TO_PASS": DROP}, "{iid}: missing required field FAIL_TO_PASS", "FAIL_TO_PASS"),
        (
            {"test_patch": DROP, "PASS_TO_PASS": DROP},
            "{iid}: missing required fields test_patch, PASS_TO_PASS",
            "test_patch",
        ),
        (
            {"instance_id": 7},
            "line 2: instance_id 7: a string of letters, digits, '_', '-', '.' only",
            "instance_id",
        ),
        (
            {"instance_id": "../x"},
            "line 2: instance_id '../x': a string of letters, digits, '_', '-', '.' only",
            "instance_id",
        ),
        (
            {"FAIL_TO_PASS": 3},
            "{iid}: FAIL_TO_PASS must be a list of test ids (or a JSON string of one), got int",
            "FAIL_TO_PASS",
        ),
        (
            {"FAIL_TO_PASS": '"tests/x.py::t"'},
            "{iid}: FAIL_TO_PASS must be a list of test ids (or a JSON string of one), got str",
            "FAIL_TO_PASS",
        ),
        (
            {"PASS_TO_PASS": "[not json"},
            "{iid}: PASS_TO_PASS is a string that is not a JSON list of test ids",
            "PASS_TO_PASS",
        ),
        (
            {"FAIL_TO_PASS": ["tests/x.py::a", 4]},
            "{iid}: FAIL_TO_PASS must be a list of test ids (or a JSON string of one), got a list holding 4",
            "FAIL_TO_PASS",
        ),
        (
            {"FAIL_TO_PASS": "[]"},
            "{iid}: FAIL_TO_PASS is empty: no test tells a fix from the starting code",
            "FAIL_TO_PASS",
        ),
        (
            {"FAIL_TO_PASS": ["test_one (tests.Foo)"]},
            "{iid}: FAIL_TO_PASS ids must be pytest node ids 'path::name' (the runners here report those), "
            "got ['test_one (tests.Foo)']",
            "FAIL_TO_PASS",
        ),
        ({"test_patch": 3}, "{iid}: test_patch must be a string, got int '3'", "test_patch"),
        (
            {"problem_statement": None},
            "{iid}: problem_statement must be a string, got null",
            "problem_statement",
        ),
        (
            {"problem_statement": " \n"},
            "{iid}: problem_statement is empty: it is the task's instruction",
            "problem_statement",
        ),
        ({"repo": "../.."}, "{iid}: repo must be 'owner/name', got '../..'", "repo"),
        ({"split": "test"}, "{iid}: split must be one of ('train', 'eval'), got 'test'", "split"),
    ],
)
def test_missing_or_wrongly_typed_field(capsys, tmp_path, insts, change, line, field):
    inst = insts[1]
    bad = {k: v for k, v in inst.items() if change.get(k) is not DROP}
    bad.update({k: v for k, v in change.items() if v is not DROP})
    check_skipped(capsys, tmp_path, insts, bad, line.format(iid=inst["instance_id"]), field)


def test_lines_that_are_no_instance_and_repeated_ids(capsys, tmp_path, insts):
    src = write(tmp_path / "in.jsonl", [insts[0], "{not json", "[1, 2]", insts[0], insts[2]])
    rc, err = run_import(capsys, src, tmp_path / "set")
    assert rc == 0, err
    lines = [x for x in err.splitlines() if x.startswith("skipped ")]
    assert lines[0].startswith("skipped line 2: not JSON: ")
    assert lines[1:] == [
        "skipped line 3: expected an object, got list",
        f"skipped line 4: {insts[0]['instance_id']}: instance_id repeats that of line 1 "
        "(the first of an id is the one read)",
    ]
    assert len(load_task_set(str(tmp_path / "set"))) == 2


# -- 6. a split without tasks ---------------------------------------------------------------------
@pytest.mark.parametrize("empty, full", [("train", "eval"), ("eval", "train")])
def test_config_check_refuses_a_set_with_an_empty_split(capsys, tmp_path, insts, empty, full):
    src = write(tmp_path / "in.jsonl", [{**i, "split": full} for i in insts])
    rc, err = run_import(capsys, src, tmp_path / "set")
    assert rc == 0 and f"note: the {empty} split has no tasks" in err, err
    conf = tmp_path / "run.toml"
    conf.write_text(
        f'[trainer.tasks]\nenvs = ["swe"]\n\n[trainer.tasks.swe]\ntask_set = "{tmp_path / "set"}"\n'
    )
    capsys.readouterr()
    assert config_check.main(["check", str(conf)]) == 2
    counts = "0 train, 3 eval" if empty == "train" else "3 train, 0 eval"
    assert (
        f"[trainer.tasks.swe] task_set = '{tmp_path / 'set'}': the {empty} split has no tasks ({counts})"
        in capsys.readouterr().err
    )


# -- 7. limits: negative, zero where not yet covered, wrong types ---------------------------------
LIMIT_KEYS = (
    "max_turns",
    "turn_tokens",
    "context_tokens",
    "format_errors",
    "episode_wall_s",
    "command_wall_s",
    "command_cpu_s",
    "command_output_bytes",
    "score_wall_s",
)
INTS = {
    "max_turns",
    "turn_tokens",
    "context_tokens",
    "format_errors",
    "command_cpu_s",
    "command_output_bytes",
}


@pytest.fixture(scope="module")
def swe_set(tmp_path_factory, insts):
    out = tmp_path_factory.mktemp("swe-set") / "set"
    src = write(out.parent / "in.jsonl", insts)
    assert tasks_main(["import", src, "--out", str(out)]) == 0
    return str(out)


def _refused(swe_set: str, limits: dict) -> str:
    conf = {"trainer": {"tasks": {"envs": ["swe"], "swe": {"task_set": swe_set, "limits": limits}}}}
    with pytest.raises(ConfigError) as e:
        config_check.resolve(conf, environ={})
    return str(e.value)


@pytest.mark.parametrize("key", LIMIT_KEYS)
def test_negative_and_zero_limits_refused_naming_the_key(swe_set, key):
    for value in (-1, 0):
        msg = _refused(swe_set, {key: value})
        assert f"[trainer.tasks.swe.limits] {key}" in msg, msg
        assert f"(got {value!r})" in msg or f"{key}={value!r}" in msg, msg


@pytest.mark.parametrize("key", LIMIT_KEYS)
@pytest.mark.parametrize("value", ["ten", True, [1], {"a": 1}])
def test_wrongly_typed_limits_refused_naming_the_key(swe_set, key, value):
    msg = _refused(swe_set, {key: value})
    assert (
        f"[trainer.tasks.swe.limits] {key}: Input should be a valid" in msg and f"(got {value!r})" in msg
    ), msg


@pytest.mark.parametrize("key", sorted(INTS))
def test_fractional_count_limits_refused_naming_the_key(swe_set, key):
    msg = _refused(swe_set, {key: 2.5})
    assert (
        f"[trainer.tasks.swe.limits] {key}: Input should be a valid integer" in msg and "(got 2.5)" in msg
    ), msg


# -- 8. nothing half-written ----------------------------------------------------------------------
def test_nothing_imported_writes_nothing_and_a_second_import_works(capsys, tmp_path, insts):
    out = tmp_path / "set"
    bad = [{**i, "base_commit": "0" * 40} for i in insts]
    rc, err = run_import(capsys, write(tmp_path / "bad.jsonl", bad), out)
    assert rc == 1 and f"imported none of 3 instances: nothing written to {out}" in err, err
    assert not out.exists() and stages(out) == []
    rc, err = run_import(capsys, write(tmp_path / "empty.jsonl", []), out)
    assert rc == 1 and not out.exists()
    rc, err = run_import(capsys, str(tmp_path / "no-such.jsonl"), out)
    assert rc == 2 and "no-such.jsonl" in err and not out.exists()
    rc, err = run_import(capsys, write(tmp_path / "good.jsonl", insts), out)
    assert rc == 0 and len(load_task_set(str(out))) == 3
    # a failed import over a set leaves that set as it was
    before = (out / "tasks.jsonl").read_text()
    rc, err = run_import(capsys, write(tmp_path / "bad.jsonl", bad), out)
    assert rc == 1 and (out / "tasks.jsonl").read_text() == before and stages(out) == []
    # a directory of other files is not a set to replace
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    rc, err = run_import(capsys, write(tmp_path / "good.jsonl", insts), tmp_path / "mine")
    assert rc == 2 and "holds files but no task set" in err
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def _import_through_a_pipe(tmp_path, first: dict, out) -> subprocess.Popen:
    """An import reading its instances from a named pipe: `first` is sent, the process is then
    mid-way (its snapshot written, waiting for the next line) when this returns."""
    fifo = tmp_path / "instances.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.tasks", "import", str(fifo), "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stderr=subprocess.PIPE,
        # SIGINT as a terminal delivers it: a shell's background job (`make test &`) inherits it
        # ignored, and Python then never turns it into KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while True:  # the pipe opens for writing once the import has it open for reading
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.02)
    os.set_blocking(fd, True)
    pipe = os.fdopen(fd, "w")
    pipe.write(json.dumps(first) + "\n")
    pipe.flush()
    proc.pipe = pipe
    while not any((out.parent / s / "repos" / first["instance_id"]).is_dir() for s in stages(out)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_import_killed_mid_way_leaves_the_earlier_set(capsys, tmp_path, insts, sig):
    out = tmp_path / "set"
    rc, err = run_import(capsys, write(tmp_path / "old.jsonl", insts[:2]), out)
    assert rc == 0
    before = {p: (out / p).read_text() for p in ("tasks.jsonl", "manifest.json")}
    proc = _import_through_a_pipe(tmp_path, {**insts[2], "split": "train"}, out)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) != 0
    proc.pipe.close()
    assert {p: (out / p).read_text() for p in before} == before
    assert sorted(t.task_id for t in load_task_set(str(out))) == sorted(i["instance_id"] for i in insts[:2])
    assert len(stages(out)) == (1 if sig == signal.SIGKILL else 0)  # SIGINT: cleaned up on the way out
    # the next import into the same --out works (and clears a killed one's stage)
    rc, err = run_import(capsys, write(tmp_path / "new.jsonl", insts), out)
    assert rc == 0, err
    assert len(load_task_set(str(out))) == 3 and stages(out) == []


def test_an_import_killed_mid_way_into_a_new_directory_leaves_none(capsys, tmp_path, insts):
    out = tmp_path / "fresh"
    proc = _import_through_a_pipe(tmp_path, insts[0], out)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    proc.pipe.close()
    assert not out.exists() and stages(out) == []
    rc, err = run_import(capsys, write(tmp_path / "new.jsonl", insts), out)
    assert rc == 0 and len(load_task_set(str(out))) == 3, err
