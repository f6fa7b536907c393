"""Value-mode scoring for tests that are ours (generated repositories, HumanEval tasks): the code
under test never sees an expected value and never runs a comparison that counts.

    p = plan(task)                  # None when a test is not of the supported shape (-> runner)
    job = p.job(nonce)              # -> the sandbox: imports + the probe expressions, nothing else
    status = p.evaluate(values)     # <- the probes' values, as tagged plain data; compared here

A test function (or a method of a plain `Test*` class that never uses `self`) is supported when
its body is only `assert`s (and `candidate = f` aliases): every
maximal call into the repository's code inside an assert (`gcd(12, 18)`, `candidate([1, 2], 3)`)
becomes a probe the sandbox evaluates (envs/workspace_tools.py: VALUETEST) and reports as tagged
data of exact builtin types (an int subclass, an always-equal object, anything not plain data is
refused there, and whatever the code does to that harness it can only report values). The rest of
the assert is evaluated here, in a fresh namespace built from the test module's own trusted
top-level code, with each probe replaced by its decoded value. A probe that raised fails its test.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

PROBE = "_asyncrl_probe_"
_LITERAL_OK = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign, ast.Expr)


@dataclass
class Plan:
    imports: list[str] = field(default_factory=list)  # harness: imports of the code under test
    probes: list[tuple[str, list[str]]] = field(default_factory=list)  # (test id, probe sources)
    checks: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # test id -> (file, assert exprs)
    context: dict[str, str] = field(default_factory=dict)  # test file -> its trusted top-level code

    def job(self, nonce: str) -> dict:
        return {"nonce": nonce, "imports": self.imports, "probes": [[t, ps] for t, ps in self.probes]}

    def evaluate(self, values) -> tuple[dict[str, str], str]:
        """({test id: PASS|FAIL}, first failure) from the harness's VALUES."""
        got = {}
        if isinstance(values, list):
            for item in values:
                if (
                    isinstance(item, list)
                    and len(item) == 2
                    and isinstance(item[0], str)
                    and item[0] not in got
                ):
                    got[item[0]] = item[1]
        ns_of = {path: _context_ns(src) for path, src in self.context.items()}
        status, first = {}, ""
        for tid, exprs in self.probes:
            ok, why = _check(self.checks[tid], exprs, got.get(tid), ns_of)
            status[tid] = "PASS" if ok else "FAIL"
            if not ok and not first:
                first = f"{tid}: {why}"
        return status, first


def _context_ns(src: str) -> dict:
    ns: dict = {}
    exec(compile(src, "<test context>", "exec"), ns)  # the task's own top-level code (ours)
    return ns


def _check(check: tuple[str, list[str]], exprs: list[str], vals, ns_of: dict) -> tuple[bool, str]:
    path, asserts = check
    if not isinstance(vals, list) or len(vals) != len(exprs):
        return False, "no values reported"
    env = dict(ns_of[path])
    for k, v in enumerate(vals):
        if not (isinstance(v, list) and len(v) == 2 and v[0] in ("ok", "raise")):
            return False, "malformed value"
        if v[0] == "raise":
            return False, f"{exprs[k][:80]} raised {str(v[1])[:120]}"
        try:
            env[f"{PROBE}{k}"] = decode(v[1])
        except (ValueError, TypeError, KeyError, IndexError) as e:
            return False, f"{exprs[k][:80]}: {e}"
    for a in asserts:
        try:
            if not eval(a, env):
                return False, f"assert {a[:120]}"
        except Exception as e:
            return False, f"assert {a[:80]}: {type(e).__name__}: {e}"
    return True, ""


def decode(v, depth: int = 0):
    """The harness's tagged data back to plain values (only these types exist on this side)."""
    if depth > 60 or not isinstance(v, list) or not v or not isinstance(v[0], str):
        raise ValueError("bad value encoding")
    tag = v[0]
    if tag == "n":
        return None
    arg = v[1]
    if tag == "b" and isinstance(arg, bool):
        return arg
    if tag == "i" and isinstance(arg, str):
        return int(arg)
    if tag == "f" and isinstance(arg, str):
        return float(arg)
    if tag == "s" and isinstance(arg, str):
        return arg
    if tag == "y" and isinstance(arg, str):
        return bytes.fromhex(arg)
    if tag == "c" and isinstance(arg, str):
        return complex(arg)
    if tag in ("l", "t", "S", "F") and isinstance(arg, list):
        items = [decode(x, depth + 1) for x in arg]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d" and isinstance(arg, list):
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in arg}
    raise ValueError(f"bad value tag {tag!r}")


def _test_files(task, snap: dict[str, str]) -> list[str]:
    out = []
    for p in task.test_paths:
        p = os.path.normpath(p).replace(os.sep, "/")
        if p in snap:
            out.append(p)
        else:
            out += sorted(
                r
                for r in snap
                if r.startswith(p.rstrip("/") + "/")
                and os.path.basename(r).startswith("test")
                and r.endswith(".py")
            )
    return out


def plan(task, snap: dict[str, str] | None = None) -> Plan | None:
    """The value-mode plan of a mini-runner task, or None (the runner then runs the tests)."""
    if task.runner != "mini":
        return None
    if snap is None:
        from .scoring_copy import snapshot

        try:
            snap = {
                r: d.decode("utf-8")
                for r, (k, d) in snapshot(task).items()
                if k == "file" and r.endswith(".py")
            }
        except (OSError, UnicodeDecodeError):
            return None
    files = _test_files(task, snap)
    modules = {r[:-3].replace("/", ".") for r in snap if r.endswith(".py") and r not in files}
    roots = {m.split(".")[0] for m in modules}
    p = Plan()
    for path in files:
        try:
            tree = ast.parse(snap[path])
        except SyntaxError:
            return None
        if not _file_plan(p, path, tree, roots):
            return None
    return p if p.probes else None


def _file_plan(p: Plan, path: str, tree: ast.Module, roots: set[str]) -> bool:
    cands, cmods, ctx = set(), set(), []
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in roots
        ):
            cands |= {a.asname or a.name for a in node.names}
            p.imports.append(ast.unparse(node))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] in roots for a in node.names):
            if not all(a.name.split(".")[0] in roots for a in node.names):
                return False
            cmods |= {(a.asname or a.name).split(".")[0] for a in node.names}
            p.imports.append(ast.unparse(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            p.imports.append(ast.unparse(node))  # stdlib names a probe's arguments may use
            ctx.append(node)
        elif isinstance(node, ast.FunctionDef):
            ctx.append(node)
        elif isinstance(node, ast.Assign) and _literal(node.value):
            ctx.append(node)
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            or isinstance(node, ast.ClassDef)
        ):
            continue  # (a class: its tests below, or refused there)
        else:
            return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if node.decorator_list or node.args.args or node.args.vararg or node.args.kwonlyargs:
                return False
            if not _add_test(p, f"{path}::{node.name}", path, node, cands, cmods):
                return False
        elif isinstance(node, ast.ClassDef):
            if not _class_plan(p, path, node, cands, cmods):
                return False
    p.context[path] = ast.unparse(ast.Module(body=ctx, type_ignores=[]))
    return True


def _add_test(p: Plan, tid: str, path: str, fn: ast.FunctionDef, cands, cmods) -> bool:
    plan = _test_plan(fn, cands, cmods)
    if plan is None:
        return False
    p.probes.append((tid, plan[0]))
    p.checks[tid] = (path, plan[1])
    return True


def _class_plan(p: Plan, path: str, cls: ast.ClassDef, cands, cmods) -> bool:
    """A plain test class (`class TestX:` of `def test_y(self):` methods of asserts that never use
    `self`): each method is a test `path::TestX::test_y`, as the mini runner names it."""
    if not cls.name.startswith("Test") or cls.bases or cls.keywords or cls.decorator_list:
        return False  # a helper class or a unittest case: its code would have to run here
    for node in cls.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        a = node.args if isinstance(node, ast.FunctionDef) else None
        if (
            a is None
            or not node.name.startswith("test")
            or node.decorator_list
            or [x.arg for x in a.posonlyargs + a.args] != ["self"]
            or a.vararg
            or a.kwonlyargs
            or a.kwarg
            or any(isinstance(n, ast.Name) and n.id == "self" for n in ast.walk(ast.Module(node.body, [])))
        ):
            return False
        if not _add_test(p, f"{path}::{cls.name}::{node.name}", path, node, cands, cmods):
            return False
    return True


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _test_plan(fn: ast.FunctionDef, cands: set[str], cmods: set[str]) -> tuple[list[str], list[str]] | None:
    alias: dict[str, str] = {}
    probes: list[str] = []
    asserts: list[str] = []
    for st in fn.body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue
        if (
            isinstance(st, ast.Assign)
            and len(st.targets) == 1
            and isinstance(st.targets[0], ast.Name)
            and isinstance(st.value, ast.Name)
            and (st.value.id in cands or st.value.id in alias)
        ):
            alias[st.targets[0].id] = alias.get(st.value.id, st.value.id)
            continue
        if not isinstance(st, ast.Assert):
            return None
        names = cands | set(alias)

        def is_probe(node) -> bool:
            if not isinstance(node, ast.Call):
                return False
            f = node.func
            while isinstance(f, ast.Attribute):
                f = f.value
            return isinstance(f, ast.Name) and (
                f.id in names and f is node.func or f.id in cmods  # noqa: B023  (used in this iteration only)
            )

        class Swap(ast.NodeTransformer):
            def visit_Call(self, node):
                if is_probe(node):
                    src = _Resolve(alias).visit(ast.parse(ast.unparse(node), mode="eval"))
                    probes.append(ast.unparse(src))
                    return ast.Name(id=f"{PROBE}{len(probes) - 1}", ctx=ast.Load())
                return self.generic_visit(node)

        test = Swap().visit(ast.parse(ast.unparse(st.test), mode="eval"))
        if any(isinstance(n, ast.Name) and (n.id in names or n.id in cmods) for n in ast.walk(test)):
            return None  # the code under test used as a value: not a probe
        asserts.append(ast.unparse(test))
    return probes, asserts


class _Resolve(ast.NodeTransformer):
    def __init__(self, alias: dict[str, str]):
        self.alias = alias

    def visit_Name(self, node):
        return ast.Name(id=self.alias.get(node.id, node.id), ctx=node.ctx)
