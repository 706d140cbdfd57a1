"""Supervised fine-tuning: the workflow, top to bottom.

SFTRecipe (train/recipe.py): tokenizer + template → datasets → model (+ adapters) → [exact match before] →
train (evaluations with generate_at_eval: + exact match, BLEU, ROUGE-L; early stopping; the user's callbacks) → save
→ [exact match after] → [do_predict: predictions.jsonl, BLEU/ROUGE-L] → metrics. Everything written lands in
output_dir.
"""

from __future__ import annotations

import logging

from tunelab import run_folder
from tunelab.data.cache import cached_bundle
from tunelab.data.collate import build_collator
from tunelab.data.pipeline import DatasetBundle, build_datasets
from tunelab.data.streaming import build_streaming_supervised
from tunelab.data.vision import save_processor_files, vision_collator, vision_fingerprint
from tunelab.errors import ConfigError
from tunelab.infer.generate import held_out_exact_match, held_out_rows
from tunelab.infer.predict import predict
from tunelab.train import outputs
from tunelab.train.recipe import Recipe

logger = logging.getLogger(__name__)


class SFTRecipe(Recipe):
    stage = "sft"
    inspection_packs = True

    def encode(self, data_args) -> DatasetBundle:
        return build_datasets(data_args, self.tokenizer, self.template, seed=self.config.training.seed,
                              vision=self.vision)

    def datasets(self) -> DatasetBundle:
        config, args = self.config, self.config.training
        if config.data.streaming:  # an iterable train set, read as training goes: nothing to cache
            if self.vision is not None:
                raise ConfigError("streaming: not supported for vision-language models yet; set streaming: false")
            return build_streaming_supervised(config.data, self.tokenizer, self.template, args)
        return cached_bundle(
            config.data, self.tokenizer, self.template.jinja + vision_fingerprint(self.vision), "sft", args.seed,
            build=lambda: self.encode(config.data), is_main_process=args.local_process_index == 0,
        )

    def collator(self, model):
        data_args = self.config.data
        collator = build_collator(model, self.tokenizer.pad_token_id, data_args.packing, data_args.padding_free)
        if self.vision is not None:
            collator = vision_collator(collator, model, self.vision, data_args.padding_free)
        return collator

    def inspection_collator(self):
        return self.example_collator()  # (the images' own checks are data/verify.py's verify_images)

    def run(self) -> dict:
        config, args = self.config, self.config.training
        tokenizer, template, vision = self.tokenizer, self.template, self.vision
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        trainer = self.trainer(model, data, *_generation_metrics(data.eval_rows, tokenizer, template, config))

        generation_rows = held_out_rows(data.eval_rows, config)
        if generation_rows is not None:
            metrics["exact_match_before"] = held_out_exact_match(
                trainer.model, tokenizer, template, generation_rows, config, vision
            )

        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        metrics.update(result.metrics)
        outputs.save_model(trainer, tokenizer, template, config)
        if vision is not None and trainer.is_world_process_zero():
            save_processor_files(vision[0], args.output_dir)

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



def _generation_metrics(eval_rows: dict, tokenizer, template, config) -> list:
    """generate_at_eval: exact match, BLEU and ROUGE-L of greedy answers at every evaluation (a TrainerCallback)."""
    from tunelab.train.generation_metrics import GenerationMetricsCallback  # noqa: PLC0415  (the training stack)

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

