"""`asyncrl tasks predict`: a policy plays a task set's eval split; its changes as SWE-bench predictions.

    asyncrl tasks predict TASKS (--model HF_DIR | --run RUN_DIR [--version N]) --out predictions.jsonl
                          [--config RUN.toml] [--split eval] [--seed 0] [--tokenizer SPEC]

TASKS: a task set (`asyncrl tasks build` / `asyncrl tasks import`). The policy: an HF folder (as
`asyncrl export` writes it) or a run's checkpoint (exported first, checked against its digest). Each
task of the split is played once through the built-in turn loop (the held-out eval's:
envs/held_out.py play_held_out, under the episode limits, prompt and sampling of the run
config's [trainer.tasks.swe] and [trainer.tasks] sampling; defaults without --config), and the
agent's change to its workspace (a `git diff` against the starting tree, caches left out) is the
instance's `model_patch`. The file is what `asyncrl tasks evaluate` and the SWE-bench harness read:
one {"instance_id", "model_name_or_path", "model_patch"} per line. A summary (resolved by the
episodes' own hidden-test runs) goes to stdout as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path
from types import SimpleNamespace

import click

from envs.swe_config import SweSection
from kernel.cli import Command, one_of
from kernel.config import ConfigError, build

DEFAULT_SAMPLING = {"temperature": 0.0, "max_tokens": 1024}


@click.command(
    "predict",
    cls=Command,
    help=__doc__,
    short_help="play a policy over a task set's eval split -> predictions.jsonl",
)
@click.argument("tasks")
@click.option("--model", help="an HF folder (config.json + model.safetensors)")
@click.option("--run", help="a run directory: its checkpoint (--version, default the newest)")
@click.option("--version", type=int, default=None)
@click.option("--out", required=True, help="the predictions file (JSONL)")
@click.option(
    "--config", default=None, help="a run TOML: [trainer.tasks.swe] limits, [trainer.tasks] sampling"
)
@click.option("--split", type=click.Choice(("train", "eval")), default="eval")
@click.option("--seed", type=int, default=0)
@click.option("--tokenizer", default="", help="char | a tokenizer.json (default: the folder's, else char)")
@click.option("--name", default="", help="model_name_or_path (default: the folder or run)")
def cli(**flags) -> int:
    a = SimpleNamespace(**flags)
    one_of(a, "model", "run", required=True)  # the policy: a folder or a run's checkpoint
    return predict_command(a)


def run_settings(path: str | None, task_set: str) -> tuple[SweSection, dict]:
    """([trainer.tasks.swe] with task_set = TASKS, [trainer.tasks] sampling) of a run TOML."""
    tasks = {}
    if path:
        try:
            tasks = tomllib.loads(Path(path).read_text()).get("trainer", {}).get("tasks", {})
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--config {path}: {e}") from None
    section = build(SweSection, {**tasks.get("swe", {}), "task_set": task_set}, "tasks.swe", "trainer")
    return section, {**DEFAULT_SAMPLING, **tasks.get("sampling", {})}


def load_policy(model_dir: str, tokenizer: str = ""):
    """(model in eval mode, tokenizer) of an HF folder."""
    from policy import load_tokenizer
    from policy.hf import load_hf_checkpoint

    _, model = load_hf_checkpoint(model_dir)
    spec = tokenizer or (
        str(Path(model_dir) / "tokenizer.json") if (Path(model_dir) / "tokenizer.json").is_file() else "char"
    )
    return model.eval(), load_tokenizer(spec)


def predict(model, tok, section: SweSection, sampling: dict, name: str, split: str = "eval", seed: int = 0):
    """-> (predictions, summary): every task of the split played once by `model`."""
    from envs import swebench
    from envs.held_out import play_held_out
    from envs.swe_env import SweEnv
    from policy import SamplingConfig

    section.check_task_set()
    env = SweEnv("swe", section.task_set, section.episode_limits(), section.reward)
    specs = [s.spec for s in env.split_specs(split)]
    preds, resolved = [], []

    def keep(ep, result) -> None:
        repo = getattr(ep.workspace, "repo", "")
        patch = swebench.workspace_patch(ep.task, repo) if repo and os.path.isdir(repo) else ""
        preds.append({"instance_id": ep.task.task_id, "model_name_or_path": name, "model_patch": patch})
        if result.resolved:
            resolved.append(ep.task.task_id)

    metrics = play_held_out(model, tok, specs, SamplingConfig.from_dict(sampling), seed, on_scored=keep)
    summary = {
        "instances": len(preds),
        "resolved_ids": sorted(resolved),
        "empty_patch_instances": sum(not p["model_patch"] for p in preds),
        **{k: v for k, v in metrics.items() if k.startswith("eval_")},
    }
    return preds, summary


def predict_command(a) -> int:
    from asyncrl.export import ExportError, write_export

    try:
        section, sampling = run_settings(a.config, a.tasks)
        section.check_task_set()  # before the model loads
        with tempfile.TemporaryDirectory(prefix="asyncrl-predict-") as tmp:
            folder = a.model
            if a.run:
                folder = write_export(a.run, os.path.join(tmp, "hf"), a.version)["out"]
            model, tok = load_policy(folder, a.tokenizer)
            name = a.name or (a.model or f"{a.run}@v{a.version if a.version is not None else 'latest'}")
            preds, summary = predict(model, tok, section, sampling, name, a.split, a.seed)
    except (ValueError, OSError, ExportError) as e:  # ConfigError, InstanceError: ValueErrors
        print(f"asyncrl tasks predict: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".tmp", "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(p, sort_keys=True) + "\n" for p in preds))
    os.replace(a.out + ".tmp", a.out)
    print(json.dumps({**summary, "predictions": a.out}, indent=2, sort_keys=True))
    return 0
