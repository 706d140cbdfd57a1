"""The tool_math generator (data/tool_tasks.py): exact answers, computed here again from the question's text alone,
every family present, the tool named in the prompt, and a held-out split by question."""

from __future__ import annotations

import re

from tunelab.data import synthetic, tool_tasks


def _solve(question: str) -> tuple[str, int]:
    """The question's family and its answer, read back from its text alone."""
    numbers = [int(n) for n in re.findall(r"\d+", question.split("?")[0])]
    if question.startswith("What is the sum"):
        return "sum_many", sum(numbers)
    if question.startswith("How many times"):
        letter, text = re.match(r"How many times does the letter '(.)' occur in this string: \"(\w+)\"",
                                question).groups()
        return "count_letter", text.count(letter)
    if "remainder" in question:
        return "power_mod", pow(*numbers)
    return "multiply", numbers[0] * numbers[1]


def test_answers_are_right_and_every_family_appears():
    rows = synthetic.generate("tool_math", "train", 200, seed=3)
    families = set()
    for row in rows:
        assert row["instruction"].endswith(tool_tasks.INSTRUCTION_TAIL) and row["input"] == ""
        family, answer = _solve(row["instruction"])
        assert row["output"] == str(answer)
        families.add(family)
    assert families == set(tool_tasks.FAMILIES)


def test_held_out_questions_never_appear_in_train_and_rows_are_reproducible():
    train = {r["instruction"] for seed in (0, 1) for r in synthetic.generate("tool_math", "train", 500, seed)}
    test = {r["instruction"] for r in synthetic.generate("tool_math", "test", 100, seed=0)}
    assert len(test) == 100 and not train & test
    assert synthetic.generate("tool_math", "test", 5, seed=7) == synthetic.generate("tool_math", "test", 5, seed=7)
