"""The helper commands a workspace has on its PATH, and the test runners.

They are written into each episode's root-owned `tools/` directory (read-only for the episode's
uid) and run inside the sandbox with the sandbox's python. In report mode (scoring) a runner reads
its key (`REPORT_KEY` in its working directory: the nonce and the tests' sha256) and deletes it
before any test code runs: the nonce is never in argv or the environment. It prints, on a copy of
stdout taken before any test code runs, numbered lines `<nonce> <seq> PASS|FAIL|SKIP <id>`, each
test once, `<nonce> <seq> TAMPER <what>` for what its integrity checks found, and last
`<nonce> <seq> END <n reports>`; envs/test_report.py reads them.
"""

from __future__ import annotations

VIEW = r"""
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
"""

REPLACE = r"""
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
"""  # noqa: E501  (the lines of a script run in the sandbox, kept as written)

# rewrite FILE <<'EOF' / def name(...): ... / EOF: the function (or a class's method) called `name`
# in FILE becomes the given one, decorators included. A fix is then the whole corrected function,
# with nothing copied from the file (no SEARCH block), so a small policy can learn it by heart.
REWRITE = r"""
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
"""  # noqa: E501  (the lines of a script run in the sandbox, kept as written)

SUBMIT = r"""#!/bin/sh
echo "submit must be the only command of its turn (a block containing just: submit)" >&2
exit 2
"""

REPORT_KEY = ".asyncrl-report-key"
PROBES = ".asyncrl-probes"

# Both runners (report mode) rewrite the asserts of the test modules so that every operand of a
# comparison, and every asserted value, passes through `_asyncrl_chk` first: a value (or an element
# of a container) that equals a fresh object of a private class (an always-equal object, mock.ANY,
# a subclass whose __eq__ answers True) or whose type takes a comparison dunder from code the
# agent added (key "changed" / "allowed": the dunders the task's files already had) is reported
# as TAMPER. Values pass through unchanged.
CHECKER = """
def _make_checker(emit, key, root):
    import ast, builtins, os
    changed = set(key.get("changed", ()))
    allowed = {k: set(v) for k, v in key.get("allowed", {}).items()}
    dunders = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__contains__")
    plain = (int, float, str, bytes, bool, type(None), complex)
    seen, hit = {}, []

    class _Fresh:
        pass

    def new_dunder(t):
        if t not in seen:
            seen[t] = False
            for name in dunders:
                code = getattr(getattr(t, name, None), "__code__", None)
                if code is None:
                    continue
                f = code.co_filename
                f = os.path.relpath(f, root) if f[:1] == "/" else f
                q = getattr(code, "co_qualname", code.co_name)
                if f in changed and q not in allowed.get(f, ()):
                    seen[t] = True
        return seen[t]

    def suspect(x, depth):
        t = type(x)
        if t in plain:
            return False
        if new_dunder(t):
            return True
        try:
            if (x == _Fresh()) is True:
                return True
        except Exception:
            pass
        if depth < 3 and t in (list, tuple, set, frozenset):
            return any(suspect(v, depth + 1) for v in list(x)[:200])
        if depth < 3 and t is dict:
            return any(suspect(k, depth + 1) or suspect(v, depth + 1) for k, v in list(x.items())[:200])
        return False

    def chk(x):
        try:
            if not hit and suspect(x, 0):
                hit.append(1)
                emit("TAMPER", f"an assert compared a {type(x).__module__}.{type(x).__qualname__[:60]} that "
                               "equals anything or takes its comparison from the agent's code")
        except Exception:
            pass
        return x

    def wrap(e):
        return ast.Call(func=ast.Name("_asyncrl_chk", ast.Load()), args=[e], keywords=[])

    class Compares(ast.NodeTransformer):
        def visit_Compare(self, n):
            self.generic_visit(n)
            n.left, n.comparators = wrap(n.left), [wrap(c) for c in n.comparators]
            return n

    class Asserts(ast.NodeTransformer):
        def visit_Assert(self, node):
            node.test = wrap(Compares().visit(node.test))
            return node

    def transform(tree):
        tree = Asserts().visit(tree)
        ast.fix_missing_locations(tree)
        return tree
    builtins._asyncrl_chk = chk
    return chk, transform
"""


# Where the code under test goes on sys.path. Started isolated (`python -I`: no working directory,
# no script directory, no PYTHON* variables, no user site on the path) by the scoring run, a runner
# imports itself first, then appends the scoring copy to the end of the path: the standard library,
# pytest, its plugins and anything they import later come from where they are installed, never
# from a file of the workspace. Only the task's own top-level modules (`own`: the names of the
# task's snapshot, from the key) are taken from the copy before an installed copy of them. Started
# plainly (the agent's run_tests), the copy goes first, as `python -m` would put it.
# The sandbox's site dirs (PYTHONPATH, set by the workspace, not the agent: the pytest copy and the
# repository's environment, envs/repo_env.py; both root-owned) go after the standard library and
# before the interpreter's own packages, where a plain `python` of the agent's finds them too, so
# both see the same packages; a runner that imported pytest already keeps the one it imported.
CODE_PATH = """
def _code_path(root, own):
    if not sys.flags.isolated:
        sys.path.insert(0, root)
        return
    import importlib.machinery, site
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    sys.path[:] = [p for p in sys.path if p not in extra]
    own_site = set(site.getsitepackages())
    at = next((i for i, p in enumerate(sys.path)
               if p in own_site or os.path.basename(p) in ("site-packages", "dist-packages")), len(sys.path))
    sys.path[at:at] = extra
    if own is None:  # a key without the task's names: what is there now
        own = [n[:-3] if n.endswith(".py") else n for n in os.listdir(root)]
    own = frozenset(own)

    class _Own:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is None and name in own:
                return importlib.machinery.PathFinder.find_spec(name, [root])
            return None
    sys.meta_path.insert(0, _Own)
    sys.path.append(root)
"""


# A dependency-free runner for generated tasks: test_* functions and Test*.test_* methods of
# test_*.py files, plain asserts. Much faster to start than pytest, which matters at one run a turn.
MINITEST = r"""
import ast, hashlib, json, os, sys, traceback, types
# CHECKER
args = sys.argv[1:]
_key = None
if args[:1] == ["--report"]:
    args = args[1:]
    try:
        with open(".asyncrl-report-key") as f:
            _key = json.load(f)
        os.unlink(".asyncrl-report-key")
    except (OSError, ValueError):
        _key = {"nonce": "", "tests": {}}
# CODE_PATH
_code_path(os.getcwd(), (_key or {}).get("own"))


def _reporter(key):
    # the nonce and the counter live in this closure, not in module globals
    nonce, write, fd, n = (key or {}).get("nonce", ""), os.write, os.dup(1), [0, 0]

    def emit(kind, rest):
        if nonce:
            n[0] += 1
            n[1] += kind in ("PASS", "FAIL", "SKIP")
            write(fd, f"\n{nonce} {n[0]} {kind} {rest}\n".encode())
    return emit, (lambda: n[1])


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


def main(report, count, key):
    import builtins
    tests_sha = key.get("tests", {})
    chk, transform = _make_checker(report, key, os.getcwd())
    if not key.get("nonce"):            # the agent's own runs: its tracebacks exactly as written
        transform = lambda tree: tree  # noqa: E731
    orig = (os.write, report.__code__, report.__closure__, BaseException, AssertionError,
            builtins._asyncrl_chk)
    n_pass = n_fail = 0
    for i, path in enumerate(files(args)):
        want = tests_sha.get(path)
        if want:
            try:
                with open(path, "rb") as f:
                    got = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                got = ""
            if got != want:
                report("TAMPER", f"{path} changed before it was collected")
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            mod = types.ModuleType(f"_minitest_{i}")
            mod.__file__ = path
            exec(compile(transform(tree), path, "exec"), mod.__dict__)
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
    if (os.write, report.__code__, report.__closure__, BaseException, AssertionError,
            builtins._asyncrl_chk) != orig:
        report("TAMPER", "the runner's reporting or exception machinery was replaced")
    report("END", count())
    print(f"{n_pass} passed, {n_fail} failed")
    return n_fail


sys.exit(1 if main(*_reporter(_key), _key or {}) else 0)
""".replace("# CHECKER", CHECKER).replace("# CODE_PATH", CODE_PATH)

# Value mode (envs/value_tests.py): the tests are ours, so the sandbox only evaluates the calls
# into the code under test and reports their values as plain tagged data; the expected values
# never enter the sandbox and the comparison happens outside it.
VALUETEST = r"""
import json, os, sys
with open(".asyncrl-probes") as f:
    _job = json.load(f)
os.unlink(".asyncrl-probes")
# CODE_PATH
_code_path(os.getcwd(), _job.get("own"))
_nonce, _fd, _write = _job["nonce"], os.dup(1), os.write
_plain = (int, float, str, bool, type(None), bytes, complex)


def _enc(x, depth=0):
    t = type(x)                      # exact types only: a subclass of int or str is not a value
    if depth > 50:
        raise ValueError("nested too deep")
    if t is bool:
        return ["b", x]
    if t is int:
        return ["i", str(x)]
    if t is float:
        return ["f", repr(x)]
    if t is str:
        return ["s", x]
    if x is None:
        return ["n"]
    if t is bytes:
        return ["y", x.hex()]
    if t is complex:
        return ["c", repr(x)]
    if t in (list, tuple, set, frozenset):
        items = [_enc(v, depth + 1) for v in (sorted(x, key=repr) if t in (set, frozenset) else x)]
        return [{list: "l", tuple: "t", set: "S", frozenset: "F"}[t], items]
    if t is dict:
        return ["d", [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]]
    raise TypeError(f"returned a {t.__module__}.{t.__qualname__}, not plain data")


out = []
try:
    _ns = {}
    exec(compile("\n".join(_job["imports"]), "<imports>", "exec"), _ns)
except BaseException as e:
    _ns = None
    _err = f"does not import: {type(e).__name__}: {str(e)[:200]}"
for tid, exprs in _job["probes"]:
    vals = []
    for ex in exprs:
        if _ns is None:
            vals.append(["raise", _err])
            continue
        try:
            vals.append(["ok", _enc(eval(ex, dict(_ns)))])
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            vals.append(["raise", f"{type(e).__name__}: {str(e)[:200]}"])
    out.append([tid, vals])
_write(_fd, f"\n{_nonce} 1 VALUES {json.dumps(out)}\n{_nonce} 2 END 0\n".encode())
""".replace("# CODE_PATH", CODE_PATH)

# pytest plugin for report mode (-p asyncrl_report, with tools/ on PYTHONPATH). Besides the report
# it snapshots, before any test code is imported, the pytest and pluggy functions a forger would
# replace and the hook implementations of the run, and reports any change as TAMPER; each test's
# status is sent once, after its teardown. The terminal summary (-rfEsxXp) is a second channel
# envs/test_report.py cross-checks against these lines.
PYTEST_REPORT = r"""
import builtins, hashlib, json, os, sys
import pluggy, _pytest.main, _pytest.outcomes, _pytest.python, _pytest.reports, _pytest.runner
import _pytest.assertion.rewrite, _pytest.skipping, _pytest.terminal
# CHECKER


def _setup():
    try:
        with open(".asyncrl-report-key") as f:
            key = json.load(f)
        os.unlink(".asyncrl-report-key")
    except (OSError, ValueError):
        key = {"nonce": "", "tests": {}}
    nonce, tests, write, fd, n = key.get("nonce", ""), key.get("tests", {}), os.write, os.dup(1), [0, 0]
    root = os.getcwd()
    R, Rep, RW = _pytest.runner, _pytest.reports.TestReport, _pytest.assertion.rewrite
    chk, transform = _make_checker(lambda kind, rest: emit(kind, rest), key, root)
    rewrite = RW.rewrite_asserts
    # modules rewritten with the checker must never be cached: pytest would write them beside the
    # installed plugins (anyio's, hypothesis's) wherever that is writable, and every later pytest
    # of the same version would load them and fail on the missing _asyncrl_chk
    sys.dont_write_bytecode = True

    def rewrite_asserts(mod, source, module_path=None, config=None):
        return rewrite(transform(mod), source, module_path, config)
    RW.rewrite_asserts = rewrite_asserts
    targets = [(R, "call_and_report"), (R, "runtestprotocol"), (R, "call_runtest_hook"),
               (R, "check_interactive_exception"),
               (R.CallInfo, "from_call"), (Rep, "from_item_and_call"), (Rep, "__init__"),
               (_pytest.reports.BaseReport, "passed"), (_pytest.reports.BaseReport, "failed"),
               (_pytest.python, "pytest_pyfunc_call"), (_pytest.main, "pytest_runtestloop"),
               (_pytest.skipping, "pytest_runtest_makereport"),
               (_pytest.terminal.TerminalReporter, "pytest_runtest_logreport"),
               (_pytest.terminal.TerminalReporter, "short_test_summary"), (_pytest.outcomes, "skip"),
               (_pytest.outcomes, "exit"),
               (_pytest.outcomes, "fail"), (_pytest.outcomes, "xfail"), (pluggy.HookCaller, "__call__"),
               (pluggy.PluginManager, "_hookexec"), (builtins, "AssertionError"), (os, "write"),
               (os, "_exit"),
               (sys, "exit"), (sys, "modules"), (builtins, "_asyncrl_chk"), (RW, "rewrite_asserts")]

    def state():
        out = []
        for o, name in targets:
            v = o.__dict__.get(name) if isinstance(o, type) else getattr(o, name, None)
            f = getattr(v, "fget", v)
            out.append((v, getattr(f, "__code__", None)))
        return out
    before = state()
    mods = {m: sys.modules.get(m)
            for m in ("pytest", "_pytest", "pluggy", "_pytest.runner", "_pytest.reports", __name__)}
    outcome = {}
    hooks0 = {}

    def emit(kind, rest):
        if nonce:
            n[0] += 1
            n[1] += kind in ("PASS", "FAIL", "SKIP")
            write(fd, f"\n{nonce} {n[0]} {kind} {rest}\n".encode())

    def sha(path):
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return ""

    def rel(path):
        return os.path.relpath(str(path), root)

    def hookimpls(config):
        return {(h, i.plugin_name, i.function, getattr(i.function, "__code__", None))
                for h in dir(config.hook) if h.startswith("pytest_")
                for i in getattr(config.hook, h).get_hookimpls()}

    def sessionstart(session):
        hooks0["set"] = hookimpls(session.config)
        hooks0["mine"] = [(i.function.__code__, i.function.__defaults__)
                          for h in ("pytest_sessionstart", "pytest_collect_file", "pytest_runtest_logreport",
                                    "pytest_unconfigure") for i in getattr(session.config.hook, h).get_hookimpls()
                          if i.plugin_name == "asyncrl_report"]

    def collect_file(file_path):
        r = rel(file_path)
        if r in tests and sha(file_path) != tests[r]:
            emit("TAMPER", f"{r} changed before it was collected")

    def logreport(report):
        o = outcome.setdefault(report.nodeid, [])
        o.append("SKIP" if report.skipped else ("PASS" if report.passed else "FAIL"))
        if report.when == "teardown":
            st = outcome.pop(report.nodeid)
            emit("FAIL" if "FAIL" in st else ("SKIP" if "SKIP" in st else "PASS"), report.nodeid)

    def unconfigure(config):
        mine = [i.function for h in ("pytest_sessionstart", "pytest_collect_file", "pytest_runtest_logreport",
                                     "pytest_unconfigure") for i in getattr(config.hook, h).get_hookimpls()
                if i.plugin_name == "asyncrl_report"]
        if [(f.__code__, f.__defaults__) for f in mine] != hooks0.get("mine"):
            emit("TAMPER", "the report plugin's hooks were replaced")
        if state() != before or any(sys.modules.get(m) is not v for m, v in mods.items()):
            emit("TAMPER", "pytest's reporting machinery was replaced while the tests ran")
        for h, plugin, fn, code in hookimpls(config) - hooks0.get("set", set()):
            # pytest's own objects register hooks as the session goes (its fixture manager); a hook
            # whose code lives in the repository (or nowhere) must be a task conftest, unchanged
            f = getattr(code, "co_filename", "") or "<none>"
            inside = f.startswith("<") or not os.path.relpath(f, root).startswith("..")
            if inside and not (os.path.basename(f) == "conftest.py" and tests.get(rel(f)) == sha(f)):
                emit("TAMPER", f"hook {h} registered at run time by {plugin} ({rel(f) if f[0] != '<' else f})")
        for nodeid in outcome:
            emit("FAIL", nodeid)
        emit("END", n[1])
    return sessionstart, collect_file, logreport, unconfigure


# the hooks call the closures through default arguments: rebinding this module's globals (or
# replacing it in sys.modules) changes nothing; replacing a hook's code or defaults is checked
_start, _collect, _log, _unconf = _setup()
del _setup


def pytest_sessionstart(session, _f=_start):
    _f(session)


def pytest_collect_file(file_path, parent, _f=_collect):
    _f(file_path)


def pytest_runtest_logreport(report, _f=_log):
    _f(report)


def pytest_unconfigure(config, _f=_unconf):
    _f(config)
""".replace("# CHECKER", CHECKER)  # noqa: E501  (the lines of a script run in the sandbox, kept as written)


# pytest for the scoring run, started `python -I` by path: pytest, pluggy and the report plugin (loaded
# from this directory by file, registered as an object: no module name is looked up for it) are
# imported before the scoring copy is on the path, which then comes last (CODE_PATH), and test
# modules are appended to the path (--import-mode=append), never put before it. The site dir of a
# sandbox python without pytest comes from PYTHONPATH, which -I leaves to us to read.
PYTEST_RUN = r"""
import os, sys
if sys.flags.isolated:
    sys.path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
import importlib.util, json
try:
    with open(".asyncrl-report-key") as f:
        _own = json.load(f).get("own")  # the plugin reads the rest and deletes the file
except (OSError, ValueError, AttributeError):
    _own = None
import pluggy, pytest, _pytest.config, _pytest.main, _pytest.python, _pytest.runner, _pytest.terminal
_spec = importlib.util.spec_from_file_location(
    "asyncrl_report", os.path.join(os.path.dirname(os.path.abspath(__file__)), "asyncrl_report.py"))
_plugin = importlib.util.module_from_spec(_spec)
sys.modules["asyncrl_report"] = _plugin
_spec.loader.exec_module(_plugin)
# CODE_PATH
_code_path(os.getcwd(), _own)
sys.exit(pytest.main(sys.argv[1:], plugins=[_plugin]))
""".replace("# CODE_PATH", CODE_PATH)


def test_command(
    runner: str, test_paths: list[str], tools: str, report: bool = False, isolated: bool = True
) -> str:
    """The shell command that runs a task's tests (report mode: the key file REPORT_KEY must be in
    the working directory; nothing secret is on the command line). Report mode starts the runner
    isolated (`-I`: nothing of the working directory can stand in for it, PYTEST_RUN / CODE_PATH),
    unbuffered (`-u`: pytest's summary lands before the report's END) and without bytecode (`-B`);
    `isolated=False` is the former `python -m` launch (kept for the tests that show the difference)."""
    import shlex

    paths = " ".join(shlex.quote(p) for p in test_paths)
    py = f"{tools}/python -I -B -u" if report and isolated else "python"
    if runner == "mini":
        return f"{py} {tools}/minitest.py {'--report ' if report else ''}{paths}"
    if runner == "pytest" and report and isolated:
        return (
            f"COLUMNS=4000 {py} {tools}/pytestrun.py -p no:cacheprovider --import-mode=append "
            f"--tb=no -q -rfEsxXp {paths}"
        )
    if runner == "pytest":
        # COLUMNS: the terminal summary (a second channel, envs/test_report.py) is never cut
        rep = f"COLUMNS=4000 PYTHONPATH={tools}${{PYTHONPATH:+:$PYTHONPATH}} " if report else ""
        extra = "-p asyncrl_report --tb=no -q -rfEsxXp" if report else "-q --tb=short"
        return f"{rep}python -m pytest -p no:cacheprovider {extra} {paths}"
    raise ValueError(f"unknown test runner {runner!r}")


def value_command(tools: str) -> str:
    """The value-mode harness (envs/value_tests.py writes PROBES into the working directory)."""
    return f"{tools}/python -I -B -u {tools}/valuetest.py"


def tool_files(python: str, runner: str, test_paths: list[str], tools: str) -> dict[str, tuple[str, int]]:
    """name -> (content, mode) of everything in an episode's tools/ directory."""

    def py(body: str) -> str:
        return f"#!{python}\n{body}"

    wrapper = f'#!/bin/sh\nexec {python} "$@"\n'
    return {
        "python": (wrapper, 0o755),
        "python3": (wrapper, 0o755),
        "view": (py(VIEW), 0o755),
        "replace": (py(REPLACE), 0o755),
        "rewrite": (py(REWRITE), 0o755),
        "submit": (SUBMIT, 0o755),
        "run_tests": (f'#!/bin/sh\nexec {test_command(runner, test_paths, tools)} "$@"\n', 0o755),
        "minitest.py": (MINITEST, 0o644),
        "asyncrl_report.py": (PYTEST_REPORT, 0o644),
        "pytestrun.py": (PYTEST_RUN, 0o644),
        "valuetest.py": (VALUETEST, 0o644),
    }
