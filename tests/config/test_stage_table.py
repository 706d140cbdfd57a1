"""A stage is one row of config/stages.py's table: no module outside the table and the stages' own modules
(train/stages/) spells a stage's name, and every row names a recipe that exists."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from tunelab.config.stages import STAGE_NAMES, STAGES
from tunelab.train.recipe import Recipe

SRC = Path(__file__).resolve().parents[2] / "src" / "tunelab"
OWNERS = ("config/stages.py", "train/stages/")  # where stage names belong
# The same strings meaning something else: (module, string) -> what it is there.
NOT_STAGE_NAMES = {
    ("config/args.py", "grpo"): "loss_type's value and default: GRPO's loss reduction, not the stage",
    ("model/adapters.py", "pt"): "safetensors metadata format 'pt' (PyTorch)",
    ("data/vision.py", "pt"): "return_tensors='pt' of a processor call",
}


def stage_literals() -> dict[tuple[str, str], list[int]]:
    """(module, stage name) -> the lines where the name is a string literal, outside the owners."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module.startswith(OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in STAGE_NAMES:
                found.setdefault((module, node.value), []).append(node.lineno)
    return found


def test_no_module_outside_the_table_spells_a_stage_name():
    spelled = {key: lines for key, lines in stage_literals().items() if key not in NOT_STAGE_NAMES}
    assert not spelled, (
        "ask config/stages.py's row (stage_row(name).reads, .rl, ...) instead of comparing stage names: "
        + "; ".join(f"src/tunelab/{module}:{','.join(map(str, lines))} '{name}'"
                    for (module, name), lines in spelled.items())
    )


def test_the_allow_list_holds_only_strings_still_there():
    assert set(NOT_STAGE_NAMES) <= set(stage_literals())


def test_every_row_names_its_recipe():
    for row in STAGES:
        recipe = getattr(importlib.import_module(row.recipe_module), row.recipe_class)
        assert issubclass(recipe, Recipe) and recipe.stage == row.name, row
