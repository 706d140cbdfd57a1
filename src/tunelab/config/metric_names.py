"""The names of the metrics a run logs, as options name them (metric_for_best_model, early stopping).

Known to the config so that a `metric_for_best_model` the run will never log fails before training; the stages,
evaluation and plots log under these names.
"""

from __future__ import annotations

from tunelab.config.args import RunConfig
from tunelab.config.stages import stage_row

VAL_SPLIT_NAME = "val"  # the eval set that val_size holds out of the training data
# The scores of generated answers a training run logs per eval set (generate_at_eval) and plots.
GENERATION_METRIC_NAMES = ("exact_match", "bleu", "rouge_l")


def eval_metric_names(config: RunConfig) -> list[str]:
    """Every eval metric the run will log (`eval_loss`, `eval_<name>_rouge_l`...), for metric_for_best_model."""
    data, row = config.data, stage_row(config.finetuning.stage)
    sets = ([VAL_SPLIT_NAME] if data.val_size > 0 else []) + list(data.eval_dataset or [])
    prefixes = ["eval"] if len(sets) <= 1 else [f"eval_{name}" for name in sets]
    names = list(row.eval_metrics)
    if row.token_loss and config.training.compute_token_accuracy:
        names.append("token_accuracy")
    if row.reads == "supervised" and config.generation.generate_at_eval:
        names.extend(GENERATION_METRIC_NAMES)
    return [f"{prefix}_{name}" for prefix in prefixes for name in names]
