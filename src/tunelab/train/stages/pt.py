"""Pretraining (continued pretraining) on raw text: the workflow, top to bottom.

tokenizer → documents → windows (data/pretrain.py) → model (+ adapters: full / freeze / LoRA) →
train → save → eval loss and perplexity. The same Trainer, loss and outputs as SFT; no chat
template (the tokenizer is saved as loaded, generation stops at eos). Everything lands in output_dir.
"""

from __future__ import annotations

import logging
import math

from tunelab.config.args import RunConfig
from tunelab.train.plan import RunPlan
from tunelab.data.cache import cached_bundle
from tunelab.data.collate import build_collator
from tunelab.data.pretrain import build_pretrain_datasets
from tunelab.data.streaming import build_streaming_pretrain
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.callbacks import run_callbacks
from tunelab.train.stages.sft import _final_eval_metrics
from tunelab.train.trainer import TunelabTrainer

logger = logging.getLogger(__name__)


def run_pt(plan: RunPlan) -> dict:
    config = plan.config
    args = config.training
    if config.data.template:
        logger.info("stage pt trains on raw text: template %r is not used", config.data.template)
    tokenizer = load_tokenizer(config.model)
    if config.data.streaming:  # an iterable train set, read as training goes: nothing to cache
        data = build_streaming_pretrain(config.data, tokenizer, args)
    else:
        data = cached_bundle(
            config.data, tokenizer, None, "pt", args.seed,
            build=lambda: build_pretrain_datasets(config.data, tokenizer, seed=args.seed),
            is_main_process=args.local_process_index == 0,
        )
    run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)

    model = load_model(config.model, config.finetuning, args, tokenizer, is_trainable=True)
    trainable, total = count_parameters(model)
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))

    evals = data.eval or None
    if evals and len(evals) == 1:
        evals = next(iter(evals.values()))  # a single eval set logs as plain eval_loss
    trainer = TunelabTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=evals,
        # Windows are cutoff_len long except a kept tail, so padding only ever touches that one.
        data_collator=build_collator(model, tokenizer.pad_token_id, config.data.packing, config.data.padding_free),
        processing_class=tokenizer,
        callbacks=run_callbacks(config, plan.user_callbacks),
    )

    metrics: dict = {"trainable_parameters": trainable, "total_parameters": total}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics.update(result.metrics)
    outputs.save_model(trainer, tokenizer, None, config)
    if data.eval:
        metrics.update(with_perplexity(_final_eval_metrics(trainer)))
    outputs.finish(trainer, metrics, config)
    return metrics


def with_perplexity(eval_metrics: dict) -> dict:
    """Add `<prefix>_perplexity` = exp(loss) beside every `<prefix>_loss`."""
    result = dict(eval_metrics)
    for key, value in eval_metrics.items():
        if key.endswith("_loss"):
            try:
                result[key[: -len("loss")] + "perplexity"] = math.exp(value)
            except OverflowError:
                result[key[: -len("loss")] + "perplexity"] = math.inf
    return result
