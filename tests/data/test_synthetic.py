"""Exact properties of the synthetic generators: reproducible, disjoint splits, correct answers."""

from __future__ import annotations

import re

import pytest

from tunelab.data import synthetic
from tunelab.errors import DataError

ALPACA_TASKS = ("reverse", "sort", "add")


def _questions(name: str, rows: list[dict]) -> set[str]:
    """Every problem input a generator's rows ask about, tagged with its task's instruction."""
    if name == "multiturn":
        return {turn["value"] for row in rows for turn in row["conversations"] if turn["from"] == "human"}
    return {f"{row['instruction']}\n{row['input']}" for row in rows}


def _task_of(instruction: str) -> str:
    matches = [task for task, text in synthetic.INSTRUCTIONS.items() if text == instruction]
    assert len(matches) == 1, instruction
    return matches[0]


@pytest.mark.parametrize("name", sorted(synthetic.GENERATORS))
@pytest.mark.parametrize("split", synthetic.SPLITS)
def test_same_call_gives_same_rows_and_count(name: str, split: str) -> None:
    first = synthetic.generate(name, split, 50, seed=3)
    assert first == synthetic.generate(name, split, 50, seed=3)
    assert len(first) == 50
    assert synthetic.generate(name, split, 0) == []


@pytest.mark.parametrize("name", sorted(synthetic.GENERATORS))
def test_seed_changes_rows(name: str) -> None:
    assert synthetic.generate(name, "train", 20, seed=0) != synthetic.generate(name, "train", 20, seed=1)


@pytest.mark.parametrize("name", ["reverse", "sort", "add", "multiturn", "preference"])
def test_test_split_is_disjoint_from_train_whatever_the_seeds(name: str) -> None:
    train = _questions(name, synthetic.generate(name, "train", 2000, seed=0))
    train |= _questions(name, synthetic.generate(name, "train", 2000, seed=7))
    test = _questions(name, synthetic.generate(name, "test", 200, seed=0))
    test |= _questions(name, synthetic.generate(name, "test", 200, seed=5))
    assert train and test
    assert not train & test


def test_no_test_question_appears_in_any_generators_train_split() -> None:
    names = ("reverse", "sort", "add", "multiturn", "preference")
    train = set().union(*(_questions(n, synthetic.generate(n, "train", 1000)) for n in names))
    test = set().union(*(_questions(n, synthetic.generate(n, "test", 200)) for n in names))
    assert not train & test


def test_pinned_rows_do_not_drift_across_machines() -> None:
    # The test split is what `make demo` reports on: pin its first rows so a change is deliberate.
    sort = "Sort the numbers from smallest to largest."
    assert synthetic.generate("sort", "test", 2) == [
        {"instruction": sort, "input": "6 0 1", "output": "0 1 6"},
        {"instruction": sort, "input": "2 2 4 2 4", "output": "2 2 2 4 4"},
    ]
    assert synthetic.generate("reverse", "test", 2) == [
        {"instruction": "Reverse the letters.", "input": "a,n,p,g", "output": "g,p,n,a"},
        {"instruction": "Reverse the letters.", "input": "w,t,m,b,x", "output": "x,b,m,t,w"},
    ]
    assert synthetic.generate("add", "train", 1, seed=0) == [
        {"instruction": "Add the two numbers.", "input": "19 + 63", "output": "82"}
    ]


@pytest.mark.parametrize("task", ALPACA_TASKS)
@pytest.mark.parametrize("split", synthetic.SPLITS)
def test_alpaca_rows_are_correct_and_distinct(task: str, split: str) -> None:
    rows = synthetic.generate(task, split, 300, seed=1)
    assert all(set(row) == {"instruction", "input", "output"} for row in rows)
    assert len({row["input"] for row in rows}) == len(rows)  # no repeated question within a split
    assert all(row["instruction"] == synthetic.INSTRUCTIONS[task] for row in rows)
    assert all(synthetic.split_of(task, row["input"]) == split for row in rows)


def test_reverse_answers() -> None:
    for row in synthetic.generate("reverse", "train", 300):
        letters = row["input"].split(",")
        assert 3 <= len(letters) <= 5 and len(set(letters)) == len(letters)
        assert all(len(ch) == 1 and ch.islower() for ch in letters)
        assert row["output"] == ",".join(letters[::-1])


def test_sort_answers() -> None:
    for row in synthetic.generate("sort", "train", 300):
        numbers = [int(x) for x in row["input"].split(" ")]
        assert 3 <= len(numbers) <= 5 and all(0 <= n <= 9 for n in numbers)
        assert row["output"] == " ".join(str(n) for n in sorted(numbers))


def test_add_answers() -> None:
    for row in synthetic.generate("add", "train", 300):
        left, right = (int(x) for x in row["input"].split(" + "))
        assert 0 <= left <= 99 and 0 <= right <= 99
        assert row["output"] == str(left + right)


def test_multiturn_rows_are_sharegpt_with_correct_answers() -> None:
    rows = synthetic.generate("multiturn", "train", 200)
    for row in rows:
        assert set(row) == {"conversations", "system"}
        assert isinstance(row["system"], str) and row["system"]
        turns = row["conversations"]
        assert len(turns) in (4, 6)
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        for question, answer in zip(turns[::2], turns[1::2]):
            instruction, problem_input = question["value"].split("\n")
            assert answer["value"] == synthetic.SOLVERS[_task_of(instruction)](problem_input)
    assert {len(row["conversations"]) for row in rows} == {4, 6}


def test_preference_rows_prefer_the_correct_answer() -> None:
    rows = synthetic.generate("preference", "train", 500)
    for row in rows:
        assert set(row) == {"instruction", "input", "chosen", "rejected"}
        task = _task_of(row["instruction"])
        assert row["chosen"] == synthetic.SOLVERS[task](row["input"])
        assert row["rejected"] != row["chosen"]
        # Plausible: same shape as the right answer (same item count, or a number).
        if task == "add":
            assert row["rejected"].isdigit()
        else:
            sep = "," if task == "reverse" else " "
            assert len(row["rejected"].split(sep)) == len(row["chosen"].split(sep))
    assert {_task_of(row["instruction"]) for row in rows} == set(ALPACA_TASKS)


def test_prose_is_reproducible_plain_text() -> None:
    documents = synthetic.prose(100, seed=0)
    assert documents == synthetic.prose(100, seed=0) != synthetic.prose(100, seed=1)
    assert all(doc.endswith((".", "!")) and "<|" not in doc for doc in documents)


def test_bad_arguments_raise_data_error() -> None:
    with pytest.raises(DataError, match="unknown synthetic generator 'nope'"):
        synthetic.generate("nope", "train", 1)
    with pytest.raises(DataError, match="split must be"):
        synthetic.generate("reverse", "validation", 1)
    with pytest.raises(DataError, match="num_samples"):
        synthetic.generate("reverse", "train", -1)


def test_exhausted_problem_space_raises_instead_of_looping() -> None:
    # add has 10,000 distinct problems, about 1,000 of them in test.
    with pytest.raises(DataError, match="ran out of distinct test problems"):
        synthetic.generate("add", "test", 5000)


def test_wrong_answer_when_no_neighbours_differ() -> None:
    import random  # noqa: PLC0415

    assert synthetic.wrong_answer("sort", "3 3 3", random.Random(0)) == "3 3 4"
    assert synthetic.wrong_answer("add", "0 + 0", random.Random(0)) in {"1", "10"}


@pytest.mark.parametrize("name", sorted(synthetic.GENERATORS))
def test_rows_survive_dataset_from_list(name: str) -> None:
    # The registry builds datasets.Dataset.from_list(rows), which takes its columns from row 0.
    datasets = pytest.importorskip("datasets")
    rows = synthetic.generate(name, "train", 20)
    assert datasets.Dataset.from_list(rows).to_list() == rows


# --- shapes: the answer is read back from the pixels, not from the generator's own scene ---------------------


def _read_scene(png: bytes) -> list[tuple[int, str, str]]:
    """(cell, kind, colour) of each shape in the image, found per grid cell: the colour is the only non-background
    colour in the cell, the kind follows from how much of its bounding box the shape fills (square 1, circle
    pi/4, triangle 1/2)."""
    import io  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    image = Image.open(io.BytesIO(png))
    assert image.mode == "RGB" and image.size == (synthetic.SHAPE_CANVAS, synthetic.SHAPE_CANVAS)
    pixels = np.asarray(image)
    names = {rgb: name for name, rgb in synthetic.SHAPE_COLOURS.items()}
    size = synthetic.SHAPE_CANVAS // synthetic.SHAPE_CELLS
    found = []
    for cell in range(synthetic.SHAPE_CELLS**2):
        top, left = (cell // synthetic.SHAPE_CELLS) * size, (cell % synthetic.SHAPE_CELLS) * size
        block = pixels[top : top + size, left : left + size]
        ys, xs = np.nonzero((block != synthetic.SHAPE_BACKGROUND).any(axis=2))
        if not len(ys):
            continue
        colour = tuple(int(v) for v in block[ys[0], xs[0]])
        assert (block[ys, xs] == colour).all()  # solid fill, no anti-aliased edge colours
        fill = len(ys) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
        kind = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
        found.append((cell, kind, names[colour]))
    return found


@pytest.mark.parametrize("split", synthetic.SPLITS)
def test_shapes_answers_match_what_the_image_shows(split: str) -> None:
    rows = synthetic.generate("shapes", split, 300, seed=2)
    cells = "|".join(synthetic.SHAPE_CELL_NAMES)
    for row in rows:
        assert set(row) == {"instruction", "input", "output", "images"} and row["input"] == ""
        assert len(row["images"]) == 1 and row["images"][0]["path"] is None
        scene = _read_scene(row["images"][0]["bytes"])
        question = row["instruction"].removeprefix("<image>")
        colour = re.fullmatch(rf"What colour is the shape in the ({cells})\?", question)
        if colour:
            cell = synthetic.SHAPE_CELL_NAMES.index(colour.group(1))
            assert [c for at, _, c in scene if at == cell] == [row["output"]]
        else:
            assert question == "How many shapes are there?"
            assert row["output"] == str(len(scene))
    # Every question occurs, and every answer of a question equally often (the no-look guess stays near 25%).
    assert {row["instruction"] for row in rows} == {"<image>How many shapes are there?"} | {
        f"<image>What colour is the shape in the {cell}?" for cell in synthetic.SHAPE_CELL_NAMES
    }


def test_shapes_answers_are_balanced() -> None:
    import collections  # noqa: PLC0415

    rows = synthetic.generate("shapes", "train", 4000)
    counts = collections.Counter(r["output"] for r in rows if r["instruction"] == "<image>How many shapes are there?")
    colours = collections.Counter(r["output"] for r in rows if "colour" in r["instruction"])
    assert sorted(counts) == ["1", "2", "3", "4"] and sorted(colours) == sorted(synthetic.SHAPE_COLOURS)
    # Answer shares within 4 points of a quarter; the most common answer per question is then a near-blind guess.
    for counter in (counts, colours):
        total = sum(counter.values())
        assert all(abs(n / total - 0.25) < 0.04 for n in counter.values()), counter
    assert 0.45 < sum(counts.values()) / len(rows) < 0.55


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_shapes_test_images_never_appear_in_train_whatever_the_seeds() -> None:
    # The split follows the scene layout (read back from the pixels here), so no test picture is trained on.
    def layouts(split: str, seed: int, n: int) -> set[tuple]:
        return {tuple(_read_scene(row["images"][0]["bytes"])) for row in synthetic.generate("shapes", split, n, seed)}

    train = layouts("train", 0, 1000) | layouts("train", 7, 1000)
    test = layouts("test", 0, 200) | layouts("test", 5, 200)
    assert len(test) > 100 and len(train) > 800
    assert not train & test


def test_shapes_split_follows_the_scene_key() -> None:
    import random  # noqa: PLC0415

    rng = random.Random(0)
    scenes = [synthetic._shapes_scene(rng) for _ in range(2000)]
    keys = {synthetic.shapes_scene_key(s) for s in scenes}
    test_keys = {k for k in keys if synthetic.split_of("shapes", k) == "test"}
    assert 0.05 < len(test_keys) / len(keys) < 0.15  # about TEST_PERCENT
    assert synthetic.shapes_scene_key(()) == "empty|empty|empty|empty"
    scene = (synthetic.Shape(0, "circle", "red"), synthetic.Shape(3, "triangle", "blue"))
    assert synthetic.shapes_scene_key(scene) == "red circle|empty|empty|blue triangle"
    assert synthetic.shapes_answer(scene, "How many shapes are there?") == "2"
    assert synthetic.shapes_answer(scene, "What colour is the shape in the top left?") == "red"
    assert synthetic.shapes_answer(scene, "What colour is the shape in the bottom right?") == "blue"
    with pytest.raises(ValueError, match="needs a shape in the top right cell, got none"):
        synthetic.shapes_answer(scene, "What colour is the shape in the top right?")
    with pytest.raises(ValueError, match="not a shapes question: 'How many circles are there\\?'"):
        synthetic.shapes_answer(scene, "How many circles are there?")


def test_pinned_shapes_rows_do_not_drift() -> None:
    import hashlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from PIL import Image  # noqa: PLC0415

    rows = synthetic.generate("shapes", "test", 2)
    assert [(r["instruction"], r["output"]) for r in rows] == [
        ("<image>How many shapes are there?", "3"), ("<image>What colour is the shape in the bottom left?", "green")
    ]
    # Pixels, not PNG bytes: the compressed bytes may differ with the zlib build.
    pixels = [hashlib.sha256(Image.open(io.BytesIO(r["images"][0]["bytes"])).tobytes()).hexdigest()[:16] for r in rows]
    assert pixels == ["245924b72bd8ad23", "4f7dadaeb8766285"]
