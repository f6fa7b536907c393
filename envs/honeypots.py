"""Honeypot tests: a verdict a report forged inside the test process cannot pass without computing
each test's outcome (report mode: third-party pytest suites, mini-runner tests value mode cannot take).

    planted = plant(task, texts, rng)         # texts: test file -> pristine text; a fresh draw a run
    planted.files                             # -> the scoring copy: test files with the honeypots in
    status, why = planted.judge(reported)     # <- the report's statuses: the task's ids, and why not

Each scoring run draws up to MAX_TWINS of the task's own tests (fail-to-pass first: those a forger
needs), and for each writes HONEY_PER_TWIN copies into its file next to it, with one top-level
assertion changed so that the copy cannot pass wherever the original does:

* an expected literal of an `==` (or of `assertEqual`), or one element of a list / tuple / set / dict
  literal there, becomes another value of the same type and style (ints: consecutive values around
  the true one, the true one at a random place among them; strings: one character replaced at the
  same place in every copy), so that v == c and c != c' leave v != c' for plain values;
* otherwise (no literal) the assertion is negated: the single comparison's operator flipped (`==`
  <-> `!=`, `in` <-> `not in`, `<` <-> `>=`, ...), `assert x` -> `assert not (x)`, `assertTrue` <->
  `assertFalse`, ...: one copy.

Names are the original's plus a common suffix, and a coin decides whether the original keeps its
name or swaps it with one of its copies (the report is mapped back), so neither name nor place tells
the original. Parametrised tests are copied whole (same parameters, same ids after the name).

The verdict: every copy whose original is among the task's tests must be reported, and reported
FAIL whenever its original is reported PASS; otherwise the run is `tampered`. Code that makes every
test pass (a patched framework, a forged report, a shadow runner, an always-equal object) passes
the copies too; to pass an original it must tell it from its copies, i.e. know the true value.

Not covered (docs/environments.md): a test with no top-level assertion (asserts only inside loops,
`with` blocks, helpers; `pytest.raises` only) or with decorators other than `parametrize` is never
copied, and a task with none such gets no honeypots; copies by negation are told apart by style
priors (most tests assert `==`); a forger that carries the visible tests' text can find the copies
of those (it cannot for tests it has not seen: hidden tests, an imported task's test patch); a
nondeterministic test (its value changes between runs of the same call) can make an honest run
look tampered.
"""

from __future__ import annotations

import ast
import re
import string
from dataclasses import dataclass, field

MAX_TWINS = 4  # originals copied per run (fail-to-pass first)
HONEY_PER_TWIN = 3  # copies of an original whose expected literal can be changed (1 when negated)
SUFFIXES = (
    "basic",
    "simple",
    "again",
    "more",
    "other",
    "edge",
    "case",
    "values",
    "small",
    "large",
    "mixed",
    "extra",
    "typical",
    "plain",
    "two",
    "single",
    "many",
    "short",
    "long",
    "alt",
)
FLIP = {"==": "!=", "!=": "==", "<": ">=", ">=": "<", ">": "<=", "<=": ">", "in": "not in",
        "not in": "in", "is": "is not", "is not": "is"}  # fmt: skip
UNITTEST_FLIP = {"assertTrue": "assertFalse", "assertFalse": "assertTrue", "assertIn": "assertNotIn",
                 "assertNotIn": "assertIn", "assertIsNone": "assertIsNotNone",
                 "assertIsNotNone": "assertIsNone", "assertEqual": "assertNotEqual",
                 "assertNotEqual": "assertEqual", "assertIs": "assertIsNot",
                 "assertIsNot": "assertIs"}  # fmt: skip


@dataclass
class Planted:
    files: dict[str, str] = field(default_factory=dict)  # test file -> text with the honeypots
    honey: dict[str, str] = field(default_factory=dict)  # reported honeypot id -> its original's id
    renamed: dict[str, str] = field(default_factory=dict)  # reported id -> the task's id (swapped names)

    def judge(self, reported: dict[str, str]) -> tuple[dict[str, str], list[str]]:
        """(the task's statuses, why the report cannot be believed) from the report's statuses."""
        status = {}
        for rid, s in reported.items():
            if rid not in self.honey:
                status[self.renamed.get(rid, rid)] = s
        why = []
        for hid, tid in self.honey.items():
            got = reported.get(hid)
            if got is None:
                why.append(f"a honeypot test was not reported ({_fn(hid)})")
            elif status.get(tid) == "PASS" and got != "FAIL":
                why.append(f"a honeypot test was reported {got} with its original ({_fn(tid)})")
        return status, why[:3]


def _fn(tid: str) -> str:
    return tid.split("[")[0][:120]


@dataclass
class _Twin:
    path: str
    cls: str | None  # enclosing class, or None
    name: str
    node: ast.FunctionDef
    ids: list[str]  # the task's ids of this function (several when parametrised)
    f2p: bool


def plant(task, texts: dict[str, str], rng, mini: bool | None = None) -> Planted:
    """Honeypots for `task` over the pristine test files `texts`; `rng` a fresh random source
    (secrets.SystemRandom) per scoring run. Files that do not parse are left alone."""
    mini = task.runner == "mini" if mini is None else mini
    f2p = set(task.fail_to_pass)
    by_fn: dict[tuple[str, str | None, str], list[str]] = {}
    for tid in list(dict.fromkeys(task.fail_to_pass + task.pass_to_pass)):
        parts = tid.split("::")
        if len(parts) not in (2, 3) or parts[0] not in texts:
            continue
        base, _, params = parts[-1].partition("[")
        if params and mini:
            continue
        by_fn.setdefault((parts[0], parts[1] if len(parts) == 3 else None, base), []).append(tid)
    trees: dict[str, ast.Module | None] = {}
    twins = []
    for (path, cls, name), ids in by_fn.items():
        if path not in trees:
            try:
                trees[path] = ast.parse(texts[path])
            except (SyntaxError, ValueError):
                trees[path] = None
        node = _find(trees[path], cls, name) if trees[path] else None
        if node is not None and _eligible(node, trees[path], cls, mini) and _sites(node):
            twins.append(_Twin(path, cls, name, node, ids, any(t in f2p for t in ids)))
    rng.shuffle(twins)
    twins.sort(key=lambda t: not t.f2p)  # stable: fail-to-pass first, in random order
    out = Planted()
    lines = {p: texts[p].splitlines(keepends=True) for p in texts}
    taken = {p: _names(t) for p, t in trees.items() if t}
    for tw in sorted(twins[:MAX_TWINS], key=lambda t: -t.node.lineno):
        _plant_one(tw, lines[tw.path], taken[tw.path], rng, out)
    for p in {tw.path for tw in twins[:MAX_TWINS]}:
        out.files[p] = "".join(lines[p])
    return out


def _find(tree: ast.Module, cls: str | None, name: str):
    body = tree.body
    if cls is not None:
        c = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if c is None:
            return None
        body = c.body
    fns = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fns[0] if len(fns) == 1 else None


def _eligible(fn: ast.FunctionDef, tree: ast.Module, cls: str | None, mini: bool) -> bool:
    if any(
        isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal)) for n in ast.walk(fn)
    ):
        return False
    for d in fn.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if mini or not (isinstance(f, ast.Attribute) and f.attr == "parametrize"):
            return False
    marked = [n for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)]
    if cls is not None:
        c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        marked += c.decorator_list + [
            n for n in c.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)
        ]
    return not marked  # xfail / skip marks would turn a copy's failure into something else


def _names(tree: ast.Module) -> set[str]:
    return {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


# -- the assertions a copy may change --------------------------------------------------------------


def _literal(node) -> ast.Constant | None:
    """The constant to change inside an expected value: itself, the number under a minus sign, or
    one element of a one-level list / tuple / set / dict literal (None if there is none)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Constant):
        return node if _mutable(node) else None
    elems = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else None
    if isinstance(node, ast.Dict):
        elems = node.values
    if elems is None:
        return None
    for e in elems:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            e = e.operand
        if isinstance(e, ast.Constant) and _mutable(e):
            return e
    return None


def _mutable(c: ast.Constant) -> bool:
    v = c.value
    if c.lineno != c.end_lineno:
        return False
    if isinstance(v, bool):
        return False  # True/False: negated instead (one copy, no room for more)
    if isinstance(v, int):
        return True
    if isinstance(v, float):
        return v == v and abs(v) < 1e15
    if isinstance(v, str):
        return any(ch.isalnum() and ch.isascii() for ch in v) and "\\" not in v
    return False


def _sites(fn: ast.FunctionDef) -> list[tuple[str, ast.AST, ast.AST | None]]:
    """(kind, statement, literal) of the top-level assertions of `fn`: kind "literal" (change the
    expected constant) or "negate"."""
    out = []
    for st in fn.body:
        if st.lineno != st.end_lineno:
            continue
        if isinstance(st, ast.Assert):
            t = st.test
            if isinstance(t, ast.Compare) and len(t.ops) == 1:
                lit = None
                if isinstance(t.ops[0], ast.Eq):
                    lit = _literal(t.comparators[0]) or _literal(t.left)
                out.append(("literal", st, lit) if lit else ("negate", st, None))
            else:
                out.append(("negate", st, None))
        elif (
            isinstance(st, ast.Expr)
            and isinstance(st.value, ast.Call)
            and isinstance(st.value.func, ast.Attribute)
            and isinstance(st.value.func.value, ast.Name)
            and st.value.func.value.id == "self"
            and st.value.func.attr in UNITTEST_FLIP
        ):
            call = st.value
            lit = None
            if call.func.attr == "assertEqual" and len(call.args) == 2:
                lit = _literal(call.args[1]) or _literal(call.args[0])
            out.append(("literal", st, lit) if lit else ("negate", st, None))
    return out


def _new_values(c: ast.Constant, n: int, rng) -> list[str]:
    """n source texts of other values of c's type, in c's style."""
    v = c.value
    if isinstance(v, (int, float)):
        # the true value's place among n + 1 consecutive ones, at random (never below 0: a literal
        # under a minus sign is its absolute value)
        at = rng.randrange(int(min(n, v)) + 1)
        return [(str if isinstance(v, int) else repr)(v - at + j) for j in range(n + 1) if j != at]
    idx = [i for i, ch in enumerate(v) if ch.isalnum() and ch.isascii()]
    i = rng.choice(idx)
    ch = v[i]
    pool = (
        string.digits
        if ch.isdigit()
        else (string.ascii_uppercase if ch.isupper() else string.ascii_lowercase)
    )
    subs = rng.sample([x for x in pool if x != ch], n)
    return [v[:i] + s + v[i + 1 :] for s in subs]


def _splice(line: str, start: int, end: int, text: str) -> str:
    """line with its UTF-8 byte columns [start, end) (ast offsets) replaced by text."""
    b = line.encode("utf-8")
    return (b[:start] + text.encode("utf-8") + b[end:]).decode("utf-8")


def _mutations(fn: ast.FunctionDef, lines: list[str], rng) -> list[tuple[int, str]]:
    """[(line index, new line)] for each copy: one changed assertion line each."""
    sites = _sites(fn)
    lits = [s for s in sites if s[0] == "literal"]
    kind, st, lit = rng.choice(lits or sites)
    i = st.lineno - 1
    line = lines[i]
    if kind == "literal":
        seg = line.encode("utf-8")[lit.col_offset : lit.end_col_offset].decode("utf-8")
        quote = seg[0] if isinstance(lit.value, str) else ""
        if isinstance(lit.value, str) and (seg[:1] not in "'\"" or seg[-1:] != quote or len(seg) < 2):
            kind = "negate"
        else:
            return [
                (i, _splice(line, lit.col_offset, lit.end_col_offset, f"{quote}{v}{quote}" if quote else v))
                for v in _new_values(lit, HONEY_PER_TWIN, rng)
            ]
    if isinstance(st, ast.Assert):
        t = st.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1:
            b = line.encode("utf-8")
            a, z = t.left.end_col_offset, t.comparators[0].col_offset
            mid = b[a:z].decode("utf-8")
            m = re.fullmatch(r"(\s*)(==|!=|<=|>=|<|>|not\s+in|in|is\s+not|is)(\s*)", mid)
            if m:
                op = FLIP[" ".join(m.group(2).split())]
                return [(i, _splice(line, a, z, f"{m.group(1) or ' '}{op}{m.group(3) or ' '}"))]
        seg = line.encode("utf-8")[t.col_offset : t.end_col_offset].decode("utf-8")
        return [(i, _splice(line, t.col_offset, t.end_col_offset, f"not ({seg})"))]
    f = st.value.func
    return [(i, _splice(line, f.value.end_col_offset + 1, f.end_col_offset, UNITTEST_FLIP[f.attr]))]


def _plant_one(tw: _Twin, lines: list[str], taken: set[str], rng, out: Planted) -> None:
    fn = tw.node
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
    end = fn.end_lineno
    block = [ln if ln.endswith("\n") else ln + "\n" for ln in lines[start:end]]
    while end < len(lines) and not lines[end].strip():
        end += 1  # the blank lines after it go along, so the copies are spaced like the file
    before = start
    while before > 0 and not lines[before - 1].strip():
        before -= 1
    gap = lines[fn.end_lineno : end] or lines[before:start] or ["\n"]
    muts = _mutations(fn, lines, rng)
    names = []
    for _ in muts:
        for _ in range(100):
            cand = f"{tw.name}_{rng.choice(SUFFIXES)}"
            if cand not in taken:
                break
            cand = f"{cand}_{rng.randrange(2, 99)}"
            if cand not in taken:
                break
        taken.add(cand)
        names.append(cand)
    # who keeps the task's name: the original or one of its copies
    slots = [None] + list(range(len(muts)))  # None: the original
    rng.shuffle(slots)
    keep = rng.randrange(len(slots))  # the slot that gets the original name
    pool = list(names)
    new_blocks = []
    prefix = "::".join([tw.path] + ([tw.cls] if tw.cls else []))
    for k, slot in enumerate(slots):
        nm = tw.name if k == keep else pool.pop()
        b = list(block)
        if slot is not None:
            li, new = muts[slot]
            b[li - start] = new
        d = fn.lineno - 1 - start
        b[d] = re.sub(rf"\bdef\s+{re.escape(tw.name)}\b", f"def {nm}", b[d], count=1)
        new_blocks.append(b)
        for tid in tw.ids:
            rid = tid.replace(f"{prefix}::{tw.name}", f"{prefix}::{nm}", 1)
            if slot is None:
                if rid != tid:
                    out.renamed[rid] = tid
            else:
                out.honey[rid] = tid
    text = []
    for k, b in enumerate(new_blocks):
        text += b + (gap if k < len(new_blocks) - 1 else [])
    lines[start : fn.end_lineno] = text
