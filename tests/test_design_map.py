"""docs/design.md's map stays true: checked from the files, nothing imported.

Convention: in the section `## Where each file lives`, a table row whose first cell is a path in
backticks ending in `.py` (`| `trainer/sections.py` | what it owns |`) names that file, by its path
from the repository root. Every `.py` file under the package folders (PACKAGES, sub-packages such as
bench/chaoskit included; tests/ is not one) must be named by exactly one such row, and every such row
must name a file that exists. Paths in prose or in other cells do not count.

The folder table of `## Processes and libraries` must have a row (`| `bench/chaoskit/` | ...`) for
every folder that holds those files.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = (
    "kernel",
    "bus",
    "policy",
    "delta_codec",
    "envs",
    "trainer",
    "rollout_worker",
    "scorer",
    "asyncrl",
    "bench",
)
MAP_HEADING = "## Where each file lives"
FOLDERS_HEADING = "## Processes and libraries"
FILE_ROW = re.compile(r"^\|\s*`([^`\s]+\.py)`\s*\|")
FOLDER_ROW = re.compile(r"^\|\s*`([^`\s]+/)`\s*\|")


def package_files(root: Path, packages=PACKAGES) -> set[str]:
    """Every .py file under the package folders, as a path from root (`trainer/sections.py`)."""
    return {
        p.relative_to(root).as_posix()
        for pkg in packages
        for p in (root / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def section(text: str, heading: str) -> list[str]:
    """The lines of the `## ` section `heading`, up to the next `## ` heading."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == heading]
    if len(starts) != 1:
        raise ValueError(f"docs/design.md needs exactly one {heading!r} heading, found {len(starts)}")
    out = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("## "):
            break
        out.append(line)
    return out


def map_paths(text: str) -> list[str]:
    """The files the map names, in order (a repeated one repeated)."""
    return [m.group(1) for line in section(text, MAP_HEADING) if (m := FILE_ROW.match(line))]


def check_map(text: str, files: set[str]) -> list[str]:
    """What is wrong with the map against the files that exist: one line per problem."""
    named = map_paths(text)
    problems = [f"missing from the map: {f}" for f in sorted(files - set(named))]
    problems += [f"the map names a file that does not exist: {f}" for f in sorted(set(named) - files)]
    problems += [f"named more than once: {f}" for f in sorted({f for f in named if named.count(f) > 1})]
    return problems


def check_folders(text: str, files: set[str]) -> list[str]:
    """Folders holding mapped files that have no row in the folder table."""
    rows = {m.group(1) for line in section(text, FOLDERS_HEADING) if (m := FOLDER_ROW.match(line))}
    folders = {f.rsplit("/", 1)[0] + "/" for f in files}
    return [f"no row in the folder table: {d}" for d in sorted(folders - rows)]


def test_map_names_every_package_file_once():
    problems = check_map(DESIGN.read_text(), package_files(ROOT))
    assert not problems, "docs/design.md, " + MAP_HEADING + ":\n" + "\n".join(problems)


def test_folder_table_has_every_package_folder():
    problems = check_folders(DESIGN.read_text(), package_files(ROOT))
    assert not problems, "docs/design.md, " + FOLDERS_HEADING + ":\n" + "\n".join(problems)


def test_packages_are_the_installed_ones():
    """PACKAGES is what pyproject.toml installs, so a new package cannot stay off the map."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = conf["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} == set(PACKAGES)


MAP = """# design

## Processes and libraries

| folder | kind | owns |
| --- | --- | --- |
| `bus/` | library | the bus |

## Where each file lives

See `bus/gone.py` in prose: not a row, not checked.

| file | owns |
| --- | --- |
| `bus/__init__.py` | public names |
| `bus/client.py` | the connection |

## Next section

| `bus/later.py` | after the map: not checked |
"""


def test_checker_accepts_a_true_map():
    files = {"bus/__init__.py", "bus/client.py"}
    assert map_paths(MAP) == ["bus/__init__.py", "bus/client.py"]
    assert check_map(MAP, files) == []
    assert check_folders(MAP, files) == []


def test_checker_finds_a_missing_file():
    files = {"bus/__init__.py", "bus/client.py", "bus/pull.py"}
    assert check_map(MAP, files) == ["missing from the map: bus/pull.py"]


def test_checker_finds_a_file_that_does_not_exist():
    text = MAP.replace("| `bus/client.py` |", "| `bus/client.py` |\n| `bus/clinet.py` |", 1)
    assert check_map(text, {"bus/__init__.py", "bus/client.py"}) == [
        "the map names a file that does not exist: bus/clinet.py"
    ]


def test_checker_finds_a_file_named_twice():
    text = MAP.replace("| `bus/client.py` |", "| `bus/client.py` |\n| `bus/client.py` | again |", 1)
    assert check_map(text, {"bus/__init__.py", "bus/client.py"}) == ["named more than once: bus/client.py"]


def test_checker_finds_a_folder_without_a_row():
    files = {"bus/__init__.py", "bus/client.py", "bench/chaoskit/fleet.py"}
    assert check_folders(MAP, files) == ["no row in the folder table: bench/chaoskit/"]


def test_checker_needs_the_map_heading():
    with pytest.raises(ValueError, match="Where each file lives"):
        map_paths(MAP.replace(MAP_HEADING, "## Files"))


def test_package_files_reads_the_tree(tmp_path):
    for rel in ("bus/__init__.py", "bus/sub/x.py", "bus/__pycache__/x.py", "bus/notes.md", "other/y.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert package_files(tmp_path, ("bus",)) == {"bus/__init__.py", "bus/sub/x.py"}
