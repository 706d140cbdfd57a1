"""The code-task generator (data/code_tasks.py): hidden tests that right code passes, prompts that never show
them, and a held-out split by task."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tunelab.data import code_tasks, synthetic
from tunelab.train.rl.code_sandbox import CodeRunner
from tunelab.train.rl.rewards import CodeTestsReward

# A solution written from each family's prompt alone, with the parameter read back from the prompt's text.
SOLUTIONS = {
    "sum_divisible": "def sum_divisible(xs):\n    return sum(x for x in xs if x % {0} == 0)",
    "count_greater": "def count_greater(xs):\n    return len([x for x in xs if x > {0}])",
    "count_letter": "def count_letter(s):\n    return s.count('{0}')",
    "remove_letter": "def remove_letter(s):\n    return ''.join(c for c in s if c != '{0}')",
    "scale_all": "def scale_all(xs):\n    return [{0} * x for x in xs]",
    "add_to_all": "def add_to_all(xs):\n    return [x + {0} for x in xs]",
    "sum_of_powers": "def sum_of_powers(xs):\n    return sum(x ** {0} for x in xs)",
    "clamp_all": "def clamp_all(xs):\n    return [{0} if x < {0} else {1} if x > {1} else x for x in xs]",
    "join_copies": "def join_copies(s):\n    return {1}.join(s for _ in range({0}))",
    "long_words": "def long_words(s):\n    return [w for w in s.split(' ') if w and len(w) > {0}]",
    "every_kth": "def every_kth(xs):\n    return [x for i, x in enumerate(xs) if i % {0} == 0]",
    "rotate_left": "def rotate_left(xs):\n    for _ in range({0} if xs else 0):\n        xs = xs[1:] + xs[:1]\n"
                   "    return xs",
    "first_above": "def first_above(xs):\n    for i, x in enumerate(xs):\n        if x > {0}:\n            return i\n"
                   "    return -1",
    "shift_letters": "def shift_letters(s):\n    abc = 'abcdefghijklmnopqrstuvwxyz'\n"
                     "    return ''.join(abc[(abc.index(c) + {0}) % 26] if c in abc else c for c in s)",
}
PARAMETER = re.compile(r"-?\d+|'[^']*'")


def _solution(prompt: str) -> str:
    name = prompt.split("`")[1].split("(")[0]
    described = prompt.split("that returns ", 1)[1]
    found = PARAMETER.findall(described.replace("xs[0]", ""))
    values = {"clamp_all": found[:2], "join_copies": found[:2]}.get(name, found[:1])
    if name == "count_letter" or name == "remove_letter":
        values = [found[0].strip("'")]
    return f"```python\n{SOLUTIONS[name].format(*values)}\n```"


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_right_code_written_from_the_prompt_passes_every_hidden_test():
    rows = synthetic.generate("code", "train", 60, seed=1) + synthetic.generate("code", "test", 20, seed=1)
    assert {row["instruction"].split("`")[1].split("(")[0] for row in rows} == set(SOLUTIONS)  # every family
    reward = CodeTestsReward(CodeRunner(workers=2))
    scores = reward([""] * len(rows), [_solution(row["instruction"]) for row in rows], [row["output"] for row in rows])
    assert scores == [1.0] * len(rows), [row["instruction"] for row, s in zip(rows, scores) if s != 1.0]
    assert reward.pop_stats()["crashes"] == 0


def test_the_prompt_is_the_task_alone_and_never_shows_the_tests():
    rows = synthetic.generate("code", "train", 400, seed=0)
    by_prompt: dict[str, set[str]] = {}
    for row in rows:
        assert "assert" not in row["instruction"] and "==" not in row["instruction"]
        assert row["output"].count("assert ") == code_tasks.TESTS_PER_ROW
        by_prompt.setdefault(row["instruction"], set()).add(row["output"])
    # Tasks repeat with fresh hidden inputs: a prompt cannot carry one row's expected values.
    assert max(len(outputs) for outputs in by_prompt.values()) > 1


def test_held_out_split_is_by_task():
    train = {row["instruction"] for row in synthetic.generate("code", "train", 3000, seed=0)}
    test = {row["instruction"] for row in synthetic.generate("code", "test", 300, seed=5)}
    assert train and test and not train & test
    assert synthetic.generate("code", "test", 10, seed=3) == synthetic.generate("code", "test", 10, seed=3)


def test_demo_code_is_registered():
    info = json.loads((Path(synthetic.__file__).parent / "dataset_info.json").read_text())
    assert info["demo_code"]["generator"] == info["demo_code_test"]["generator"] == "code"
    assert (info["demo_code"]["split"], info["demo_code_test"]["split"]) == ("train", "test")


def test_composed_tasks_follow_every_clause_and_are_held_out_by_task():
    rows = synthetic.generate("code_composed", "test", 12, seed=0)
    for row in rows:
        assert row["instruction"].startswith("Write a Python function `keep_change_combine(xs)` that keeps ")
        assert "assert" not in row["instruction"]
    # A solution written from the wording of one task, checked on that task's rows only.
    prompt = ("Write a Python function `keep_change_combine(xs)` that keeps the numbers of the list xs that are "
              "divisible by 3, multiplies each of them by 2 and returns their sum. Reply with the function in one "
              "```python block.")
    train = synthetic.generate("code_composed", "train", 3000, seed=0)
    test = {row["instruction"] for row in synthetic.generate("code_composed", "test", 300, seed=0)}
    assert not test & {row["instruction"] for row in train}
    mine = [row for row in train + rows if row["instruction"] == prompt]
    assert mine, "the task is drawn in 3,000 train rows"
    solution = "def keep_change_combine(xs):\n    return sum(2 * x for x in xs if x % 3 == 0)"
    reward = CodeTestsReward(CodeRunner(workers=2))
    assert reward([""] * len(mine), [solution] * len(mine), [row["output"] for row in mine]) == [1.0] * len(mine)
