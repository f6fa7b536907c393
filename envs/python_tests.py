"""`python-tests`: the completion is Python code; success is the fraction of the task's unit tests
it passes, run in the sandbox (envs/sandbox.py). Tasks come from a small bank of function
problems; each task draws fresh test inputs and computes the expected outputs with the bank's
reference solution (trusted code, run here, not in the sandbox).
"""

from __future__ import annotations

import json
import re
import secrets

from .arith import randint
from .base import SpecError, TaskSpec, Verdict, check_split, register, split_of
from .sandbox import SandboxLimits, run_python


# name -> (signature, description, reference source, input generator(rng) -> args list)
def ints(rng, n, lo=-50, hi=50):
    return [randint(rng, lo, hi) for _ in range(n)]


def word(rng, alphabet="abcde", lo=0, hi=8):
    return "".join(alphabet[randint(rng, 0, len(alphabet) - 1)] for _ in range(randint(rng, lo, hi)))


PROBLEMS: dict[str, tuple[str, str, str, object]] = {
    "sum_even": (
        "sum_even(xs)",
        "return the sum of the even numbers in the list xs",
        "def sum_even(xs):\n    return sum(x for x in xs if x % 2 == 0)\n",
        lambda r: [ints(r, randint(r, 0, 8))],
    ),
    "reverse_words": (
        "reverse_words(s)",
        "return s with the order of its space-separated words reversed",
        "def reverse_words(s):\n    return ' '.join(s.split(' ')[::-1])\n",
        lambda r: [" ".join(word(r, lo=1) for _ in range(randint(r, 1, 4)))],
    ),
    "count_vowels": (
        "count_vowels(s)",
        "return how many characters of s are vowels (aeiou)",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
        lambda r: [word(r, "abeiouxyz")],
    ),
    "max_gap": (
        "max_gap(xs)",
        "return the largest difference between consecutive elements of sorted(xs), 0 if fewer than 2",
        "def max_gap(xs):\n    s = sorted(xs)\n"
        "    return max((b - a for a, b in zip(s, s[1:])), default=0)\n",
        lambda r: [ints(r, randint(r, 0, 7))],
    ),
    "is_palindrome": (
        "is_palindrome(s)",
        "return True if s reads the same backwards, else False",
        "def is_palindrome(s):\n    return s == s[::-1]\n",
        lambda r: [(lambda w: w + w[::-1][randint(r, 0, 1) :] if randint(r, 0, 1) else w)(word(r, "ab"))],
    ),
    "gcd": (
        "gcd(a, b)",
        "return the greatest common divisor of the non-negative integers a and b",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        lambda r: [randint(r, 0, 500), randint(r, 0, 500)],
    ),
    "run_length": (
        "run_length(s)",
        "return the run-length encoding of s as a list of [char, count] pairs",
        "def run_length(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
        "            out[-1][1] += 1\n        else:\n            out.append([c, 1])\n    return out\n",
        lambda r: [word(r, "aab", 0, 10)],
    ),
    "second_largest": (
        "second_largest(xs)",
        "return the second largest distinct value in xs, or None if there is none",
        "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None\n",
        lambda r: [ints(r, randint(r, 0, 6), -5, 5)],
    ),
    "fib": (
        "fib(n)",
        "return the n-th Fibonacci number, fib(0) = 0, fib(1) = 1",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        lambda r: [randint(r, 0, 40)],
    ),
    "digit_sum": (
        "digit_sum(n)",
        "return the sum of the decimal digits of the integer n (ignore the sign)",
        "def digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))\n",
        lambda r: [randint(r, -(10**6), 10**6)],
    ),
    "dedupe": (
        "dedupe(xs)",
        "return xs without repeated elements, keeping the first occurrence of each",
        "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out\n",
        lambda r: [ints(r, randint(r, 0, 9), 0, 5)],
    ),
    "is_prime": (
        "is_prime(n)",
        "return True if the integer n is prime, else False",
        "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
        lambda r: [randint(r, -3, 200)],
    ),
}

# Runs inside the sandbox. It sees only the inputs, never the expected outputs: the comparison
# happens in the scorer, so code that forges the report must still produce the right values.
HARNESS = r"""
import json, os, sys
nonce = sys.stdin.readline().strip()
task = json.loads(sys.stdin.readline())
out = os.dup(1)          # the report goes to our own copy of stdout, whatever the code does to sys.stdout

def report(**res):
    os.write(out, ("\n" + nonce + " " + json.dumps(res) + "\n").encode())

try:
    import solution
    fn = getattr(solution, task["entry"])
except BaseException as e:
    report(error=f"solution does not load: {type(e).__name__}: {str(e)[:200]}")
    raise SystemExit(0)
results = []
for args in task["args"]:
    try:
        got = fn(*args)
        try:
            results.append(["ok", json.loads(json.dumps(got))])
        except (TypeError, ValueError) as e:
            results.append(["err", f"returned a non-JSON value {type(got).__name__}"])
    except BaseException as e:
        results.append(["err", f"raised {type(e).__name__}: {str(e)[:120]}"])
report(results=results)
"""

FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.S)


def extract_code(text: str) -> str:
    """The code in a completion: the first fenced block if there is one, else the whole text."""
    m = FENCE.search(text)
    return m.group(1) if m else text


def same_value(got, want) -> bool:
    """JSON values equal as Python compares them, except that a bool is not a number: True == 1
    and False == 0 in Python, so "return 1" would pass for "return True" and "return False" for 0."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same_value(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    return got == want


class PythonTestsEnv:
    blocking = True  # verify() waits on a subprocess: callers run it off the event loop

    def __init__(
        self,
        name: str = "python-tests",
        n_tests: int = 8,
        limits: SandboxLimits | None = None,
        eval_fraction: float = 0.2,
    ):
        self.name, self.n_tests, self.eval_fraction = name, n_tests, eval_fraction
        self.limits = limits or SandboxLimits(wall_s=5.0, cpu_s=3, memory_mb=512)

    def make_task(self, problem: str, rng) -> TaskSpec:
        sig, desc, ref, gen = PROBLEMS[problem]
        ns: dict = {}
        exec(ref, ns)  # trusted reference solution
        fn = ns[sig.split("(")[0]]
        tests = []
        for _ in range(self.n_tests):
            args = gen(rng)
            tests.append([args, json.loads(json.dumps(fn(*args)))])
        prompt = f"# Write a Python function {sig}: {desc}.\n"
        return TaskSpec(prompt=prompt, spec={"problem": problem, "entry": sig.split("(")[0], "tests": tests})

    def sample(self, rng, split: str = "train") -> TaskSpec:
        check_split(split)
        names = sorted(PROBLEMS)
        for _ in range(10_000):
            t = self.make_task(names[randint(rng, 0, len(names) - 1)], rng)
            if split_of(json.dumps(t.spec, sort_keys=True), self.eval_fraction) == split:
                return t
        raise RuntimeError(f"{self.name}: could not draw a {split} task")

    @staticmethod
    def _check(spec: dict) -> None:
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("entry"), str)
            and spec["entry"].isidentifier()
            and isinstance(spec.get("tests"), list)
            and spec["tests"]
            and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], list) for t in spec["tests"])
        ):
            raise SpecError(
                f"python-tests spec needs 'entry' (identifier) and 'tests' [[args, expected], ...], "
                f"got {spec!r:.200}"
            )

    def verify(self, text: str, spec: dict) -> Verdict:
        self._check(spec)
        if not isinstance(text, str) or not text.strip():
            return Verdict(0.0, "empty completion", tool_calls=0)
        nonce = secrets.token_hex(16)
        task = json.dumps({"entry": spec["entry"], "args": [args for args, _ in spec["tests"]]})
        run = run_python(
            {"solution.py": extract_code(text), "harness.py": HARNESS},
            "harness.py",
            self.limits,
            stdin=f"{nonce}\n{task}\n".encode(),
        )
        line = next(
            (
                ln
                for ln in run.stdout.decode("utf-8", "replace").splitlines()[::-1]
                if ln.startswith(nonce + " ")
            ),
            None,
        )
        if line is None:  # died before reporting: the sandbox says why
            why = run.reason if not run.ok else "exited without a test report"
            tail = run.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            infra = (
                "sandbox" if run.reason.startswith("sandbox error") else ""
            )  # never the completion's doing
            return Verdict(0.0, f"{why}; {tail[0][:200]}".rstrip("; "), tool_calls=1, infra=infra)
        try:
            report = json.loads(line[len(nonce) + 1 :])
            if "error" in report:
                return Verdict(0.0, str(report["error"])[:300], tool_calls=1)
            results = report["results"]
            if not isinstance(results, list) or len(results) != len(spec["tests"]):
                raise ValueError("wrong number of results")
        except (ValueError, KeyError, TypeError) as e:
            return Verdict(0.0, f"unreadable test report: {e}", tool_calls=1)
        passed, first = 0, None
        for (args, want), out in zip(spec["tests"], results):  # compared here, outside the sandbox
            returned = isinstance(out, list) and len(out) == 2 and out[0] == "ok"
            right = returned and same_value(out[1], want)
            passed += right
            if not right and first is None:
                call = f"{spec['entry']}{tuple(args)!r:.80}"
                first = (
                    f"{call} returned {out[1]!r:.60}, expected {want!r:.60}"
                    if returned
                    else f"{call} {str(out[1] if isinstance(out, list) and len(out) == 2 else out)[:140]}"
                )
        reason = f"passed {passed}/{len(results)}" + (f"; first failure: {first}" if first else "")
        if not run.ok:
            reason += f"; then {run.reason}"
        return Verdict(passed / len(results), reason, tool_calls=1)

    def demonstration(self, spec: dict, style: str = "default") -> str:
        self._check(spec)
        if spec.get("problem") not in PROBLEMS:
            raise SpecError(f"no reference solution for problem {spec.get('problem')!r}")
        return PROBLEMS[spec["problem"]][2]


register("python-tests")(lambda: PythonTestsEnv())
