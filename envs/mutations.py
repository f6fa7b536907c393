"""Bug injection by AST mutation, of the kinds SWE-smith uses.

Every candidate is found on the AST and applied to the *text*: only the mutated expression (or
the removed statement's lines) changes, so comments and formatting elsewhere stay as they were
and the diff is a one-line bug, like a real one. A candidate is kept only if the spliced text
parses to exactly the AST mutation intended (parenthesised if precedence demands, else dropped).
"""

from __future__ import annotations

import ast
import copy
import difflib
from dataclasses import dataclass

KINDS = (
    "swap_operator",
    "change_constant",
    "change_comparison",
    "invert_condition",
    "remove_statement",
    "off_by_one_range",
)

_BINOP_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CMP_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutation:
    kind: str
    path: str
    line: int  # 1-based first line changed
    before: str  # the original line(s)
    after: str  # the mutated line(s) ("" for a removed statement)
    source: str  # the whole mutated file

    def describe(self) -> str:
        return f"{self.kind} at {self.path}:{self.line}: {self.before.strip()!r} -> {self.after.strip()!r}"


def _edits(node: ast.AST):
    """(kind, edit) pairs for one node; edit(node_in_a_copy) mutates the copy in place and returns
    (expression whose source span is replaced, its replacement) or ("remove", stmt, parent body)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:

        def e(n):
            n.op = _BINOP_SWAP[type(n.op)]()
            return n, n

        yield "swap_operator", e
    if isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP:

        def e(n):
            n.op = _BINOP_SWAP[type(n.op)]()
            return n, n

        yield "swap_operator", e
    if isinstance(node, ast.BoolOp):

        def e(n):
            n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
            return n, n

        yield "swap_operator", e
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _CMP_SWAP:

        def e(n):
            n.ops[0] = _CMP_SWAP[type(n.ops[0])]()
            return n, n

        yield "change_comparison", e
    if isinstance(node, ast.Constant) and type(node.value) is int:

        def e(n):
            n.value = n.value + 1 if n.value != 1 else 0
            return n, n

        yield "change_constant", e
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):

        def e(n):
            old = n.test
            n.test = (
                old.operand
                if isinstance(old, ast.UnaryOp) and isinstance(old.op, ast.Not)
                else ast.UnaryOp(ast.Not(), old)
            )
            return old, n.test

        yield "invert_condition", e
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and 1 <= len(node.args) <= 3
        and not node.keywords
    ):
        k = 0 if len(node.args) == 1 else 1
        for op in (ast.Add, ast.Sub):

            def e(n, op=op):
                old = n.args[k]
                n.args[k] = ast.BinOp(old, op(), ast.Constant(1))
                return old, n.args[k]

            yield "off_by_one_range", e
    for field in ("body", "orelse", "finalbody") if not isinstance(node, (ast.Module, ast.ClassDef)) else ():
        body = getattr(node, field, None)
        if isinstance(body, list) and len(body) > 1:
            for j, st in enumerate(body):
                if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)) and not (
                    isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
                ):  # not a docstring

                    def e(n, field=field, j=j):
                        b = getattr(n, field)
                        return "remove", b.pop(j)

                    yield "remove_statement", e


def _line_starts(src: bytes) -> list[int]:
    starts = [0]
    for i, c in enumerate(src):
        if c == 10:
            starts.append(i + 1)
    return starts


def candidates(source: str, path: str = "<file>", kinds: tuple[str, ...] = KINDS) -> list[Mutation]:
    """Every valid mutation of `source`, in a deterministic order (AST walk order)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    src = source.encode("utf-8")
    starts = _line_starts(src)
    lines = source.splitlines(keepends=True)
    out: list[Mutation] = []
    for i, node in enumerate(ast.walk(tree)):
        for kind, edit in _edits(node):
            if kind not in kinds:
                continue
            t = copy.deepcopy(tree)
            res = edit(list(ast.walk(t))[i])
            want = ast.dump(t)
            if res[0] == "remove":
                st = res[1]
                a, b = (
                    starts[st.lineno - 1],
                    starts[st.end_lineno] if st.end_lineno < len(starts) else len(src),
                )
                head = src[a : a + st.col_offset]
                tail = src[starts[st.end_lineno - 1] + st.end_col_offset : b]
                if head.strip() or (tail.strip() and not tail.strip().startswith(b"#")):
                    continue  # shares its line with other code
                variants = [src[:a] + src[b:]]
                line, before, after = st.lineno, "".join(lines[st.lineno - 1 : st.end_lineno]), ""
            else:
                span, new = res
                if getattr(span, "end_col_offset", None) is None:
                    continue
                a = starts[span.lineno - 1] + span.col_offset
                b = starts[span.end_lineno - 1] + span.end_col_offset
                text = ast.unparse(new).encode()
                variants = [src[:a] + text + src[b:], src[:a] + b"(" + text + b")" + src[b:]]
                line = span.lineno
            for v in variants:
                mutated = v.decode("utf-8")
                try:
                    ok = ast.dump(ast.parse(mutated)) == want
                except SyntaxError:
                    ok = False
                if ok:
                    if res[0] != "remove":
                        line, before, after = _changed_lines(source, mutated)
                    out.append(Mutation(kind, path, line, before, after, mutated))
                    break
    return out


def _changed_lines(a: str, b: str) -> tuple[int, str, str]:
    """(1-based first changed line, original lines, mutated lines) of a one-hunk change."""
    al, bl = a.splitlines(keepends=True), b.splitlines(keepends=True)
    sm = difflib.SequenceMatcher(a=al, b=bl, autojunk=False)
    ops = [op for op in sm.get_opcodes() if op[0] != "equal"]
    if not ops:
        return 0, "", ""
    return ops[0][1] + 1, "".join(al[ops[0][1] : ops[-1][2]]), "".join(bl[ops[0][3] : ops[-1][4]])


def balanced_order(muts: list[Mutation], rng) -> list[Mutation]:
    """The candidates shuffled, then interleaved kind by kind (in a shuffled kind order), so the
    first few tried spread over the kinds instead of following how many sites each kind has."""
    muts = list(muts)
    rng.shuffle(muts)
    by_kind = {k: [m for m in muts if m.kind == k] for k in KINDS}
    kinds = [k for k in KINDS if by_kind[k]]
    rng.shuffle(kinds)
    out = []
    for i in range(max((len(v) for v in by_kind.values()), default=0)):
        out += [by_kind[k][i] for k in kinds if i < len(by_kind[k])]
    return out


def counts_by_kind(muts) -> dict[str, int]:
    return {k: sum(m.kind == k for m in muts) for k in KINDS}
