"""Reward modelling: the workflow, top to bottom.

tokenizer + template → pairs (data/pairwise.py) → the model with a scalar head (sequence
classification, one label) + adapters → [pairwise accuracy before] → train with the Bradley–Terry
loss → save (model/reward.py documents the format) → [pairwise accuracy after] → metrics. The workflow is
train/recipe.py's PairRecipe.
"""

from __future__ import annotations

from tunelab.data.collate import PairedCollator
from tunelab.train.recipe import PairRecipe


class RewardModelRecipe(PairRecipe):
    stage = "rm"
    held_out_accuracy = ("reward_accuracy", "accuracy", "reward accuracy")

    @property
    def vision(self) -> None:
        return None  # (stage rm on a vision-language model is refused by train/run.py)

    def model(self):
        # lazy: model/load imports peft (7.8 s); `tunelab data` imports this module
        from tunelab.model.load import load_model

        return load_model(self.config.model, self.config.finetuning, self.config.training, self.tokenizer,
                          is_trainable=True, reward_head=True)

    def collator(self, model=None) -> PairedCollator:
        return PairedCollator(self.tokenizer.pad_token_id)  # rewards are read at each padded row's end

    def inspection_collator(self) -> PairedCollator:
        return self.collator()
