"""KTO on unpaired examples, each with a mismatched KL example (data/pairwise.py): dpo's workflow (stages/dpo.py)
with KTO's loss (train/preference_losses.py) and a reference model always."""

from __future__ import annotations

from tunelab.train.stages.dpo import DPORecipe


class KTORecipe(DPORecipe):
    stage = "kto"
