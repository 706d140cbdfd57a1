"""A built-in plain-text corpus for pretraining the tiny model (stage pt): `"generator": "corpus"`.

This module owns the `corpus` generator that dataset_files.py runs beside synthetic.py's task
generators. Rows are `{"text": document}`; a document is a few English-like sentences about the
synthetic tasks (reversing letters, sorting and adding numbers), drawn from a small grammar so the
tiny model's loss falls within a few steps. Deterministic: the same (split, num_samples, seed)
gives the same documents on every run and machine; train and test draw from different streams.

    {"text": "To reverse c,a,t write t,a,c. Adding 12 and 30 gives 42. The model checks the answer."}
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Callable

from tunelab.errors import DataError

SPLITS = ("train", "test")
SENTENCES_PER_DOCUMENT = (2, 6)

_SUBJECTS = ("The model", "A student", "The teacher", "The program", "Everyone")
_VERBS = ("checks", "writes", "reads", "learns", "repeats")
_OBJECTS = ("the answer", "the numbers", "the letters", "the question", "each step")
_ENDINGS = ("carefully", "again", "slowly", "at once", "one by one")


def _rng(split: str, seed: int) -> random.Random:
    # sha256 rather than hash(): str hashes are salted per process.
    digest = hashlib.sha256(f"corpus:{split}:{seed}".encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _reverse(rng: random.Random) -> str:
    letters = rng.sample(string.ascii_lowercase, rng.randint(3, 5))
    return f"To reverse {','.join(letters)} write {','.join(reversed(letters))}."


def _add(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"Adding {a} and {b} gives {a + b}."


def _sort(rng: random.Random) -> str:
    numbers = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    given, ordered = " ".join(map(str, numbers)), " ".join(map(str, sorted(numbers)))
    return f"Sorted from smallest to largest, {given} becomes {ordered}."


def _plain(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."


_SENTENCES: tuple[Callable[[random.Random], str], ...] = (_reverse, _add, _sort, _plain)


def _corpus(split: str, num_samples: int, seed: int) -> list[dict]:
    rng = _rng(split, seed)
    low, high = SENTENCES_PER_DOCUMENT
    return [
        {"text": " ".join(rng.choice(_SENTENCES)(rng) for _ in range(rng.randint(low, high)))}
        for _ in range(num_samples)
    ]


GENERATORS: dict[str, Callable[[str, int, int], list[dict]]] = {"corpus": _corpus}


def generate(name: str, split: str, num_samples: int, seed: int = 0) -> list[dict]:
    """`num_samples` documents of generator `name` for `split`."""
    if name not in GENERATORS:
        raise DataError(f"unknown corpus generator '{name}' (available: {', '.join(sorted(GENERATORS))})")
    if split not in SPLITS:
        raise DataError(f"corpus generator '{name}': split must be one of {', '.join(SPLITS)}, got '{split}'")
    return GENERATORS[name](split, num_samples, seed)
