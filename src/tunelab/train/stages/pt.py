"""Pretraining (continued pretraining) on raw text: the workflow, top to bottom.

tokenizer → documents → windows (data/pretrain.py) → model (+ adapters: full / freeze / LoRA) →
train → save → eval loss and perplexity. The same Trainer, loss and outputs as SFT; no chat
template (the tokenizer is saved as loaded, generation stops at eos). Everything lands in output_dir.
"""

from __future__ import annotations

import logging
import math

from tunelab import run_folder
from tunelab.data.cache import cached_bundle
from tunelab.data.collate import build_collator
from tunelab.data.pipeline import DatasetBundle
from tunelab.data.pretrain import build_pretrain_datasets
from tunelab.data.streaming import build_streaming_pretrain
from tunelab.train import outputs
from tunelab.train.recipe import SupervisedRecipe

logger = logging.getLogger(__name__)


class PretrainRecipe(SupervisedRecipe):
    stage = "pt"

    @property
    def template(self) -> None:
        return None  # raw text: no chat template

    @property
    def vision(self) -> None:
        return None

    def encode(self, data_args) -> DatasetBundle:
        return build_pretrain_datasets(data_args, self.tokenizer, seed=self.config.training.seed)

    def datasets(self) -> DatasetBundle:
        config, args = self.config, self.config.training
        if config.data.streaming:  # an iterable train set, read as training goes: nothing to cache
            return build_streaming_pretrain(config.data, self.tokenizer, args)
        return cached_bundle(config.data, self.tokenizer, None, "pt", args.seed,
                             build=lambda: self.encode(config.data), is_main_process=args.local_process_index == 0)

    def collator(self, model):
        # Windows are cutoff_len long except a kept tail, so padding only ever touches that one.
        return build_collator(model, self.tokenizer.pad_token_id, self.config.data.packing,
                              self.config.data.padding_free)

    def inspection_collator(self):
        return self.example_collator()

    def run(self) -> dict:
        config, args = self.config, self.config.training
        if config.data.template:
            logger.info("stage pt trains on raw text: template %r is not used", config.data.template)
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        trainer = self.trainer(model, data)

        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        metrics.update(result.metrics)
        outputs.save_model(trainer, self.tokenizer, None, args.output_dir)
        if data.eval:
            metrics.update(with_perplexity(self.final_eval_metrics(trainer)))
        outputs.finish(trainer, metrics, args)
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
