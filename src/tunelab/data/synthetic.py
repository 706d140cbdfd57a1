"""Deterministic synthetic datasets whose answers can be checked exactly.

This module owns the built-in generators that the registry (registry.py) names with `generator`.
Every task is a pure function of a seeded `random.Random`, so the same (name, split, num_samples,
seed) gives the same rows on every run and machine. Train/test membership is decided by a sha256
of the task name and problem input, never by the seed, so a test question never appears in any
train split, whatever seeds the two were drawn with.

Problem spaces (about 10% of each is test): reverse ~8.3M, sort ~111k, add 10k, shapes 28561 scenes
(the split of a shapes question is decided by its scene, so no test image layout is ever trained on).

Row formats:
  alpaca      {"instruction", "input", "output"}             reverse, sort, add
  sharegpt    {"conversations": [{"from", "value"}...], "system"}   multiturn
  ranking     {"instruction", "input", "chosen", "rejected"}  preference
  alpaca + images  {"instruction": "<image>question", "input": "", "output", "images": [{"bytes", "path"}]}  shapes
  alpaca, output = hidden tests  {"instruction", "input": "", "output": "assert f(...) == ..."}  code (code_tasks.py,
                                 split by task)
  alpaca      questions to compute (number answers)            tool_math (tool_tasks.py, for grpo with tools)
"""

from __future__ import annotations

import hashlib
import io
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from tunelab.data import code_tasks, tool_tasks
from tunelab.errors import DataError

SPLITS = ("train", "test")
TEST_PERCENT = 10  # share of each task's problem space reserved for the test split
MAX_TRIES_PER_ROW = 1000  # give up (instead of looping forever) when a split's problem space runs out


@dataclass(frozen=True)
class Problem:
    instruction: str
    input: str
    output: str


def _rng(*parts: object) -> random.Random:
    # Seed from sha256 rather than hash(): hash() of str is salted per process.
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def split_of(task: str, problem_input: str) -> str:
    """The split a problem belongs to: stable across seeds, runs and machines."""
    digest = hashlib.sha256(f"{task}\x00{problem_input}".encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT else "train"


# --- tasks: each draws one problem and knows its exact answer ---------------------------------

INSTRUCTIONS = {
    "reverse": "Reverse the letters.",
    "sort": "Sort the numbers from smallest to largest.",
    "add": "Add the two numbers.",
}


def solve_reverse(problem_input: str) -> str:
    return ",".join(reversed(problem_input.split(",")))


def solve_sort(problem_input: str) -> str:
    return " ".join(sorted(problem_input.split(), key=int))


def solve_add(problem_input: str) -> str:
    left, right = problem_input.split(" + ")
    return str(int(left) + int(right))


def _reverse_problem(rng: random.Random) -> Problem:
    # Distinct letters joined by commas: each letter is then the same single token wherever it sits
    # (with spaces the first one would be "q" and the others " q"), and none is ambiguous to copy.
    letters = rng.sample(string.ascii_lowercase, rng.randint(3, 5))
    text = ",".join(letters)
    return Problem(INSTRUCTIONS["reverse"], text, solve_reverse(text))


def _sort_problem(rng: random.Random) -> Problem:
    # The quickstart task: the tiny model learns it fastest (digits are one token each).
    digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(3, 5))]
    text = " ".join(digits)
    return Problem(INSTRUCTIONS["sort"], text, solve_sort(text))


def _add_problem(rng: random.Random) -> Problem:
    text = f"{rng.randint(0, 99)} + {rng.randint(0, 99)}"
    return Problem(INSTRUCTIONS["add"], text, solve_add(text))


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "reverse": _reverse_problem,
    "sort": _sort_problem,
    "add": _add_problem,
}
SOLVERS: dict[str, Callable[[str], str]] = {"reverse": solve_reverse, "sort": solve_sort, "add": solve_add}


def _draw(task: str, split: str, rng: random.Random, seen: set[str]) -> Problem:
    """One problem of `task` in `split` not drawn before (seen holds inputs, updated in place)."""
    for _ in range(MAX_TRIES_PER_ROW):
        problem = TASKS[task](rng)
        if problem.input not in seen and split_of(task, problem.input) == split:
            seen.add(problem.input)
            return problem
    raise DataError(
        f"generator '{task}': ran out of distinct {split} problems after {len(seen)}; ask for fewer num_samples"
    )


# --- generators: one per registered name -------------------------------------------------------


def _alpaca(task: str) -> Callable[[str, int, int], list[dict]]:
    def generate_rows(split: str, num_samples: int, seed: int) -> list[dict]:
        rng, seen = _rng(task, split, seed), set()
        rows = []
        for _ in range(num_samples):
            p = _draw(task, split, rng, seen)
            rows.append({"instruction": p.instruction, "input": p.input, "output": p.output})
        return rows

    return generate_rows


SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer with the result only.",
    "You solve small puzzles exactly.",
)


def _multiturn(split: str, num_samples: int, seed: int) -> list[dict]:
    rng = _rng("multiturn", split, seed)
    seen: dict[str, set[str]] = {task: set() for task in TASKS}
    rows = []
    for _ in range(num_samples):
        turns = []
        for _ in range(rng.randint(2, 3)):
            task = rng.choice(sorted(TASKS))
            p = _draw(task, split, rng, seen[task])
            turns.append({"from": "human", "value": f"{p.instruction}\n{p.input}"})
            turns.append({"from": "gpt", "value": p.output})
        # Always present (possibly varied) so datasets.Dataset.from_list keeps the column.
        rows.append({"conversations": turns, "system": rng.choice(SYSTEM_PROMPTS)})
    return rows


def wrong_answer(task: str, problem_input: str, rng: random.Random) -> str:
    """A plausible but wrong answer: one swapped neighbour pair, or off by one/ten for sums."""
    right = SOLVERS[task](problem_input)
    if task == "add":
        return str(int(right) + rng.choice([d for d in (-10, -1, 1, 10) if int(right) + d >= 0]))
    sep = "," if task == "reverse" else " "
    items = right.split(sep)
    pairs = [i for i in range(len(items) - 1) if items[i] != items[i + 1]]
    if not pairs:  # sorting "3 3 3": no pair to swap, so change the last number instead
        items[-1] = str((int(items[-1]) + 1) % 10)
        return sep.join(items)
    i = rng.choice(pairs)
    items[i], items[i + 1] = items[i + 1], items[i]
    return sep.join(items)


def _preference(split: str, num_samples: int, seed: int) -> list[dict]:
    rng = _rng("preference", split, seed)
    seen: dict[str, set[str]] = {task: set() for task in TASKS}
    rows = []
    for _ in range(num_samples):
        task = rng.choice(sorted(TASKS))
        p = _draw(task, split, rng, seen[task])
        rejected = wrong_answer(task, p.input, rng)
        rows.append({"instruction": p.instruction, "input": p.input, "chosen": p.output, "rejected": rejected})
    return rows


# Generic English-like prose for tokenizer training: no task answers in it.
_NOUNS = (
    "cat dog bird horse fish river garden house window teacher child farmer doctor baker sailor city "
    "road bridge book letter story song storm rain cloud market ship boat train tree flower stone "
    "friend neighbour morning evening winter summer village mountain forest island lamp table chair "
    "door kitchen machine engine clock picture question answer number problem idea plan world"
).split()
_ADJECTIVES = (
    "small large old young quiet loud bright green blue red cold busy happy heavy gentle strange "
    "early late dark warm tall short simple careful clever"
).split()
_VERBS = (
    "sees finds carries builds follows opens closes watches paints moves keeps holds reads writes "
    "answers remembers counts cleans fixes visits"
).split()
_ADVERBS = "slowly quickly often never always carefully again together today sometimes".split()
_PLACES = (
    "near the river|in the garden|on the road|at the market|under the tree|by the window|"
    "across the bridge|behind the house|inside the kitchen|over the mountain"
).split("|")
_NAMES = "Anna Ben Clara David Emma Felix Grace Hugo Iris Jonas".split()


def _sentence(rng: random.Random) -> str:
    pick = rng.choice
    kind = rng.randint(0, 9)
    if kind == 8:  # digits and letters in running text, so a base model has seen them in lists
        digits = " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(2, 6)))
        return f"The code on the {pick(_NOUNS)} was {digits}."
    if kind == 9:
        letters = ",".join(rng.sample(string.ascii_lowercase, rng.randint(2, 6)))
        return f"{pick(_NAMES)} wrote {letters} on the {pick(_NOUNS)}."
    if kind == 0:
        return f"The {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} a {pick(_NOUNS)} {pick(_PLACES)}."
    if kind == 1:
        return f"A {pick(_NOUNS)} {pick(_ADVERBS)} {pick(_VERBS)} the {pick(_ADJECTIVES)} {pick(_NOUNS)}."
    if kind == 2:
        return f"In {rng.randint(1800, 2025)}, {rng.randint(2, 999)} people lived {pick(_PLACES)}."
    if kind == 3:
        return f"Why does the {pick(_NOUNS)} look so {pick(_ADJECTIVES)}? Nobody knows!"
    if kind == 4:
        return f"{pick(_NAMES)} {pick(_VERBS)} the {pick(_NOUNS)} and {pick(_NAMES)} {pick(_VERBS)} it {pick(_ADVERBS)}."
    if kind == 5:
        return f"{pick(_NAMES)} has {rng.randint(2, 20)} {pick(_NOUNS)}s, but the {pick(_NOUNS)} is {pick(_ADJECTIVES)}."
    if kind == 6:
        return f"When it is {pick(_ADJECTIVES)}, the {pick(_NOUNS)} {pick(_VERBS)} the {pick(_NOUNS)} {pick(_PLACES)}."
    return f'"{pick(_ADVERBS).capitalize()}," said the {pick(_NOUNS)}; then it {pick(_VERBS)} the {pick(_NOUNS)}.'


def prose(num_samples: int, seed: int = 0) -> list[str]:
    """Generic documents for training the tokenizer (scripts/build_assets.py); not a registered
    generator: the plain-text corpus for stage pt is corpus.py's `corpus`."""
    rng = _rng("prose", seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(num_samples)]


# --- shapes: coloured shapes on a small canvas, questions a look at the picture answers --------------------

SHAPE_CANVAS = 64  # the embedded tiny LLaVA's image size: no resizing between generator and model
SHAPE_CELLS = 2  # a 2x2 grid; each cell holds at most one shape
SHAPE_KINDS = ("circle", "square", "triangle")
SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
SHAPE_BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class Shape:
    cell: int  # 0..3, row-major
    kind: str
    colour: str


def shapes_scene_key(shapes: tuple[Shape, ...]) -> str:
    """The layout a split is decided by: which shape in which colour sits in which cell."""
    by_cell = {s.cell: f"{s.colour} {s.kind}" for s in shapes}
    return "|".join(by_cell.get(cell, "empty") for cell in range(SHAPE_CELLS**2))


SHAPE_CELL_NAMES = ("top left", "top right", "bottom left", "bottom right")  # cell 0..3, as the asset's captions say


def shapes_answer(shapes: tuple[Shape, ...], question: str) -> str:
    """The exact answer to one of the generator's questions about a scene."""
    if question == "How many shapes are there?":
        return str(len(shapes))
    for cell, name in enumerate(SHAPE_CELL_NAMES):
        if question == f"What colour is the shape in the {name}?":
            colours = [s.colour for s in shapes if s.cell == cell]
            if not colours:
                raise ValueError(f"'{question}' needs a shape in the {name} cell, got none")
            return colours[0]
    raise ValueError(f"not a shapes question: {question!r}")


def draw_shapes(shapes: tuple[Shape, ...], rng: random.Random):
    """A SHAPE_CANVAS-pixel RGB PIL image of the scene; `rng` jitters each shape's size and place in its cell."""
    from PIL import Image, ImageDraw  # lazy: Pillow (0.6 s) only for the image tasks; text runs skip it

    image = Image.new("RGB", (SHAPE_CANVAS, SHAPE_CANVAS), SHAPE_BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell_size = SHAPE_CANVAS // SHAPE_CELLS
    for shape in shapes:
        size = rng.randint(cell_size // 2, cell_size - 6)
        left = (shape.cell % SHAPE_CELLS) * cell_size + rng.randint(2, cell_size - size - 2)
        top = (shape.cell // SHAPE_CELLS) * cell_size + rng.randint(2, cell_size - size - 2)
        box = (left, top, left + size - 1, top + size - 1)
        fill = SHAPE_COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(left + size / 2, top), (left, top + size - 1), (left + size - 1, top + size - 1)], fill=fill)
    return image


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False, compress_level=6)
    return buffer.getvalue()


def _shapes_scene(rng: random.Random) -> tuple[Shape, ...]:
    """A scene of the kind the tiny LLaVA's recipe captions (scripts/build_vision_asset.py): kept as it is so
    the asset rebuilds byte for byte; the questions draw their own, balanced scenes."""
    shapes = []
    for cell in range(SHAPE_CELLS**2):
        if rng.random() < 0.7:  # most cells filled: 2-3 shapes is the common scene
            shapes.append(Shape(cell, rng.choice(SHAPE_KINDS), rng.choice(sorted(SHAPE_COLOURS))))
    return tuple(shapes)


def _balanced_scene_and_question(rng: random.Random) -> tuple[tuple[Shape, ...], str]:
    """A scene and one question whose answers are equally likely: half "How many shapes are there?" (1-4 shapes,
    each count as likely), half "What colour is the shape in the <cell>?" (an occupied cell; colours uniform). So
    answering without looking scores about 25%, and the picture is the only way above it."""
    count = rng.randint(1, SHAPE_CELLS**2)
    cells = sorted(rng.sample(range(SHAPE_CELLS**2), count))
    shapes = tuple(Shape(cell, rng.choice(SHAPE_KINDS), rng.choice(sorted(SHAPE_COLOURS))) for cell in cells)
    if rng.random() < 0.5:
        return shapes, "How many shapes are there?"
    return shapes, f"What colour is the shape in the {SHAPE_CELL_NAMES[rng.choice(cells)]}?"


def _shapes(split: str, num_samples: int, seed: int) -> list[dict]:
    """One question per row about a fresh scene; the image travels as PNG bytes (datasets' Image storage form)."""
    # Layouts repeat (a one-shape scene has 48 layouts): each row's picture still differs by its jitter, and
    # deduplicating layouts would make small counts rare, so the answers would no longer be balanced.
    rng = _rng("shapes", split, seed)
    rows = []
    for _ in range(num_samples):
        for _ in range(MAX_TRIES_PER_ROW):
            shapes, question = _balanced_scene_and_question(rng)
            if split_of("shapes", shapes_scene_key(shapes)) == split:
                break
        else:
            raise DataError(f"generator 'shapes': no {split} scene in {MAX_TRIES_PER_ROW} draws")
        image = draw_shapes(shapes, rng)
        rows.append({
            "instruction": f"<image>{question}",
            "input": "",
            "output": shapes_answer(shapes, question),
            "images": [{"bytes": _png_bytes(image), "path": None}],
        })
    return rows


GENERATORS: dict[str, Callable[..., list[dict]]] = {
    "reverse": _alpaca("reverse"),
    "sort": _alpaca("sort"),
    "add": _alpaca("add"),
    "multiturn": _multiturn,
    "preference": _preference,
    "shapes": _shapes,
    "code": lambda split, num_samples, seed: code_tasks.generate_rows(split, num_samples, seed, split_of),
    "code_composed": lambda split, num_samples, seed: code_tasks.generate_rows(
        split, num_samples, seed, split_of, code_tasks.COMPOSED_FAMILIES),
    "tool_math": lambda split, num_samples, seed: tool_tasks.generate_rows(split, num_samples, seed, split_of),
}


def generate(name: str, split: str, num_samples: int, seed: int = 0) -> list[dict]:
    """`num_samples` rows of generator `name` for `split` ("train" or "test"), reproducibly."""
    if name not in GENERATORS:
        raise DataError(f"unknown synthetic generator '{name}' (available: {', '.join(sorted(GENERATORS))})")
    if split not in SPLITS:
        raise DataError(f"synthetic generator '{name}': split must be 'train' or 'test', got '{split}'")
    if num_samples < 0:
        raise DataError(f"synthetic generator '{name}': num_samples must be >= 0, got {num_samples}")
    return GENERATORS[name](split, num_samples, seed)
