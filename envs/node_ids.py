"""Pytest node ids ("path::name", "path::Class::name[params]") read against the test files they
name: which ids name a test those files do not define.

A static reading (ast), so it refuses only what pytest could not collect either: a name counts as
defined when the file binds it at its top (def, class, assignment, import, also under `if` / `try`),
a method when its class defines it or may inherit it (a class with bases, a metaclass or a
decorator). A file that does not parse (another Python's syntax), a star import, or a name a
reading cannot check (doctest ids, a non-`.py` file) is taken on trust.
"""

from __future__ import annotations

import ast
import functools

# statements whose bodies still bind names of the enclosing scope
_BLOCKS = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)
_TRUST = None  # a scope whose names cannot be known statically
ELSEWHERE = object()  # what `text_of` gives for a file that is not here to read (an image's): trusted


def split_id(node_id: str) -> tuple[str, list[str]]:
    """(file path, [names]) of a node id; parameters ("[...]", which may hold "::") dropped."""
    path, _, rest = node_id.partition("::")
    return path, rest.split("[", 1)[0].split("::")


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST] | None:
    """{name: the statement binding it} of one scope's body; None when a star import hides them."""
    out: dict[str, ast.AST] = {}
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[st.name] = st
        elif isinstance(st, ast.Assign):
            out.update((n, st) for t in st.targets for n in _targets(t))
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
            out.update((n, st) for n in _targets(st.target))
        elif isinstance(st, ast.Import):
            out.update(((a.asname or a.name.split(".")[0]), st) for a in st.names)
        elif isinstance(st, ast.ImportFrom):
            if any(a.name == "*" for a in st.names):
                return _TRUST
            out.update(((a.asname or a.name), st) for a in st.names)
        if isinstance(st, _BLOCKS):
            if isinstance(st, (ast.For, ast.AsyncFor)):
                out.update((n, st) for n in _targets(st.target))
            if isinstance(st, (ast.With, ast.AsyncWith)):
                out.update((n, st) for i in st.items if i.optional_vars for n in _targets(i.optional_vars))
            inner = list(getattr(st, "body", [])) + list(getattr(st, "orelse", []))
            inner += list(getattr(st, "finalbody", []))
            inner += [s for h in getattr(st, "handlers", []) for s in h.body]
            sub = _bound(inner)
            if sub is _TRUST:
                return _TRUST
            out.update(sub)
    return out


def _may_inherit(cls: ast.ClassDef) -> bool:
    return bool(cls.bases or cls.keywords or cls.decorator_list)


@functools.lru_cache(maxsize=8)
def _module_scope(text: str) -> dict[str, ast.AST] | None:
    """The names a test file binds at module level, once per file text (a package's suite lists
    hundreds of ids of one large file); None when it does not parse."""
    try:
        return _bound(ast.parse(text).body)
    except (SyntaxError, ValueError):
        return None


def why_unknown(node_id: str, text: str) -> str | None:
    """Why the file `text` (the one node_id's path names) defines no such test, or None (defined,
    or not decidable by reading)."""
    path, names = split_id(node_id)
    if not path.endswith(".py") or not all(n.isidentifier() for n in names):
        return None
    if "globals()" in text:  # tests made at import time: pytest knows them, a reading does not
        return None
    scope = _module_scope(text)
    if scope is None:
        return None
    for depth, name in enumerate(names):
        if scope is _TRUST:
            return None
        node = scope.get(name)
        if node is None:
            where = f"class {names[depth - 1]}" if depth else path
            return f"{where} defines no {name!r}"
        if not isinstance(node, ast.ClassDef) or depth == len(names) - 1:
            return None  # bound, though not by a class: whatever it holds, pytest decides
        if _may_inherit(node):
            return None
        scope = _bound(node.body)
    return None


def unknown_ids(ids: list[str], text_of) -> list[tuple[str, str]]:
    """(id, why) of each id naming a test the files lack. `text_of(path)`: the file's text, None
    when it is not there at all, ELSEWHERE when it cannot be read here (taken on trust)."""
    out, texts = [], {}
    for tid in ids:
        path, _ = split_id(tid)
        if path not in texts:
            texts[path] = text_of(path)
        text = texts[path]
        if text is None:
            out.append((tid, f"{path} is not in the repository nor in the test_patch"))
        elif text is not ELSEWHERE:
            why = why_unknown(tid, text)
            if why:
                out.append((tid, why))
    return out
