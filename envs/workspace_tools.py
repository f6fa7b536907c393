"""The helper commands a workspace has on its PATH, and the test runners.

They are written into each episode's root-owned `tools/` directory (read-only for the episode's
uid) and run inside the sandbox with the sandbox's python. Test runners print one line per test
in report mode, `<nonce> PASS|FAIL <id>`, on a copy of stdout taken before any test code runs.
"""
from __future__ import annotations

VIEW = r'''
import sys
args = sys.argv[1:]
if not args or len(args) > 3:
    sys.exit("usage: view FILE [START [END]]")
try:
    lines = open(args[0], encoding="utf-8", errors="replace").read().splitlines()
    start = int(args[1]) if len(args) > 1 else 1
    end = int(args[2]) if len(args) > 2 else (len(lines) if len(args) > 1 else min(len(lines), 200))
except (OSError, ValueError) as e:
    sys.exit(f"view: {e}")
start = max(start, 1)
for i in range(start, min(end, len(lines)) + 1):
    print(f"{i:6d}  {lines[i - 1]}")
if len(args) == 1 and len(lines) > end:
    print(f"[... {len(lines) - end} more lines: view {args[0]} {end + 1} {len(lines)}]")
'''

REPLACE = r'''
import re, sys
if len(sys.argv) != 2:
    sys.exit("usage: replace FILE <<'EOF'\n<<<<<<< SEARCH\nold lines\n=======\nnew lines\n>>>>>>> REPLACE\nEOF")
path, block = sys.argv[1], sys.stdin.read()
m = re.fullmatch(r"\s*<<<<<<< SEARCH\n(.*?)\n?=======\n(.*?)\n?>>>>>>> REPLACE\s*", block, re.S)
if not m:
    sys.exit("replace: stdin must be <<<<<<< SEARCH / old lines / ======= / new lines / >>>>>>> REPLACE")
old, new = m.group(1), m.group(2)
try:
    text = open(path, encoding="utf-8").read()
except OSError as e:
    sys.exit(f"replace: {e}")
n = text.count(old) if old else 0
if n != 1:
    sys.exit(f"replace: the SEARCH block occurs {n} times in {path}; it must occur exactly once")
with open(path, "w", encoding="utf-8") as f:
    f.write(text.replace(old, new, 1))
print(f"replaced {old.count(chr(10)) + 1} line(s) with {new.count(chr(10)) + 1 if new else 0} in {path}")
'''

# rewrite FILE <<'EOF' / def name(...): ... / EOF: the function (or a class's method) called `name`
# in FILE becomes the given one, decorators included. A fix is then the whole corrected function,
# with nothing copied from the file (no SEARCH block), so a small policy can learn it by heart.
REWRITE = r'''
import ast, os, sys, textwrap
FN = (ast.FunctionDef, ast.AsyncFunctionDef)
MAX = 200_000
if len(sys.argv) != 2:
    sys.exit("usage: rewrite FILE <<'EOF'\ndef name(...):\n    ...\nEOF  (replaces the function or method `name` in FILE)")
path = sys.argv[1]
root = os.path.realpath(os.getcwd())
real = os.path.realpath(path)
if not real.startswith(root + os.sep):
    sys.exit(f"rewrite: {path} is outside the repository")
if not os.path.isfile(real):
    sys.exit(f"rewrite: {path} is not a file")
body = sys.stdin.read(MAX + 1)
if len(body) > MAX:
    sys.exit(f"rewrite: the new function is longer than {MAX} characters")
body = textwrap.dedent(body.strip("\n")) + "\n"
try:
    new = ast.parse(body)
except SyntaxError as e:
    sys.exit(f"rewrite: the new function does not parse: {e.msg} (its line {e.lineno})")
if len(new.body) != 1 or not isinstance(new.body[0], FN):
    sys.exit("rewrite: stdin must be exactly one function (def NAME(...): ...) and nothing else")
name = new.body[0].name
try:
    text = open(real, encoding="utf-8").read()
    tree = ast.parse(text)
except (OSError, UnicodeDecodeError) as e:
    sys.exit(f"rewrite: {e}")
except SyntaxError as e:
    sys.exit(f"rewrite: {path} does not parse ({e.msg}, line {e.lineno}): use replace")
found = [n for n in tree.body if isinstance(n, FN) and n.name == name]
found += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, FN) and m.name == name]
if len(found) != 1:
    names = sorted({n.name for n in ast.walk(tree) if isinstance(n, FN)})
    sys.exit(f"rewrite: {path} defines {name} {len(found)} times (it must be exactly once); "
             f"its functions: {', '.join(names) or 'none'}")
f = found[0]
start, end = min([f.lineno] + [d.lineno for d in f.decorator_list]), f.end_lineno
lines = text.splitlines(keepends=True)
indent = lines[start - 1][:len(lines[start - 1]) - len(lines[start - 1].lstrip())]
repl = [indent + ln if ln.strip() else ln for ln in body.splitlines(keepends=True)]
if not lines[end - 1].endswith("\n"):
    repl[-1] = repl[-1].rstrip("\n")
out = "".join(lines[:start - 1] + repl + lines[end:])
try:
    ast.parse(out)
except SyntaxError as e:
    sys.exit(f"rewrite: {path} would not parse with it ({e.msg}, line {e.lineno}); nothing changed")
with open(real, "w", encoding="utf-8") as fh:
    fh.write(out)
print(f"rewrote {name}")
'''

SUBMIT = r'''#!/bin/sh
echo "submit must be the only command of its turn (a block containing just: submit)" >&2
exit 2
'''

# A dependency-free runner for generated tasks: test_* functions and Test*.test_* methods of
# test_*.py files, plain asserts. Much faster to start than pytest, which matters at one run a turn.
MINITEST = r'''
import importlib.util, os, sys, traceback
args = sys.argv[1:]
nonce = None
if args[:1] == ["--report"]:
    nonce, args = args[1], args[2:]
report_fd = os.dup(1)
sys.path.insert(0, os.getcwd())

def report(status, tid):
    if nonce:
        os.write(report_fd, f"\n{nonce} {status} {tid}\n".encode())

def files(paths):
    for p in paths or ["."]:
        if os.path.isdir(p):
            for d, dirs, fs in sorted(os.walk(p)):
                dirs.sort()
                for f in sorted(fs):
                    if f.startswith("test") and f.endswith(".py"):
                        yield os.path.relpath(os.path.join(d, f))
        else:
            yield p

n_pass = n_fail = 0
for i, path in enumerate(files(args)):
    try:
        spec = importlib.util.spec_from_file_location(f"_minitest_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException:
        print(f"ERROR collecting {path}")
        traceback.print_exc(limit=-3)
        n_fail += 1
        continue
    tests = []
    for name, obj in list(vars(mod).items()):
        if name.startswith("test") and callable(obj) and not isinstance(obj, type):
            tests.append((f"{path}::{name}", obj))
        elif name.startswith("Test") and isinstance(obj, type):
            for m in [m for m in vars(obj) if m.startswith("test")]:
                tests.append((f"{path}::{name}::{m}", (lambda c=obj, m=m: getattr(c(), m)())))
    for tid, fn in tests:
        try:
            fn()
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            n_fail += 1
            print(f"FAILED {tid}")
            tb = traceback.extract_tb(e.__traceback__)[1:]
            # paths relative to the repository root: the episode's temp dir is noise to the policy
            print("".join(traceback.format_list(tb[-3:])).replace(os.getcwd() + os.sep, "")
                  + f"{type(e).__name__}: {e}".rstrip())
            report("FAIL", tid)
        else:
            n_pass += 1
            report("PASS", tid)
print(f"{n_pass} passed, {n_fail} failed")
sys.exit(1 if n_fail else 0)
'''

# pytest plugin for report mode (-p asyncrl_report, with tools/ on PYTHONPATH)
PYTEST_REPORT = r'''
import os
_nonce = os.environ.pop("ASYNCRL_REPORT_NONCE", "")
_fd = os.dup(1)

def pytest_runtest_logreport(report):
    if _nonce and (report.when == "call" or (report.when == "setup" and not report.passed)):
        status = "PASS" if report.passed else ("SKIP" if report.skipped else "FAIL")
        os.write(_fd, f"\n{_nonce} {status} {report.nodeid}\n".encode())
'''


def test_command(runner: str, test_paths: list[str], tools: str, report_nonce: str | None = None) -> str:
    """The shell command that runs a task's tests (in report mode with a nonce)."""
    import shlex
    paths = " ".join(shlex.quote(p) for p in test_paths)
    if runner == "mini":
        rep = f"--report {report_nonce} " if report_nonce else ""
        return f"python {tools}/minitest.py {rep}{paths}"
    if runner == "pytest":
        rep = (f"ASYNCRL_REPORT_NONCE={report_nonce} PYTHONPATH={tools}${{PYTHONPATH:+:$PYTHONPATH}} "
               if report_nonce else "")
        extra = "-p asyncrl_report --tb=no -q" if report_nonce else "-q --tb=short"
        return f"{rep}python -m pytest -p no:cacheprovider {extra} {paths}"
    raise ValueError(f"unknown test runner {runner!r}")


def tool_files(python: str, runner: str, test_paths: list[str], tools: str) -> dict[str, tuple[str, int]]:
    """name -> (content, mode) of everything in an episode's tools/ directory."""
    def py(body: str) -> str:
        return f"#!{python}\n{body}"
    wrapper = f'#!/bin/sh\nexec {python} "$@"\n'
    return {
        "python": (wrapper, 0o755), "python3": (wrapper, 0o755),
        "view": (py(VIEW), 0o755), "replace": (py(REPLACE), 0o755),
        "rewrite": (py(REWRITE), 0o755), "submit": (SUBMIT, 0o755),
        "run_tests": (f'#!/bin/sh\nexec {test_command(runner, test_paths, tools)} "$@"\n', 0o755),
        "minitest.py": (MINITEST, 0o644), "asyncrl_report.py": (PYTEST_REPORT, 0o644),
    }
