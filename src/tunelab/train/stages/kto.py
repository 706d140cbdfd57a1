"""KTO on unpaired examples, each with a mismatched KL example (data/pairwise.py), against a reference model:
train/recipe.py's PairRecipe workflow with KTO's loss (train/preference_losses.py)."""

from __future__ import annotations

from tunelab.train.recipe import PairRecipe


class KTORecipe(PairRecipe):
    stage = "kto"
