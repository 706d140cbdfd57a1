"""Direct preference optimisation (and ipo, hinge, orpo, simpo): the workflow, top to bottom.

tokenizer + template → pairs (data/pairwise.py) → policy (+ adapters) → reference: a frozen copy
(full / freeze), the policy with its adapter disabled (LoRA), or none (orpo, simpo) →
[precompute reference log-probs] → [preference accuracy and exact match before] → train → save →
[after] → metrics. The workflow is train/recipe.py's PairRecipe; the losses train/preference_losses.py's.
"""

from __future__ import annotations

from tunelab.train.recipe import PairRecipe


class DPORecipe(PairRecipe):
    stage = "dpo"
    held_out_accuracy = ("preference_accuracy", "logps/accuracies",
                         "preference accuracy (log p(chosen) > log p(rejected))")
