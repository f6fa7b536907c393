"""A tiny pure-Python package with its own pytest suite, as a source distribution: the offline
stand-in for a PyPI sdist that `asyncrl tasks build --sdist` turns into real-package tasks (used by
bench.reward_hacks and the task-builder tests)."""

from __future__ import annotations

import io
import os
import tarfile

TINY_SRC = '''"""tinypkg: a few helpers."""


def snake(name):
    out = []
    for i, c in enumerate(name):
        if c.isupper() and i > 0:
            out.append("_")
        out.append(c.lower())
    return "".join(out)


def clamp(x, lo, hi):
    return max(lo, min(x, hi))


def window_sums(xs, k):
    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]
'''
TINY_TESTS = """import pytest
from tinypkg import snake, clamp, window_sums


@pytest.mark.parametrize("name,want", [("FooBar", "foo_bar"), ("x", "x"), ("HTTPCode", "h_t_t_p_code")])
def test_snake(name, want):
    assert snake(name) == want


def test_clamp():
    assert clamp(5, 0, 3) == 3
    assert clamp(-1, 0, 3) == 0
    assert clamp(2, 0, 3) == 2


def test_window_sums():
    assert window_sums([1, 2, 3, 4], 2) == [3, 5, 7]
    assert window_sums([1, 2], 3) == []
"""


def write_sdist(
    dest: str, name: str = "tinypkg-0.1", extra: dict[str, str] | None = None, conftest: bool = False
) -> str:
    """`dest/<name>.tar.gz` holding the package, its tests (and a conftest of its own when asked) and
    `extra` files (path inside the archive -> text); returns its path."""
    files = {
        f"{name}/tinypkg/__init__.py": TINY_SRC,
        f"{name}/tests/test_tinypkg.py": TINY_TESTS,
        f"{name}/setup.py": "from setuptools import setup\nsetup(name='tinypkg')\n",
    }
    if conftest:
        files[f"{name}/tests/conftest.py"] = (
            "import pytest\n\n\n@pytest.fixture\ndef unused():\n    return 1\n"
        )
    files.update(extra or {})
    path = os.path.join(dest, f"{name}.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
