"""Questions where computing beats guessing, for GRPO with tools (tools: python): exact answers that a small model
cannot work out in its head but a line of Python can.

This module owns the `tool_math` generator that synthetic.py's GENERATORS names. Four families:

    multiply      What is 48213 * 9037?                                              → 435700881
    sum_many      What is the sum of these numbers: 5127, 88213, 907, 31050, ...?    → 203918
    count_letter  How many times does the letter 'k' occur in this string: "kqkkzq…"? → 37
    power_mod     What is the remainder of 7 ** 213 divided by 1000?                 → 743

Each instruction ends with INSTRUCTION_TAIL (use the tool, then reply with the number alone), and the answer is the
number as text, so exact_match scores the final answer. A problem's split is decided by synthetic.split_of from
its family and its text: a held-out question never appears in the train split, with any seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from tunelab.errors import DataError

MAX_TRIES_PER_ROW = 1000
INSTRUCTION_TAIL = " Compute it with the python tool, then reply with the number alone."


def _multiply(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10_000, 999_999), rng.randint(1_000, 99_999)
    return f"What is {a} * {b}?", a * b


def _sum_many(rng: random.Random) -> tuple[str, int]:
    numbers = [rng.randint(100, 99_999) for _ in range(rng.randint(8, 14))]
    return f"What is the sum of these numbers: {', '.join(map(str, numbers))}?", sum(numbers)


def _count_letter(rng: random.Random) -> tuple[str, int]:
    letters = rng.sample(string.ascii_lowercase, 4)  # few letters: the asked one occurs often
    text = "".join(rng.choice(letters) for _ in range(rng.randint(60, 160)))
    letter = rng.choice(letters)
    return f"How many times does the letter '{letter}' occur in this string: \"{text}\"?", text.count(letter)


def _power_mod(rng: random.Random) -> tuple[str, int]:
    base, exponent, modulus = rng.randint(3, 97), rng.randint(50, 999), rng.choice([97, 1000, 1009, 9973, 10_000])
    return f"What is the remainder of {base} ** {exponent} divided by {modulus}?", pow(base, exponent, modulus)


FAMILIES: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "multiply": _multiply, "sum_many": _sum_many, "count_letter": _count_letter, "power_mod": _power_mod,
}


def generate_rows(split: str, num_samples: int, seed: int, split_of: Callable[[str, str], str]) -> list[dict]:
    """`num_samples` alpaca rows of questions in `split` (split_of(family, question): synthetic.py's rule)."""
    rng = random.Random(f"tool_math:{split}:{seed}")
    rows = []
    for _ in range(num_samples):
        for _ in range(MAX_TRIES_PER_ROW):
            family = rng.choice(sorted(FAMILIES))
            question, answer = FAMILIES[family](rng)
            if split_of(f"tool_math/{family}", question) == split:
                break
        else:
            raise DataError(f"synthetic generator 'tool_math': no {split} question found in {MAX_TRIES_PER_ROW} draws")
        rows.append({"instruction": question + INSTRUCTION_TAIL, "input": "", "output": str(answer)})
    return rows
