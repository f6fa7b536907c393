"""Source modules the generated repositories (tier 1) are assembled from: small, plain-Python
utility modules, each with input generators for its functions. Expected test outputs are
computed by running these (trusted) sources; bugs are injected into them by envs/mutations.py."""

from __future__ import annotations


def _ri(rng, lo, hi):
    return rng.randint(lo, hi)


def _ints(rng, lo=-20, hi=20, n_lo=0, n_hi=8):
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _word(rng, alphabet="abcde", lo=1, hi=7):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _sentence(rng):
    return " ".join(_word(rng, "abcdeXYZ") for _ in range(rng.randint(1, 5)))


# module name -> (source, {function: input generator rng -> args list})
MODULES: dict[str, tuple[str, dict]] = {
    "textutil": (
        '''"""Small string helpers."""


def slugify(text):
    words = []
    for word in text.lower().split():
        clean = "".join(c for c in word if c.isalnum())
        if clean:
            words.append(clean)
    return "-".join(words)


def count_words(text, min_len=1):
    n = 0
    for word in text.split():
        if len(word) >= min_len:
            n += 1
    return n


def truncate(text, width):
    if len(text) <= width:
        return text
    if width < 4:
        return text[:width]
    return text[:width - 3] + "..."


def capitalize_words(text):
    return " ".join(w[0].upper() + w[1:] for w in text.split(" ") if w)
''',
        {
            "slugify": lambda r: [_sentence(r)],
            "count_words": lambda r: [_sentence(r), _ri(r, 1, 4)],
            "truncate": lambda r: [_sentence(r), _ri(r, 1, 14)],
            "capitalize_words": lambda r: [_sentence(r)],
        },
    ),
    "mathutil": (
        '''"""Integer helpers."""


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def gcd(a, b):
    while b != 0:
        a, b = b, a % b
    return abs(a)


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def digit_sum(n):
    total = 0
    n = abs(n)
    while n > 0:
        total += n % 10
        n //= 10
    return total
''',
        {
            "clamp": lambda r: [_ri(r, -10, 10), _ri(r, -5, 0), _ri(r, 1, 6)],
            "gcd": lambda r: [_ri(r, 0, 60), _ri(r, 1, 60)],
            "is_prime": lambda r: [_ri(r, -2, 60)],
            "digit_sum": lambda r: [_ri(r, -9999, 99999)],
        },
    ),
    "listutil": (
        '''"""List helpers."""


def chunk(xs, size):
    out = []
    for i in range(0, len(xs), size):
        out.append(xs[i:i + size])
    return out


def dedupe(xs):
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def rotate(xs, k):
    if not xs:
        return []
    k = k % len(xs)
    return xs[k:] + xs[:k]


def running_max(xs):
    out = []
    best = None
    for x in xs:
        if best is None or x > best:
            best = x
        out.append(best)
    return out
''',
        {
            "chunk": lambda r: [_ints(r), _ri(r, 1, 4)],
            "dedupe": lambda r: [_ints(r, 0, 5)],
            "rotate": lambda r: [_ints(r, n_lo=1), _ri(r, 0, 9)],
            "running_max": lambda r: [_ints(r)],
        },
    ),
    "stats": (
        '''"""Integer statistics."""


def total(xs):
    s = 0
    for x in xs:
        s += x
    return s


def median_low(xs):
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


def mode(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = None
    for x in sorted(counts):
        if best is None or counts[x] > counts[best]:
            best = x
    return best


def spread(xs):
    return max(xs) - min(xs)
''',
        {
            "total": lambda r: [_ints(r)],
            "median_low": lambda r: [_ints(r, n_lo=1)],
            "mode": lambda r: [_ints(r, 0, 4, 1, 9)],
            "spread": lambda r: [_ints(r, n_lo=1)],
        },
    ),
    "roman": (
        '''"""Roman numerals."""

VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n):
    out = ""
    for value, sym in VALUES:
        while n >= value:
            out += sym
            n -= value
    return out


def from_roman(s):
    table = {sym: value for value, sym in VALUES if len(sym) == 1}
    total = 0
    for i in range(len(s)):
        v = table[s[i]]
        if i + 1 < len(s) and table[s[i + 1]] > v:
            total -= v
        else:
            total += v
    return total
''',
        {"to_roman": lambda r: [_ri(r, 1, 3999)], "from_roman": lambda r: [_roman(_ri(r, 1, 3999))]},
    ),
    "intervals": (
        '''"""Closed integer intervals as [lo, hi] pairs."""


def overlaps(a, b):
    return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def covered(intervals):
    n = 0
    for lo, hi in merge(intervals):
        n += hi - lo + 1
    return n
''',
        {
            "overlaps": lambda r: [_iv(r), _iv(r)],
            "merge": lambda r: [[_iv(r) for _ in range(_ri(r, 0, 5))]],
            "covered": lambda r: [[_iv(r) for _ in range(_ri(r, 0, 5))]],
        },
    ),
    "grid": (
        '''"""Grids as lists of rows."""


def transpose(rows):
    if not rows:
        return []
    return [[rows[i][j] for i in range(len(rows))] for j in range(len(rows[0]))]


def neighbours(r, c, height, width):
    out = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        rr, cc = r + dr, c + dc
        if 0 <= rr < height and 0 <= cc < width:
            out.append((rr, cc))
    return out


def row_sums(rows):
    return [sum(row) for row in rows]


def diagonal(rows):
    n = min(len(rows), len(rows[0])) if rows else 0
    return [rows[i][i] for i in range(n)]
''',
        {
            "transpose": lambda r: [_grid(r)],
            "neighbours": lambda r: [_ri(r, 0, 4), _ri(r, 0, 4), _ri(r, 1, 5), _ri(r, 1, 5)],
            "row_sums": lambda r: [_grid(r)],
            "diagonal": lambda r: [_grid(r)],
        },
    ),
    "wordfreq": (
        '''"""Word frequencies."""


def frequencies(text):
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n):
    counts = frequencies(text)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [w for w, _ in ranked[:n]]


def longest_word(text):
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best
''',
        {
            "frequencies": lambda r: [_sentence(r) + " " + _sentence(r)],
            "top_words": lambda r: [_sentence(r) + " " + _sentence(r), _ri(r, 1, 3)],
            "longest_word": lambda r: [_sentence(r)],
        },
    ),
}


def _roman(n):
    ns: dict = {}
    exec(MODULES["roman"][0], ns)
    return ns["to_roman"](n)


def _iv(rng):
    lo = rng.randint(-5, 10)
    return [lo, lo + rng.randint(0, 5)]


def _grid(rng):
    h, w = rng.randint(1, 4), rng.randint(1, 4)
    return [[rng.randint(-9, 9) for _ in range(w)] for _ in range(h)]
