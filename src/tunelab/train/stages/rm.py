"""Reward modelling: the workflow, top to bottom.

tokenizer + template → pairs (data/pairwise.py) → the model with a scalar head (sequence
classification, one label) + adapters → [pairwise accuracy before] → train with the Bradley–Terry
loss → save (model/reward.py documents the format) → [pairwise accuracy after] → metrics.
"""

from __future__ import annotations

import logging

from tunelab.config.args import RunConfig
from tunelab.train.plan import RunPlan
from tunelab.data.collate import PairedCollator
from tunelab.data.pairwise import preference_bundle
from tunelab.data.templates import get_template
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.callbacks import run_callbacks
from tunelab.train.preference_trainer import PreferenceTrainer

logger = logging.getLogger(__name__)


def run_rm(plan: RunPlan) -> dict:
    config = plan.config
    args = config.training
    tokenizer = load_tokenizer(config.model)
    template = get_template(config.data.template, tokenizer)
    data = preference_bundle(config.data, tokenizer, template, "rm", args.seed, args.local_process_index == 0)
    run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)

    model = load_model(config.model, config.finetuning, args, tokenizer, is_trainable=True, reward_head=True)
    trainable, total = count_parameters(model)
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))
    trainer = PreferenceTrainer(
        stage="rm", finetuning=config.finetuning,
        model=model, args=args, train_dataset=data.train, eval_dataset=single_or_named(data.eval),
        data_collator=PairedCollator(tokenizer.pad_token_id), processing_class=tokenizer,
        callbacks=run_callbacks(config, plan.user_callbacks),
    )

    metrics: dict = {"trainable_parameters": trainable, "total_parameters": total}
    held_out = first_eval_set(data)
    if held_out is not None:
        metrics["reward_accuracy_before"] = trainer.evaluate(held_out, metric_key_prefix="before")["before_accuracy"]
    metrics.update(trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics)
    outputs.save_model(trainer, tokenizer, template, config)
    if held_out is not None:
        after = trainer.evaluate(held_out, metric_key_prefix="after")
        metrics.update(after)
        metrics["reward_accuracy_after"] = after["after_accuracy"]
        logger.info(
            "reward accuracy on %d held-out pairs: %.1f%% before training → %.1f%% after",
            len(held_out), 100 * metrics["reward_accuracy_before"], 100 * metrics["reward_accuracy_after"],
        )
    outputs.finish(trainer, metrics, config)
    return metrics


def single_or_named(evals: dict):
    """The trainer's eval_dataset: None, the one set (logged as plain eval_*), or the sets by name."""
    if not evals:
        return None
    return next(iter(evals.values())) if len(evals) == 1 else evals


def first_eval_set(data):
    """The held-out set the before/after figures are measured on: the first eval set."""
    return next(iter(data.eval.values())) if data.eval else None
