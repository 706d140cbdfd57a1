"""The names of the metrics a run logs, as options name them (metric_for_best_model, early stopping).

Known to the config so that a `metric_for_best_model` the run will never log fails before training; the stages,
evaluation and plots log under these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tunelab.config.args import DataArguments, FinetuningArguments, GenerationArguments
from tunelab.config.stages import stage_row

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

VAL_SPLIT_NAME = "val"  # the eval set that val_size holds out of the training data
# The scores of generated answers a training run logs per eval set (generate_at_eval) and plots.
GENERATION_METRIC_NAMES = ("exact_match", "bleu", "rouge_l")


def eval_metric_names(data: DataArguments, finetuning: FinetuningArguments, generation: GenerationArguments,
                      training: TrainingArguments) -> list[str]:
    """Every eval metric the run will log (`eval_loss`, `eval_<name>_rouge_l`...), for metric_for_best_model."""
    row = stage_row(finetuning.stage)
    sets = ([VAL_SPLIT_NAME] if data.val_size > 0 else []) + list(data.eval_dataset or [])
    prefixes = ["eval"] if len(sets) <= 1 else [f"eval_{name}" for name in sets]
    names = list(row.eval_metrics)
    if row.token_loss and training.compute_token_accuracy:
        names.append("token_accuracy")
    if row.reads == "supervised" and generation.generate_at_eval:
        names.extend(GENERATION_METRIC_NAMES)
    return [f"{prefix}_{name}" for prefix in prefixes for name in names]
