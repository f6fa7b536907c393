"""`asyncrl tasks predict`: the agent's change in a played workspace as a SWE-bench `model_patch`
(envs/swebench.py workspace_patch), round-tripped through `asyncrl tasks evaluate` (the honest
episode's patch resolves, the empty and the test-tampering ones do not), and the command itself
on an HF folder, its predictions agreeing with evaluate's verdicts; bad inputs refused."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.tasks import main as tasks_main
from envs import swebench
from envs.episode import EpisodeTask
from envs.swe_config import SweSection
from envs.swe_env import SweEnv
from tests.helpers.swe_sets import fix_commands, imported_set, play


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return imported_set(str(tmp_path_factory.mktemp("swe")))


def evaluate(capsys, preds: list[dict], path: str, task_set: str) -> dict:
    with open(path, "w") as f:
        f.write("".join(json.dumps(p) + "\n" for p in preds))
    capsys.readouterr()
    assert tasks_main(["evaluate", path, "--tasks", task_set]) == 0
    return json.loads(capsys.readouterr().out)


async def test_workspace_patch_round_trips_through_evaluate(imported, tmp_path, capsys):
    path, insts = imported
    env = SweEnv("swe", path, SweSection(task_set=path).episode_limits())
    preds = {"honest": [], "empty": [], "tamper": []}
    for ts in env.split_specs("train") + env.split_specs("eval"):
        task = EpisodeTask.from_dict(ts.spec["episode"])
        f2p = task.fail_to_pass[0].split("::")[0]
        plays = {
            "honest": fix_commands(task, insts[task.task_id]),
            "empty": ["run_tests", "submit"],  # caches written, nothing changed
            "tamper": [f"printf 'def test_ok():\\n    pass\\n' > {f2p}", "run_tests", "submit"],
        }
        for kind, commands in plays.items():
            got = {}
            _, r = await play(
                ts.spec,
                commands,
                keep=lambda ep, got=got: got.update(p=swebench.workspace_patch(ep.task, ep.workspace.repo)),
            )
            assert r.resolved == (kind == "honest"), (kind, r.detail)
            preds[kind].append(
                {"instance_id": task.task_id, "model_name_or_path": kind, "model_patch": got["p"]}
            )
            assert (got["p"] == "") == (kind == "empty"), (kind, got["p"][:300])
            if kind == "tamper":
                assert f"b/{f2p}" in got["p"] and "__pycache__" not in got["p"]
    n = len(insts)
    rep = evaluate(capsys, preds["honest"], str(tmp_path / "honest.jsonl"), path)
    assert rep["resolved_instances"] == n and rep["error_instances"] == 0, rep
    rep = evaluate(capsys, preds["empty"], str(tmp_path / "empty.jsonl"), path)
    assert rep["resolved_instances"] == 0 and rep["empty_patch_instances"] == n, rep
    rep = evaluate(capsys, preds["tamper"], str(tmp_path / "tamper.jsonl"), path)
    assert rep["resolved_instances"] == 0, rep


def test_predict_command_on_an_hf_folder_agrees_with_evaluate(imported, tmp_path, capsys):
    from policy import Transformer, save_hf_checkpoint
    from tests.helpers.agentic import CFG, no_special_state

    path, insts = imported
    model = Transformer(CFG)
    model.load_inference_state(no_special_state(3))
    save_hf_checkpoint(model, tmp_path / "hf")
    conf = tmp_path / "run.toml"
    conf.write_text(
        '[trainer.tasks]\nenvs = ["swe"]\nsampling = {temperature = 1.0, max_tokens = 48}\n'
        '[trainer.tasks.swe]\nprompt = "toy"\n[trainer.tasks.swe.limits]\nmax_turns = 2\nturn_tokens = 48\n'
    )
    out = tmp_path / "preds" / "predictions.jsonl"
    capsys.readouterr()
    argv = ["predict", path, "--model", str(tmp_path / "hf"), "--out", str(out), "--config", str(conf)]
    assert tasks_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    preds = [json.loads(x) for x in out.read_text().splitlines()]
    evals = sorted(i for i, x in insts.items() if x["split"] == "eval")
    assert sorted(p["instance_id"] for p in preds) == evals and summary["instances"] == len(evals)
    for p in preds:
        assert set(p) == {"instance_id", "model_name_or_path", "model_patch"}
        assert p["model_name_or_path"] == str(tmp_path / "hf") and isinstance(p["model_patch"], str)
    assert summary["eval_turns"] <= 2  # the config's limits
    assert tasks_main(["evaluate", str(out), "--tasks", path]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["resolved_ids"] == summary["resolved_ids"]  # the episodes' verdicts are evaluate's
    assert rep["empty_patch_instances"] == summary["empty_patch_instances"]


def test_predict_bad_inputs_refused_nothing_written(imported, tmp_path, capsys):
    path, _ = imported
    out = tmp_path / "p.jsonl"
    cases = [
        (["predict", path, "--model", str(tmp_path / "nope")], "no config.json"),
        (["predict", str(tmp_path / "noset"), "--model", str(tmp_path)], "no such directory"),
        (["predict", path, "--run", str(tmp_path / "norun")], "is not a run directory"),
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer.tasks.swe.limits]\nmax_turns = 0\n")
    cases.append((["predict", path, "--model", str(tmp_path), "--config", str(bad)], "max_turns"))
    for argv, why in cases:
        capsys.readouterr()
        assert tasks_main([*argv, "--out", str(out)]) == 2, argv
        assert why in capsys.readouterr().err, argv
        assert not out.exists() and not os.path.exists(str(out) + ".tmp")


def test_predict_from_a_run_checkpoint_is_the_exported_folders(imported, tmp_path, capsys):
    """--run RUN_DIR plays the checkpoint's policy: the same predictions as `asyncrl export` of
    that run, played with --model."""
    import delta_codec
    from asyncrl.cli import main as cli_main
    from policy import Transformer
    from policy.model import inference_state
    from tests.helpers.agentic import CFG, no_special_state
    from trainer import checkpoint

    path, _ = imported
    run = tmp_path / "run"
    (run / "config").mkdir(parents=True)
    (run / "config" / "run.json").write_text(json.dumps({"trainer": {"tokenizer": "char"}}))
    m = Transformer(CFG)
    m.load_inference_state(no_special_state(5))
    checkpoint.save(
        run / "checkpoints",
        checkpoint.TrainerState(
            version=7,
            epoch=1,
            model=m.state_dict(),
            optimizer={},
            digest=delta_codec.state_digest(inference_state(m)),
            model_config=m.cfg.to_dict(),
        ),
    )
    conf = tmp_path / "run.toml"
    conf.write_text("[trainer.tasks.swe.limits]\nmax_turns = 2\nturn_tokens = 40\n")
    common = ["--config", str(conf), "--split", "train", "--name", "p"]
    assert tasks_main(["predict", path, "--run", str(run), "--out", str(tmp_path / "a.jsonl"), *common]) == 0
    assert cli_main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert (
        tasks_main(
            ["predict", path, "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "b.jsonl"), *common]
        )
        == 0
    )
    a, b = ((tmp_path / f"{x}.jsonl").read_text() for x in "ab")
    assert a == b and len(a.splitlines()) == 2  # the two train instances
