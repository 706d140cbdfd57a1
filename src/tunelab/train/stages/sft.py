"""Supervised fine-tuning: the workflow, top to bottom.

tokenizer + template → datasets → model (+ adapters) → [exact match before] → train (evaluations with
generate_at_eval: + exact match, BLEU, ROUGE-L; early stopping; the user's callbacks) → save → [exact match after] →
[do_predict: predictions.jsonl, BLEU/ROUGE-L] → metrics. Everything written lands in output_dir. The rows, collator
and held-out exact match are train/recipe.py's (Recipe), the Trainer its SupervisedRecipe's.
"""

from __future__ import annotations

from tunelab import run_folder
from tunelab.data.cache import cached_bundle
from tunelab.data.pipeline import DatasetBundle
from tunelab.data.streaming import build_streaming_supervised
from tunelab.data.vision import save_processor_files, vision_fingerprint
from tunelab.errors import ConfigError
from tunelab.infer.predict import predict
from tunelab.train import outputs
from tunelab.train.recipe import SupervisedRecipe


class SFTRecipe(SupervisedRecipe):
    stage = "sft"
    inspection_packs = True

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

    def run(self) -> dict:
        config, args = self.config, self.config.training
        tokenizer, template, vision = self.tokenizer, self.template, self.vision
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        trainer = self.trainer(model, data, *_generation_metrics(data.eval_rows, tokenizer, template, config.generation,
                                                                 config.data, args))

        rows = self.held_out_rows(data)
        self.exact_match_before(trainer.model, rows, metrics, vision)

        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        metrics.update(result.metrics)
        outputs.save_model(trainer, tokenizer, template, args.output_dir)
        if vision is not None and trainer.is_world_process_zero():
            save_processor_files(vision[0], args.output_dir)

        if data.eval:
            metrics.update(self.final_eval_metrics(trainer))
        self.exact_match_after(trainer.model, rows, metrics, vision)
        if args.do_predict and trainer.is_world_process_zero():  # predictions.jsonl + predict_results.json
            metrics.update(predict(
                trainer.model, tokenizer, template, data.eval_rows, args.output_dir,
                max_new_tokens=config.generation.max_new_tokens, batch_size=args.per_device_eval_batch_size,
                template_vars=config.data.template_kwargs, vision=vision,
            ))
        outputs.finish(trainer, metrics, args)
        return metrics


def _generation_metrics(eval_rows: dict, tokenizer, template, generation, data_args, args) -> list:
    """generate_at_eval: exact match, BLEU and ROUGE-L of greedy answers at every evaluation (a TrainerCallback)."""
    # lazy: transformers' TrainerCallback imports peft and bitsandbytes (7.8 s); `tunelab data` imports this module
    from tunelab.train.generation_metrics import GenerationMetricsCallback

    if not generation.generate_at_eval or not eval_rows:
        return []
    return [GenerationMetricsCallback.from_options(eval_rows, tokenizer, template, generation, data_args, args)]
