"""Kahneman–Tversky optimisation on unpaired desirable / undesirable examples.

The workflow is dpo's (stages/dpo.py: policy, reference, optional precomputed reference log-probs,
exact match before/after), on KTO examples (data/pairwise.py: ranking rows give a desirable and an
undesirable example each, or rows carry a kto_tag) with the KTO loss (train/preference_losses.py).
"""

from __future__ import annotations

from tunelab.train.plan import RunPlan
from tunelab.train.stages.dpo import train_against_reference


def run_kto(plan: RunPlan) -> dict:
    return train_against_reference(plan, "kto")
