"""`python-funcs`: short Python functions asked in words, many distinct problems. A problem is a
family (what the function does) with its constants ("return how many elements of xs are greater
than 7"): 20 families and their constants give ~5,000 problems, split train/eval by the
problem itself, so the held-out split holds ~1,000 problems the policy never trained on
(python-tests has 14, its split is by test inputs). Scored like python-tests: 8 fresh test inputs
per task, the expected outputs from the family's reference (trusted code, run here), the
completion's code run in the sandbox, reward the fraction it passes."""

from __future__ import annotations

import json

from .arith import randint
from .base import SpecError, TaskSpec, check_split, register, split_of
from .python_tests import PythonTestsEnv, ints, word

# name -> (signature, description, reference, constants(rng) -> dict, inputs(rng, constants) -> args)
# descriptions and references are format strings over the constants
FAMILIES: dict[str, tuple[str, str, str, object, object]] = {
    "scale_shift": (
        "f(x)",
        "returns x times {a} plus {b}",
        "def f(x):\n    return x * {a} + {b}\n",
        lambda r: {"a": randint(r, 2, 9), "b": randint(r, 1, 30)},
        lambda r, k: [randint(r, -100, 100)],
    ),
    "count_above": (
        "count_above(xs)",
        "returns how many elements of the list xs are greater than {a}",
        "def count_above(xs):\n    return sum(1 for x in xs if x > {a})\n",
        lambda r: {"a": randint(r, -40, 40)},
        lambda r, k: [ints(r, randint(r, 0, 8), -30, 30)],
    ),
    "keep_multiples": (
        "keep_multiples(xs)",
        "returns the elements of the list xs that are divisible by {a}, in their order",
        "def keep_multiples(xs):\n    return [x for x in xs if x % {a} == 0]\n",
        lambda r: {"a": randint(r, 2, 25)},
        lambda r, k: [ints(r, randint(r, 0, 8), -40, 40)],
    ),
    "add_each": (
        "add_each(xs)",
        "returns a new list with {a} added to every element of the list xs",
        "def add_each(xs):\n    return [x + {a} for x in xs]\n",
        lambda r: {"a": randint(r, 1, 50)},
        lambda r, k: [ints(r, randint(r, 0, 8))],
    ),
    "clip": (
        "clip(x)",
        "returns x limited to the range from {a} to {b}: {a} if x is smaller, {b} if x is larger",
        "def clip(x):\n    return min(max(x, {a}), {b})\n",
        lambda r: (lambda a: {"a": a, "b": a + randint(r, 1, 40)})(randint(r, -30, 30)),
        lambda r, k: [randint(r, k["a"] - 30, k["b"] + 30)],
    ),
    "repeat_str": (
        "repeat_str(s)",
        "returns the string s repeated {a} times",
        "def repeat_str(s):\n    return s * {a}\n",
        lambda r: {"a": randint(r, 2, 30)},
        lambda r, k: [word(r, "abcxyz", 0, 5)],
    ),
    "first_chars": (
        "first_chars(s)",
        "returns the first {a} characters of the string s (all of s if it is shorter)",
        "def first_chars(s):\n    return s[:{a}]\n",
        lambda r: {"a": randint(r, 1, 20)},
        lambda r, k: [word(r, "abcdefgh", 0, 12)],
    ),
    "divisible": (
        "divisible(n)",
        "returns True if the integer n is divisible by {a}, else False",
        "def divisible(n):\n    return n % {a} == 0\n",
        lambda r: {"a": randint(r, 2, 40)},
        # half the inputs multiples of a: "always False" passes about half, not 12 of 13
        lambda r, k: [randint(r, -20, 20) * k["a"] if randint(r, 0, 1) else randint(r, -200, 200)],
    ),
    "count_char": (
        "count_char(s)",
        "returns how many times the character '{c}' occurs in the string s",
        "def count_char(s):\n    return s.count('{c}')\n",
        lambda r: {"c": "abcdefghijklmnopqrstuvwxyz"[randint(r, 0, 25)]},
        lambda r, k: [word(r, "abcdefgh" + k["c"] * 3, 0, 14)],
    ),
    "replace_char": (
        "replace_char(s)",
        "returns the string s with every '{c}' replaced by '{d}'",
        "def replace_char(s):\n    return s.replace('{c}', '{d}')\n",
        lambda r: (lambda c: {"c": c, "d": "xyz*-"[randint(r, 0, 4)]})(
            "abcdefghijklmnopq"[randint(r, 0, 16)]
        ),
        lambda r, k: [word(r, "abcdef" + k["c"] * 3, 0, 12)],
    ),
    "sum_times": (
        "sum_times(xs)",
        "returns the sum of the elements of the list xs, multiplied by {a}",
        "def sum_times(xs):\n    return sum(xs) * {a}\n",
        lambda r: {"a": randint(r, 2, 30)},
        lambda r, k: [ints(r, randint(r, 0, 8))],
    ),
    "max_plus": (
        "max_plus(xs)",
        "returns the largest element of the list xs plus {a}, or {b} if xs is empty",
        "def max_plus(xs):\n    return max(xs) + {a} if xs else {b}\n",
        lambda r: {"a": randint(r, 1, 20), "b": randint(r, -9, 0)},
        lambda r, k: [ints(r, randint(r, 0, 7))],
    ),
    "last_items": (
        "last_items(xs)",
        "returns the last {a} elements of the list xs (all of xs if it is shorter)",
        "def last_items(xs):\n    return xs[-{a}:]\n",
        lambda r: {"a": randint(r, 1, 12)},
        lambda r, k: [ints(r, randint(r, 0, 9))],
    ),
    "power_mod": (
        "power_mod(n)",
        "returns n to the power {a}, modulo {b}",
        "def power_mod(n):\n    return pow(n, {a}, {b})\n",
        lambda r: {"a": randint(r, 2, 7), "b": randint(r, 3, 60)},
        lambda r, k: [randint(r, 0, 60)],
    ),
    "join_with": (
        "join_with(words)",
        "returns the strings of the list words joined by '{c}'",
        "def join_with(words):\n    return '{c}'.join(words)\n",
        lambda r: {"c": ["-", "+", ",", ";", ":", "/", "|", "_", ", ", " - ", "::", "."][randint(r, 0, 11)]},
        lambda r, k: [[word(r, "abcde", 1, 4) for _ in range(randint(r, 0, 5))]],
    ),
    "between": (
        "between(x)",
        "returns True if x is at least {a} and at most {b}, else False",
        "def between(x):\n    return {a} <= x <= {b}\n",
        lambda r: (lambda a: {"a": a, "b": a + randint(r, 0, 30)})(randint(r, -30, 30)),
        # half the inputs inside: "always False" passes about half
        lambda r, k: [
            randint(r, k["a"], k["b"]) if randint(r, 0, 1) else randint(r, k["a"] - 15, k["b"] + 15)
        ],
    ),
    "pad_left": (
        "pad_left(s)",
        "returns the string s padded on the left with '{c}' to length {a} (s itself if it is not shorter)",
        "def pad_left(s):\n    return s.rjust({a}, '{c}')\n",
        lambda r: {"a": randint(r, 3, 14), "c": "0*.#-_"[randint(r, 0, 5)]},
        lambda r, k: [word(r, "abc", 0, 10)],
    ),
    "min_times": (
        "min_times(xs)",
        "returns the smallest element of the list xs times {a}, or 0 if xs is empty",
        "def min_times(xs):\n    return min(xs) * {a} if xs else 0\n",
        lambda r: {"a": randint(r, 2, 30)},
        lambda r, k: [ints(r, randint(r, 0, 7))],
    ),
    "count_long": (
        "count_long(words)",
        "returns how many strings in the list words are longer than {a} characters",
        "def count_long(words):\n    return sum(1 for w in words if len(w) > {a})\n",
        lambda r: {"a": randint(r, 1, 8)},
        lambda r, k: [[word(r, "abcde", 0, 10) for _ in range(randint(r, 0, 6))]],
    ),
    "digits_times": (
        "digits_times(n)",
        "returns the sum of the decimal digits of the non-negative integer n, times {a}",
        "def digits_times(n):\n    return sum(int(d) for d in str(n)) * {a}\n",
        lambda r: {"a": randint(r, 2, 30)},
        lambda r, k: [randint(r, 0, 10**6)],
    ),
}


class PythonFuncsEnv(PythonTestsEnv):
    def __init__(self, name: str = "python-funcs", **kw):
        super().__init__(name, **kw)

    def make_task(self, family: str, rng, consts: dict | None = None) -> TaskSpec:
        sig, desc, ref, draw, inputs = FAMILIES[family]
        k = draw(rng) if consts is None else consts
        ns: dict = {}
        exec(ref.format(**k), ns)  # trusted reference solution
        entry = sig.split("(")[0]
        tests = []
        for _ in range(self.n_tests):
            args = inputs(rng, k)
            tests.append([args, json.loads(json.dumps(ns[entry](*args)))])
        prompt = f"Write a Python function {sig} that {desc.format(**k)}. Reply with the code only."
        problem = f"{family} {json.dumps(k, sort_keys=True)}"
        return TaskSpec(prompt=prompt, spec={"problem": problem, "entry": entry, "tests": tests})

    def sample(self, rng, split: str = "train") -> TaskSpec:
        check_split(split)
        names = sorted(FAMILIES)
        for _ in range(10_000):
            family = names[randint(rng, 0, len(names) - 1)]
            consts = FAMILIES[family][3](rng)
            key = f"{family} {json.dumps(consts, sort_keys=True)}"
            if split_of(key, self.eval_fraction) == split:  # by problem: eval problems are never trained on
                return self.make_task(family, rng, consts)
        raise RuntimeError(f"{self.name}: could not draw a {split} task")

    def demonstration(self, spec: dict, style: str = "default") -> str:
        self._check(spec)
        family, _, consts = str(spec.get("problem", "")).partition(" ")
        if family not in FAMILIES:
            raise SpecError(f"no reference solution for problem {spec.get('problem')!r}")
        try:
            return FAMILIES[family][2].format(**json.loads(consts))
        except (ValueError, KeyError, TypeError) as e:
            raise SpecError(f"problem {spec.get('problem')!r}: unreadable constants ({e})") from e


register("python-funcs")(lambda: PythonFuncsEnv())
