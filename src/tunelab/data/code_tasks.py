"""Small Python function tasks with hidden tests, for GRPO with executed rewards (reward_funcs: code_tests).

This module owns the `code` generator that synthetic.py's GENERATORS names. A task is a family with its
parameters ("the sum of the numbers in xs that are divisible by 3"); a row asks for the task's function and
carries, as its answer, hidden tests: assert statements on random inputs, whose expected values come from
the family's reference solution and are never shown in the prompt (the prompt is a function of the task
alone: every row of a task has the same prompt).

    instruction: Write a Python function `sum_divisible(xs)` that returns the sum of the numbers in the
                 list xs that are divisible by 3. Reply with the function in one ```python block.
    output:      assert sum_divisible([4, -9, 12]) == 3
                 assert sum_divisible([]) == 0
                 ...

`code_composed` (COMPOSED_FAMILIES) asks for three steps in one function: keep some numbers, change each, combine
them ("keeps the numbers of the list xs that are less than 2, subtracts 4 from each of them and returns how many
of them are even"), each step one of three or four with its parameter: harder, for a model that solves `code`.

The held-out split is by task, not by row: synthetic.split_of decides each task's split from its family and
parameters, so a test task (divisible by 7, say) never appears in the train split with any inputs; its family
does, with other parameters. The answer is a test program, not a solution: these rows are for code_tests, not
for sft.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunelab.errors import DataError

TESTS_PER_ROW = 5
MAX_TRIES_PER_ROW = 1000


@dataclass(frozen=True)
class Family:
    name: str  # the function's name
    args: str  # its parameters as written in the prompt
    describe: Callable[..., str]  # params → what the function returns
    params: Callable[[random.Random], tuple]  # a random parameter tuple
    make_input: Callable[[random.Random], tuple]  # a random argument tuple
    solve: Callable[..., Any]  # (params, *args) → the expected value
    lead: str = "returns "  # the prompt's verb before the description ("" when the description has its own)


def _ints(rng: random.Random, low: int = -20, high: int = 20) -> tuple[list[int]]:
    return ([rng.randint(low, high) for _ in range(rng.randint(0, 8))],)


def _text(rng: random.Random) -> tuple[str]:
    letters = string.ascii_lowercase[:8] + "  "  # few letters, so a parameter letter often occurs
    return ("".join(rng.choice(letters) for _ in range(rng.randint(0, 16))).strip(),)


def _sentence(rng: random.Random) -> tuple[str]:
    words = ["a", "to", "cat", "sun", "tree", "apple", "stone", "garden", "river", "blue", "window", "go"]
    return (" ".join(rng.choice(words) for _ in range(rng.randint(0, 7))),)


def _rotate(k: int, xs: list[int]) -> list[int]:
    if not xs:
        return []
    k %= len(xs)
    return xs[k:] + xs[:k]


def _shift(k: int, s: str) -> str:
    return "".join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)


FAMILIES: tuple[Family, ...] = (
    Family("sum_divisible", "xs", lambda k: f"the sum of the numbers in the list xs that are divisible by {k}",
           lambda r: (r.randint(2, 9),), _ints, lambda k, xs: sum(x for x in xs if x % k == 0)),
    Family("count_greater", "xs", lambda t: f"how many numbers in the list xs are greater than {t}",
           lambda r: (r.randint(-10, 20),), _ints, lambda t, xs: sum(x > t for x in xs)),
    Family("count_letter", "s", lambda c: f"how many times the letter '{c}' occurs in the string s",
           lambda r: (r.choice(string.ascii_lowercase[:8]),), _text, lambda c, s: s.count(c)),
    Family("remove_letter", "s", lambda c: f"the string s with every '{c}' removed",
           lambda r: (r.choice(string.ascii_lowercase[:8]),), _text, lambda c, s: s.replace(c, "")),
    Family("scale_all", "xs", lambda k: f"a new list with every number of the list xs multiplied by {k}",
           lambda r: (r.randint(2, 12),), _ints, lambda k, xs: [x * k for x in xs]),
    Family("add_to_all", "xs", lambda k: f"a new list with {k} added to every number of the list xs",
           lambda r: (r.randint(1, 20),), _ints, lambda k, xs: [x + k for x in xs]),
    Family("sum_of_powers", "xs", lambda p: f"the sum of the numbers in the list xs each raised to the power {p}",
           lambda r: (r.randint(2, 4),), _ints, lambda p, xs: sum(x**p for x in xs)),
    Family("clamp_all", "xs",
           lambda lo, hi: f"a new list with every number of the list xs clamped to the range {lo} to {hi} (numbers "
                          f"below {lo} become {lo}, numbers above {hi} become {hi})",
           lambda r: (r.randint(-6, 0), r.randint(1, 10)), _ints,
           lambda lo, hi, xs: [min(max(x, lo), hi) for x in xs]),
    Family("join_copies", "s",
           lambda k, sep: f"the string s repeated {k} times, the copies separated by {sep!r}",
           lambda r: (r.randint(2, 5), r.choice(["-", ",", " ", "+", "/"])), _text,
           lambda k, sep, s: sep.join([s] * k)),
    Family("long_words", "s",
           lambda n: f"the list of the words of the string s (split at spaces) that have more than {n} letters, "
                     "in their order",
           lambda r: (r.randint(2, 5),), _sentence, lambda n, s: [w for w in s.split() if len(w) > n]),
    Family("every_kth", "xs",
           lambda k: f"every {k}th element of the list xs as a list, starting with the first: xs[0], xs[{k}], "
                     f"xs[{2 * k}] and so on",
           lambda r: (r.randint(2, 5),), _ints, lambda k, xs: xs[::k]),
    Family("rotate_left", "xs",
           lambda k: f"the list xs rotated left by {k} positions (its first element moves to the end, {k} times); "
                     "an empty list stays empty",
           lambda r: (r.randint(1, 8),), _ints, _rotate),
    Family("first_above", "xs",
           lambda t: f"the index of the first number in the list xs that is greater than {t}, or -1 if there is none",
           lambda r: (r.randint(0, 20),), _ints, lambda t, xs: next((i for i, x in enumerate(xs) if x > t), -1)),
    Family("shift_letters", "s",
           lambda k: f"the string s with each lowercase letter moved {k} places forward in the alphabet, wrapping "
                     "around from z to a, and every other character unchanged",
           lambda r: (r.randint(1, 25),), _text, _shift),
)


# Harder tasks (generator `code_composed`): keep some numbers, change each, combine them. Three choices of three
# or four, each with its parameter: the model must follow every clause of the prompt.
_KEEP = (("that are divisible by {}", lambda k, x: x % k == 0, (2, 5)),
         ("that are greater than {}", lambda t, x: x > t, (-5, 5)),
         ("that are less than {}", lambda t, x: x < t, (-5, 5)))
_CHANGE = (("multiplies each of them by {}", lambda m, x: x * m, (2, 5)),
           ("adds {} to each of them", lambda a, x: x + a, (1, 9)),
           ("subtracts {} from each of them", lambda a, x: x - a, (1, 9)))
_COMBINE = (("returns their sum", lambda _, ys: sum(ys), (0, 0)),
            ("returns how many of them are even", lambda _, ys: sum(y % 2 == 0 for y in ys), (0, 0)),
            ("returns the largest of them, or {} if there are none", lambda d, ys: max(ys, default=d), (-9, -1)),
            ("returns the sum of their absolute values modulo {}", lambda p, ys: sum(abs(y) for y in ys) % p, (7, 13)))


def _composed_params(rng: random.Random) -> tuple:
    picks = (rng.randrange(len(_KEEP)), rng.randrange(len(_CHANGE)), rng.randrange(len(_COMBINE)))
    steps = (_KEEP[picks[0]], _CHANGE[picks[1]], _COMBINE[picks[2]])
    return tuple(x for pick, (_, _, (low, high)) in zip(picks, steps) for x in (pick, rng.randint(low, high)))


def _composed_text(keep: int, k: int, change: int, c: int, combine: int, r: int) -> str:
    return (f"keeps the numbers of the list xs {_KEEP[keep][0].format(k)}, {_CHANGE[change][0].format(c)} and "
            f"{_COMBINE[combine][0].format(r)}")


def _composed_solve(keep: int, k: int, change: int, c: int, combine: int, r: int, xs: list[int]):
    changed = [_CHANGE[change][1](c, x) for x in xs if _KEEP[keep][1](k, x)]
    return _COMBINE[combine][1](r, changed)


COMPOSED_FAMILIES: tuple[Family, ...] = (
    Family("keep_change_combine", "xs", _composed_text, _composed_params, _ints, _composed_solve, lead=""),
)


def task_key(family: Family, params: tuple) -> str:
    return f"{family.name}{params}"


def prompt_of(family: Family, params: tuple) -> str:
    return (f"Write a Python function `{family.name}({family.args})` that {family.lead}{family.describe(*params)}. "
            "Reply with the function in one ```python block.")


def hidden_tests(family: Family, params: tuple, rng: random.Random, count: int = TESTS_PER_ROW) -> str:
    lines = []
    for _ in range(count):
        args = family.make_input(rng)
        call = f"{family.name}({', '.join(repr(a) for a in args)})"
        lines.append(f"assert {call} == {family.solve(*params, *args)!r}")
    return "\n".join(lines)


def generate_rows(split: str, num_samples: int, seed: int, split_of: Callable[[str, str], str],
                  families: tuple[Family, ...] = FAMILIES) -> list[dict]:
    """`num_samples` alpaca rows of tasks in `split` (split_of(task, key): synthetic.py's rule)."""
    rng = random.Random(f"code:{split}:{seed}:{families[0].name}")
    rows = []
    for _ in range(num_samples):
        for _ in range(MAX_TRIES_PER_ROW):
            family = rng.choice(families)
            params = family.params(rng)
            if split_of("code", task_key(family, params)) == split:
                break
        else:
            raise DataError(f"synthetic generator 'code': no {split} task found in {MAX_TRIES_PER_ROW} draws")
        tests = hidden_tests(family, params, rng)
        rows.append({"instruction": prompt_of(family, params), "input": "", "output": tests})
    return rows
