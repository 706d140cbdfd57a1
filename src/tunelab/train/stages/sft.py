"""Supervised fine-tuning: the workflow, top to bottom.

tokenizer + template → datasets → model (+ adapters) → [exact match before] → train (evaluations with
generate_at_eval: + exact match, BLEU, ROUGE-L; early stopping; the user's callbacks) → save
→ [exact match after] → [do_predict: predictions.jsonl, BLEU/ROUGE-L] → metrics. Everything written lands in output_dir.
"""

from __future__ import annotations

import logging

from tunelab.config.args import RunConfig
from tunelab.train.plan import RunPlan
from tunelab.data.cache import cached_bundle
from tunelab.data.collate import build_collator
from tunelab.data.pipeline import build_datasets
from tunelab.data.streaming import build_streaming_supervised
from tunelab.data.templates import get_template
from tunelab.infer.generate import held_out_exact_match, held_out_rows
from tunelab.infer.predict import predict
from tunelab.data.vision import save_processor_files, vision_collator, vision_fingerprint, vision_inputs
from tunelab.errors import ConfigError
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_processor, load_tokenizer
from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.callbacks import run_callbacks
from tunelab.train.generation_metrics import GenerationMetricsCallback
from tunelab.train.trainer import TunelabTrainer

logger = logging.getLogger(__name__)


def run_sft(plan: RunPlan) -> dict:
    config = plan.config
    args = config.training
    tokenizer = load_tokenizer(config.model)
    template = get_template(config.data.template, tokenizer)
    processor = load_processor(config.model)  # vision-language models only (data/vision.py)
    vision = vision_inputs(processor, config.model)
    if config.data.streaming:  # an iterable train set, read as training goes: nothing to cache
        if processor is not None:
            raise ConfigError("streaming: not supported for vision-language models yet; set streaming: false")
        data = build_streaming_supervised(config.data, tokenizer, template, args)
    else:
        data = cached_bundle(
            config.data, tokenizer, template.jinja + vision_fingerprint(vision), "sft", args.seed,
            build=lambda: build_datasets(config.data, tokenizer, template, seed=args.seed, vision=vision),
            is_main_process=args.local_process_index == 0,
        )
    run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)

    model = load_model(config.model, config.finetuning, args, tokenizer, is_trainable=True)
    trainable, total = count_parameters(model)
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))

    collator = build_collator(model, tokenizer.pad_token_id, config.data.packing, config.data.padding_free)
    if vision is not None:
        collator = vision_collator(collator, model, vision, config.data.padding_free)
    evals = data.eval or None
    if evals and len(evals) == 1:
        evals = next(iter(evals.values()))  # a single eval set logs as plain eval_loss
    trainer = TunelabTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=evals,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=run_callbacks(config, plan.user_callbacks, *_generation_metrics(data.eval_rows, tokenizer, template, config)),
    )

    metrics: dict = {"trainable_parameters": trainable, "total_parameters": total}
    generation_rows = held_out_rows(data.eval_rows, config)
    if generation_rows is not None:
        metrics["exact_match_before"] = held_out_exact_match(
            trainer.model, tokenizer, template, generation_rows, config, vision
        )

    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics.update(result.metrics)
    outputs.save_model(trainer, tokenizer, template, config)
    if processor is not None and trainer.is_world_process_zero():
        save_processor_files(processor, args.output_dir)

    if data.eval:
        metrics.update(_final_eval_metrics(trainer))
    if generation_rows is not None:
        metrics["exact_match_after"] = held_out_exact_match(
            trainer.model, tokenizer, template, generation_rows, config, vision
        )
        logger.info(
            "exact match on %d held-out rows: %.1f%% before training → %.1f%% after",
            len(generation_rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
        )
    if args.do_predict and trainer.is_world_process_zero():  # predictions.jsonl + predict_results.json
        metrics.update(predict(
            trainer.model, tokenizer, template, data.eval_rows, args.output_dir,
            max_new_tokens=config.generation.max_new_tokens, batch_size=args.per_device_eval_batch_size,
            template_vars=config.data.template_kwargs, vision=vision,
        ))
    outputs.finish(trainer, metrics, config)
    return metrics


def _generation_metrics(eval_rows: dict, tokenizer, template, config) -> list[GenerationMetricsCallback]:
    """generate_at_eval: exact match, BLEU and ROUGE-L of greedy answers at every evaluation."""
    if not config.generation.generate_at_eval or not eval_rows:
        return []
    return [GenerationMetricsCallback.from_config(eval_rows, tokenizer, template, config)]


def _final_eval_metrics(trainer) -> dict:
    """Eval metrics of the final model: reuse the evaluation the schedule ran at its step, else run one. With
    load_best_model_at_end the final model is the best checkpoint's, so its step's evaluation, not the last one."""
    state = trainer.state
    loaded_best = trainer.args.load_best_model_at_end and state.best_model_checkpoint is not None
    step = state.best_global_step if loaded_best and state.best_global_step else state.global_step
    metrics: dict = {}
    for record in state.log_history:  # with several eval sets, each logged its own line at that step
        if record.get("step") == step and any(k.startswith("eval_") and k.endswith("loss") for k in record):
            metrics.update({k: v for k, v in record.items() if k.startswith("eval_")})
    return metrics or trainer.evaluate()

