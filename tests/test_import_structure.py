"""Import structure of the packages, checked from source with `ast` (nothing is imported).

Rules, each over every module of PACKAGES, each failure naming the modules and lines:
- no import circle between modules. Every import statement counts wherever it stands: inside
  functions (a lazy import in a function is the usual way to hide a circle; it still couples the two
  modules both ways) and under `if TYPE_CHECKING:` too (a type-only circle is the same coupling; a
  module that needs another's type without importing it takes a Protocol). `from pkg import name` is
  an edge to pkg.name when that is a module, else to pkg (its __init__); the implicit import of a
  module's parent packages is no edge (every submodule would otherwise close a circle with its package).
- no private name across modules: `from x import _y`, and `import x` (or `from pkg import x`) then
  `x._y`, where x is one of our modules (dunder names such as __version__ are public). A private
  module (`_m.py`) may be imported from within its own package only.
- layering: a library (LIBRARIES) imports no process package (PROCESSES), and a process package imports
  no other one, except the two that drive the others (LAUNCHERS): asyncrl, the CLI, checks each
  process's config section with that process's own config class and its signing key with
  trainer.keys before it starts them (it starts them as `python -m <package>`, no import); bench runs
  the real processes and asyncrl's launcher. trainer, rollout_worker and scorer import neither.
- one import style per package for imports within it: absolute in kernel, bus and asyncrl (what
  most of their modules used), relative everywhere else.
- the kernel (config, logging, metrics, lifetime) imports none of our packages: every other package
  may stand on it without pulling in NATS.

ALLOWED_CIRCLE_EDGES may list imports that close a known circle while it is being untangled (empty).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("kernel", "bus", "policy", "delta_codec", "envs")
PROCESSES = ("trainer", "rollout_worker", "scorer", "asyncrl", "bench")
PACKAGES = LIBRARIES + PROCESSES
# process packages that may import other process packages (see the module docstring)
LAUNCHERS = {
    "asyncrl": {"trainer", "rollout_worker", "scorer"},
    "bench": {"trainer", "rollout_worker", "scorer", "asyncrl"},
}

# imports within a package: "absolute" (`from bus.x import y`) or "relative" (`from .x import y`)
STYLE = {"kernel": "absolute", "bus": "absolute", "asyncrl": "absolute"}
DEFAULT_STYLE = "relative"

# imports that close a known circle, being removed in another branch: drop an entry once that is merged
ALLOWED_CIRCLE_EDGES: set[tuple[str, str]] = set()  # none: every circle is a failure


@dataclass(frozen=True)
class Import:
    """One import of one of our modules: `target` imported by `source`, line `line`."""

    source: str
    target: str
    line: int
    relative: bool = False


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def discover(root: Path, packages=PACKAGES) -> dict[str, tuple[str, bool]]:
    """{module name: (source, is package __init__)} for every .py file of the packages under root."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            mods[".".join(parts)] = (path.read_text(), is_pkg)
    return mods


def _longest_known(name: str, mods) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return None


def _resolve_from(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Report:
    imports: list[Import]
    private: list[str]

    def graph(self) -> dict[str, set[str]]:
        g: dict[str, set[str]] = {}
        for imp in self.imports:
            g.setdefault(imp.source, set()).add(imp.target)
        return g


def scan(mods: dict[str, tuple[str, bool]]) -> Report:
    """Every import of one of our modules, and every private name used across modules."""
    imports, private = [], []
    for module, (src, is_pkg) in mods.items():
        tree = ast.parse(src, filename=module)
        aliases: dict[str, str] = {}  # local name -> our module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = _longest_known(a.name, mods)
                    if target and target != module:
                        imports.append(Import(module, target, node.lineno))
                    if a.asname and a.name in mods:
                        aliases[a.asname] = a.name
                    elif not a.asname and a.name.split(".")[0] in mods:
                        top = a.name.split(".")[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(node, module, is_pkg)
                if _longest_known(base, mods) is None:  # another library's module
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    target = sub if sub in mods else _longest_known(base, mods)
                    if target and target != module:
                        imports.append(Import(module, target, node.lineno, relative=node.level > 0))
                    if sub in mods:
                        aliases[a.asname or a.name] = sub
                        own_pkg = base in (module, module.rsplit(".", 1)[0])  # its package or __init__
                        if _is_private(a.name) and not own_pkg:
                            private.append(f"{module}:{node.lineno} imports private module {sub}")
                    elif _is_private(a.name) and base != module:
                        private.append(f"{module}:{node.lineno} imports {base}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _dotted(node.value, aliases)
                if owner in mods and owner != module:
                    private.append(f"{module}:{node.lineno} uses {owner}.{node.attr}")
    return Report(imports, private)


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`a.b.c` as the dotted module path it names through the module's import aliases, else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        return f"{head}.{node.attr}" if head else None
    return None


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def layering(imports: list[Import]) -> list[str]:
    """Imports that cross the layers: library -> process package, process -> another process package."""
    bad = set()
    for imp in imports:
        src, dst = imp.source.split(".")[0], imp.target.split(".")[0]
        if src == dst or dst not in PROCESSES:
            continue
        if src in LIBRARIES:
            bad.add(f"{imp.source}:{imp.line} (library) imports {imp.target} (process)")
        elif dst not in LAUNCHERS.get(src, ()):
            bad.add(f"{imp.source}:{imp.line} imports another process package: {imp.target}")
    return sorted(bad)


def style(imports: list[Import]) -> list[str]:
    """Imports within a package that are not in its style (STYLE)."""
    bad = set()
    for imp in imports:
        pkg = imp.source.split(".")[0]
        if pkg != imp.target.split(".")[0]:
            continue
        want = STYLE.get(pkg, DEFAULT_STYLE)
        if imp.relative != (want == "relative"):
            how = "relatively" if imp.relative else "absolutely"
            bad.add(
                f"{imp.source}:{imp.line} imports {imp.target} {how} ({pkg} imports {want}ly within itself)"
            )
    return sorted(bad)


def _explain(comp: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in comp for b in graph.get(a, ()) if b in comp)
    return f"{sorted(comp)}: {', '.join(edges)}"


# -- the tree ---------------------------------------------------------------------------------------


@functools.cache
def _report() -> Report:
    # scanned on first use, not at collection: every xdist worker collects this file
    return scan(discover(ROOT))


def test_no_import_circles():
    graph = _report().graph()
    for a, b in ALLOWED_CIRCLE_EDGES:
        graph.get(a, set()).discard(b)
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(_explain(c, graph) for c in found)


def test_allowed_circle_edges_still_close_a_circle():
    # a stale allow-list entry would let a circle come back through it unnoticed
    graph = _report().graph()
    comps = circles(graph)
    stale = sorted(
        e
        for e in ALLOWED_CIRCLE_EDGES
        if e[1] not in graph.get(e[0], ()) or not any(set(e) <= c for c in comps)
    )
    assert not stale, f"ALLOWED_CIRCLE_EDGES entries that close no circle any more, remove them: {stale}"


def test_no_private_names_across_modules():
    assert not _report().private, "private names used across modules:\n" + "\n".join(_report().private)


def test_layering():
    bad = layering(_report().imports)
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_kernel_stands_on_nothing_of_ours():
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in _report().imports
        if i.source.split(".")[0] == "kernel" and i.target.split(".")[0] != "kernel"
    ]
    assert not bad, "the kernel imports our packages:\n" + "\n".join(bad)


def test_a_logger_or_a_config_loads_no_nats_client():
    """The point of the kernel: a library that only logs or reads config does not pull in nats-py."""
    import subprocess
    import sys

    code = "import sys, kernel, kernel.metrics, kernel.lifetime, envs.arith; print('nats' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_import_style_per_package():
    bad = style(_report().imports)
    assert not bad, "imports against their package's style:\n" + "\n".join(bad)


# -- the checker itself, on synthetic trees -----------------------------------------------------------


def _synthetic(tmp_path: Path, files: dict[str, str]) -> Report:
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return scan(discover(tmp_path, packages=sorted({rel.split("/")[0] for rel in files})))


def test_checker_finds_circles(tmp_path):
    rep = _synthetic(
        tmp_path,
        {
            "bus/__init__.py": "",
            "bus/a.py": "from bus.b import x\n",
            "bus/b.py": "def f():\n    from . import a  # lazy: still a circle\n",
            "bus/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bus.d import T\n",
            "bus/d.py": "import bus.c\n",
            "bus/g.py": "import bus.a\n",  # imports into a circle: not part of it
            "bus/e.py": "import bus.f as f\n",
            "bus/f.py": "from bus import e\n",
        },
    )
    assert sorted(sorted(c) for c in circles(rep.graph())) == [
        ["bus.a", "bus.b"],
        ["bus.c", "bus.d"],
        ["bus.e", "bus.f"],
    ]


def test_checker_finds_circle_through_package_init(tmp_path):
    rep = _synthetic(
        tmp_path,
        {
            "bus/__init__.py": "from .a import A\n",
            "bus/a.py": "from bus import B\nA = 1\n",
        },
    )
    assert circles(rep.graph()) == [frozenset({"bus", "bus.a"})]


def test_checker_finds_private_names(tmp_path):
    rep = _synthetic(
        tmp_path,
        {
            "bus/__init__.py": "",
            "bus/a.py": "_x = 1\n__version__ = '1'\ndef f():\n    return _x\n",
            "bus/_m.py": "",
            "bus/b.py": "from bus.a import _x, __version__\nfrom . import _m\n",
            "bus/c.py": "import bus.a\nimport bus.a as ba\nbus.a._x\nba._x\nba.f\n",
            "trainer/__init__.py": "",
            "trainer/t.py": "from bus import _m\n",
        },
    )
    assert sorted(rep.private) == [
        "bus.b:1 imports bus.a._x",
        "bus.c:3 uses bus.a._x",
        "bus.c:4 uses bus.a._x",
        "trainer.t:1 imports private module bus._m",
    ]


def test_checker_finds_layering(tmp_path):
    rep = _synthetic(
        tmp_path,
        {
            "bus/__init__.py": "",
            "bus/a.py": "def f():\n    from trainer import t\n",
            "trainer/__init__.py": "",
            "trainer/t.py": "import rollout_worker.w\nimport bus.a\n",
            "rollout_worker/__init__.py": "",
            "rollout_worker/w.py": "",
            "asyncrl/__init__.py": "",
            "asyncrl/launch.py": "from trainer import t\nfrom rollout_worker import w\n",
            "scorer/__init__.py": "",
            "scorer/s.py": "from asyncrl import launch\n",
        },
    )
    assert layering(rep.imports) == [
        "bus.a:2 (library) imports trainer.t (process)",
        "scorer.s:1 imports another process package: asyncrl.launch",
        "trainer.t:1 imports another process package: rollout_worker.w",
    ]


def test_checker_finds_style(tmp_path):
    rep = _synthetic(
        tmp_path,
        {
            "bus/__init__.py": "from bus.a import A\n",
            "bus/a.py": "from .b import B\n",
            "bus/b.py": "import bus.c\nimport policy\n",
            "bus/c.py": "",
            "policy/__init__.py": "from . import m\n",
            "policy/m.py": "from policy.n import x\nfrom bus.a import A\n",
            "policy/n.py": "",
        },
    )
    assert style(rep.imports) == [
        "bus.a:1 imports bus.b relatively (bus imports absolutely within itself)",
        "policy.m:1 imports policy.n absolutely (policy imports relatively within itself)",
    ]
