"""Multi-digit addition where writing the intermediate steps buys accuracy.

Prompt ``"123+4567="``. The policy answers in one of three styles:

    direct  ``#4690``                                       (5-6 tokens)
    steps   ``3+7+0=10 2+6+1=09 1+5+0=06 0+4+0=04 #4690``   (9 tokens per column + answer)
    padded  the steps method on operands zero-padded to a fixed width (max_digits + 2 columns),
            answer written at that width: ``... 0+0+0=00 0+0+0=00 #004690``

A steps column is ``a+b+carry_in=two-digit sum``, least significant first, so each digit of the
answer is a local, one-column computation that a ~1M-parameter char model learns quickly; the
direct style must carry through all columns in one go and stays far less accurate. That gap is
the test-time scaling curve: more generated tokens, more problems solved. The padded style is
the slack a cost penalty should remove: as accurate as steps, about twice the tokens on short
problems (the way a verbose model pads a correct answer). Only the final answer (after the last
``#``) is verified; leading zeros are fine.

Length distribution (completion tokens of the steps style, eos excluded):
  ``arith``       operands of 2..4 digits (uniform, each): 21..42 tokens, median 41;
                  direct style 3..6 tokens.
  ``arith-small`` operands of 1..2 digits (the demo): steps 11..21 tokens, padded 39..41.
  ``arith-long``  operand digits 1..12, P(d) ∝ 0.6^(d-1) (long tail): 11..121 tokens,
                  median 31, p99 ~101.
  ``arith-tail``  arith-long's body (1..14 digits, P(d) ∝ 0.6^(d-1)) plus 3 % of operands of
                  15..19 digits, so ~5 % of problems need 150..191 tokens: median 31, p95 151,
                  p99 191; the longest of 32 problems averages ~163 tokens (arith-long: ~92).
                  For the async benchmark, where a few long generations must not stall the
                  short ones (coding RL is like this: most answers short, a few run very long).
The eval split holds the operand pairs whose hash falls in `eval_fraction`: disjoint from train.
"""

from __future__ import annotations

import hashlib
import re

from .base import SpecError, TaskSpec, Verdict, check_split, register, split_of

ANSWER = re.compile(r"#\s*(\d{1,64})\s*$")
STYLES = ("direct", "steps", "padded", "mixed", "default")


def randint(rng, lo: int, hi: int) -> int:
    """Inclusive integer from a numpy Generator or a random.Random."""
    if hasattr(rng, "integers"):
        return int(rng.integers(lo, hi + 1))
    return rng.randint(lo, hi)


def steps_text(a: int, b: int, width: int = 0) -> str:
    """The steps-style completion for a+b; with `width`, columns continue over leading zeros up
    to `width` columns and the answer is written zero-padded to that many digits."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, cols = 0, []
    for i in range(max(len(da), len(db), width)):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        cols.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return " ".join(cols) + (f" #{a + b:0{width}d}" if width else f" #{a + b}")


class ArithEnv:
    def __init__(
        self,
        name: str = "arith",
        min_digits: int = 2,
        max_digits: int = 4,
        tail: float | None = None,
        eval_fraction: float = 0.1,
        far: tuple[int, float] | None = None,
    ):
        self.name, self.min_digits, self.max_digits = name, min_digits, max_digits
        self.tail, self.eval_fraction = tail, eval_fraction
        # digit-count weights: uniform, or geometric (long-tailed) when `tail` is given; with
        # far = (d, mass) the counts d..max_digits share `mass` evenly (rare, very long problems)
        ks = range(min_digits, max_digits + 1)
        w = [1.0 if tail is None else tail ** (k - min_digits) for k in ks]
        if far is not None:
            d, mass = far
            if not (min_digits < d <= max_digits and 0 < mass < 1):
                raise ValueError(
                    f"far=(digits, mass) needs {min_digits} < digits <= {max_digits} and 0 < mass < 1"
                )
            body = sum(x for k, x in zip(ks, w) if k < d)
            w = [x * (1 - mass) / body if k < d else mass / (max_digits - d + 1) for k, x in zip(ks, w)]
        self._cum = [sum(w[: i + 1]) / sum(w) for i in range(len(w))]

    def _digits(self, rng) -> int:
        u = randint(rng, 0, 1 << 30) / (1 << 30)
        return self.min_digits + next(i for i, c in enumerate(self._cum) if u <= c)

    def _operand(self, rng) -> int:
        d = self._digits(rng)
        return randint(rng, 10 ** (d - 1) if d > 1 else 0, 10**d - 1)

    def sample(self, rng, split: str = "train") -> TaskSpec:
        check_split(split)
        for _ in range(10_000):  # rejection keeps the splits disjoint by operand pair
            a, b = self._operand(rng), self._operand(rng)
            if split_of(f"{a}+{b}", self.eval_fraction) == split:
                return TaskSpec(prompt=f"{a}+{b}=", spec={"a": a, "b": b, "answer": str(a + b)})
        raise RuntimeError(f"{self.name}: could not draw a {split} problem")  # only if eval_fraction ~ 0 or 1

    @staticmethod
    def _answer(spec: dict) -> str:
        ans = spec.get("answer") if isinstance(spec, dict) else None
        if not isinstance(ans, (str, int)) or not str(ans).isdigit():
            raise SpecError(f"arith spec needs a non-negative integer 'answer', got {spec!r:.200}")
        return str(int(ans))

    def verify(self, text: str, spec: dict) -> Verdict:
        want = self._answer(spec)
        if not isinstance(text, str):
            return Verdict(0.0, f"completion is a {type(text).__name__}, not text")
        m = ANSWER.search(text)
        if m is None:
            tail = text[-24:].replace("\n", "\\n")
            return Verdict(0.0, f"no final answer '#<digits>' at the end (ends with {tail!r})")
        got = str(int(m.group(1)))
        if got == want:
            return Verdict(1.0, "correct")
        return Verdict(0.0, f"wrong answer {got} != {want}")

    def demonstration(self, spec: dict, style: str = "default") -> str:
        """A correct answer in `style`. Mixtures pick the style by a hash of the problem, so the
        warm-started policy holds several ways to answer and RL (and the cost penalty) chooses:
        mixed = half direct / half steps; default = a third each of direct, steps, padded."""
        want = self._answer(spec)
        if style in ("default", "mixed"):
            styles = ("direct", "steps") if style == "mixed" else ("direct", "steps", "padded")
            h = hashlib.blake2b(f"style:{want}:{spec.get('a')}".encode(), digest_size=8).digest()
            style = styles[int.from_bytes(h, "little") % len(styles)]
        if style == "direct":
            return f"#{want}"
        if style in ("steps", "padded"):
            a, b = spec.get("a"), spec.get("b")
            if not isinstance(a, int) or not isinstance(b, int) or a + b != int(want):
                raise SpecError(f"arith spec needs int 'a','b' summing to 'answer', got {spec!r:.200}")
            return steps_text(a, b, self.max_digits + 2 if style == "padded" else 0)
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")


class ChatArithEnv(ArithEnv):
    """The same problems asked in words, for an instruct model answering in its own chat style
    ("3 + 4 = 7", "The answer is 7."): the answer is the last integer of the reply (thousands
    separators allowed), so no answer format has to be learnt first."""

    def sample(self, rng, split: str = "train") -> TaskSpec:
        t = super().sample(rng, split)
        a, b = t.spec["a"], t.spec["b"]
        return TaskSpec(prompt=f"What is {a} + {b}? Answer with the number.", spec=t.spec)

    def verify(self, text: str, spec: dict) -> Verdict:
        want = self._answer(spec)
        if not isinstance(text, str):
            return Verdict(0.0, f"completion is a {type(text).__name__}, not text")
        nums = CHAT_NUMBER.findall(text)
        if not nums:
            tail = text[-24:].replace("\n", "\\n")
            return Verdict(0.0, f"no number in the reply (ends with {tail!r})")
        got = nums[-1].replace(",", "")
        if got.startswith("-"):
            return Verdict(0.0, f"wrong answer {got} != {want}")
        if str(int(got)) == want:
            return Verdict(1.0, "correct")
        return Verdict(0.0, f"wrong answer {int(got)} != {want}")

    def demonstration(self, spec: dict, style: str = "default") -> str:
        want = self._answer(spec)
        return f"{spec.get('a')} + {spec.get('b')} = {want}"


# an integer not glued to letters or other digits: "= 1,234." -> "1,234"; "x2" / "3.5" are not answers
CHAT_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?![\w,]\d)|(?<![\w.])-?\d{1,64}(?![\w]|\.\d)")


# arithmetic only compares numbers: it runs no code (no sandbox needed)
register("arith", runs_code=False)(lambda: ArithEnv("arith", 2, 4))
register("arith-long", runs_code=False)(lambda: ArithEnv("arith-long", 1, 12, tail=0.6))
# operands stay below 2**64: task specs travel as msgpack ints
register("arith-tail", runs_code=False)(lambda: ArithEnv("arith-tail", 1, 19, tail=0.6, far=(15, 0.03)))
# the demo's env: 1–2 digit operands, which a ~1M-param char model learns (steps style) in a
# ~1-minute warm start, leaving RL visible room: direct answers mostly wrong, steps mostly right
register("arith-small", runs_code=False)(lambda: ArithEnv("arith-small", 1, 2))
# for instruct models through their chat template (deploy/smollm2.toml): one-digit sums in words,
# which SmolLM2-135M-Instruct (4-bit) gets right about a third of the time at temperature 0.7
register("arith-chat", runs_code=False)(lambda: ChatArithEnv("arith-chat", 1, 1))
# harder chat tasks: operands of 1-2 digits (deploy/learn-smollm2-harder.toml; SmolLM2 starts at
# ~20 %), and two-digit sums only (~3 % right: too few groups with a success to learn from at 4 x 4)
register("arith-chat-12", runs_code=False)(lambda: ChatArithEnv("arith-chat-12", 1, 2))
register("arith-chat-2", runs_code=False)(lambda: ChatArithEnv("arith-chat-2", 2, 2))
