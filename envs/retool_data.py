"""The synthetic ReTool problem set: math questions where running code beats guessing.

Each family draws its numbers from a seeded RNG and computes the exact integer answer in Python,
so every row is verified by construction. The numbers are chosen so that a small model cannot
guess or recall the answer (large products, prime counts, modular powers, digit sums of big
powers) but a few lines of Python solve it. `make_retool_rows(split, n)` is deterministic: the
train and test splits draw from disjoint seed streams and never share a question, and the files
shipped in `envs/data/` are exactly what it returns (a test checks this). Rows use verl's format.

To regenerate or grow the shipped files: `python -m agentrl.envs.retool_data --train 1000 --test 200`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "FAMILIES", "SYSTEM_PROMPT", "make_retool_rows", "shipped_path", "write_split"]

DATA_DIR = Path(__file__).resolve().parent / "data"
DATA_SOURCE = "agentrl/retool-synth"

SYSTEM_PROMPT = (
    "You are a careful assistant that solves math problems by writing Python code. "
    "Call the python tool to run code and print results; then give the final answer as \\boxed{NUMBER}."
)


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


Problem = tuple[str, int]


def _product(r: random.Random) -> Problem:
    a, b, c = r.randint(1000, 9999), r.randint(100, 999), r.randint(1000, 9999)
    return f"What is {a} * {b} - {c}?", a * b - c


def _sum_squares(r: random.Random) -> Problem:
    n = r.randint(100, 999)
    return f"What is the sum of the squares of the integers from 1 to {n}?", n * (n + 1) * (2 * n + 1) // 6


def _powmod(r: random.Random) -> Problem:
    a, b, m = r.randint(2, 99), r.randint(100, 9999), r.randint(1000, 99999)
    return f"What is the remainder when {a}^{b} is divided by {m}?", pow(a, b, m)


def _primes(r: random.Random) -> Problem:
    n = r.randint(1000, 30000)
    return f"How many prime numbers are less than {n}?", _primes_below(n)


def _digit_sum(r: random.Random) -> Problem:
    k = r.randint(50, 3000)
    return f"What is the sum of the digits of 2^{k}?", sum(map(int, str(2**k)))


def _comb(r: random.Random) -> Problem:
    n = r.randint(20, 150)
    k = r.randint(3, n // 2)
    return f"In how many ways can {k} items be chosen from {n} distinct items?", math.comb(n, k)


def _gcd(r: random.Random) -> Problem:
    g = r.randint(11, 999)
    a, b = g * r.randint(100, 9999), g * r.randint(100, 9999)
    return f"What is the greatest common divisor of {a} and {b}?", math.gcd(a, b)


def _multiples(r: random.Random) -> Problem:
    a, b = r.sample([3, 4, 5, 6, 7, 11, 13], 2)
    n = r.randint(1000, 100000)
    total = sum(i for i in range(n) if i % a == 0 or i % b == 0)
    return f"What is the sum of all positive integers less than {n} that are divisible by {a} or {b}?", total


def _fibonacci(r: random.Random) -> Problem:
    n = r.randint(40, 500)
    return f"With F(1) = F(2) = 1 and F(n) = F(n-1) + F(n-2), what is F({n})?", _fib(n)


def _collatz(r: random.Random) -> Problem:
    n = r.randint(1000, 999999)
    return (f"Starting from {n} and repeatedly halving even numbers and mapping odd n to 3n + 1, "
            f"how many steps does it take to reach 1?"), _collatz_steps(n)


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "product": _product,
    "sum_squares": _sum_squares,
    "powmod": _powmod,
    "primes": _primes,
    "digit_sum": _digit_sum,
    "comb": _comb,
    "gcd": _gcd,
    "multiples": _multiples,
    "fibonacci": _fibonacci,
    "collatz": _collatz,
}
_SPLIT_SEED = {"train": 1_000_003, "test": 2_000_003}
_TEST_GUARD = 1000  # train questions never collide with the first this-many test questions


def make_retool_rows(split: str, n: int) -> list[dict[str, Any]]:
    """`n` verl-format rows of `split` ("train" or "test"), cycling through the families."""
    if split not in _SPLIT_SEED:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    # Train draws skip every question of the test split (up to its shipped size and beyond),
    # so no held-out question is ever trained on.
    taken = set() if split == "test" else {r["extra_info"]["question"] for r in _draw("test", _TEST_GUARD)}
    return _draw(split, n, exclude=taken)


def _draw(split: str, n: int, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(_SPLIT_SEED[split])
    names = list(FAMILIES)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set(exclude or ())
    misses = 0
    while len(rows) < n:
        family = names[len(rows) % len(names)]
        question, answer = FAMILIES[family](rng)
        if question in seen:
            misses += 1
            if misses > 100 * (n + 10):  # a family ran out of distinct questions: widen its ranges
                raise ValueError(f"family '{family}' cannot produce {n // len(names) + 1} distinct questions")
            continue
        seen.add(question)
        rows.append({
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": len(rows), "family": family, "question": question},
        })
    return rows


def shipped_path(split: str) -> Path:
    return DATA_DIR / f"retool_{split}.jsonl"


def write_split(split: str, n: int, path: Path | None = None) -> Path:
    path = path or shipped_path(split)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in make_retool_rows(split, n):
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the shipped ReTool train/test splits.")
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--test", type=int, default=200)
    args = parser.parse_args()
    for split, n in (("train", args.train), ("test", args.test)):
        print(write_split(split, n))  # noqa: T201 (a command-line entry point)


if __name__ == "__main__":
    main()
