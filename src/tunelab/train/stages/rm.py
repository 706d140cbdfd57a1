"""Reward modelling: the workflow, top to bottom.

tokenizer + template → pairs (data/pairwise.py) → the model with a scalar head (sequence
classification, one label) + adapters → [pairwise accuracy before] → train with the Bradley–Terry
loss → save (model/reward.py documents the format) → [pairwise accuracy after] → metrics.
"""

from __future__ import annotations

import logging

from tunelab import run_folder
from tunelab.data.collate import PairedCollator
from tunelab.data.pairwise import pair_sides, preference_bundle, preference_encoder
from tunelab.data.pipeline import DatasetBundle, build_datasets
from tunelab.train import outputs
from tunelab.train.recipe import Recipe, first_eval_set, single_or_named

logger = logging.getLogger(__name__)


class PairRecipe(Recipe):
    """What the pair stages (rm, dpo, kto) share: their rows, each two sequences (data/pairwise.py)."""

    @property
    def sides(self) -> tuple[str, str]:
        return pair_sides(self.stage)

    def encode(self, data_args) -> DatasetBundle:
        encoder = preference_encoder(self.stage, self.tokenizer, self.template, data_args, self.vision)
        return build_datasets(data_args, self.tokenizer, self.template, self.config.training.seed, encoder=encoder,
                              images=self.vision is not None)

    def datasets(self) -> DatasetBundle:
        args = self.config.training
        return preference_bundle(self.config.data, self.tokenizer, self.template, self.stage, args.seed,
                                 args.local_process_index == 0, vision=self.vision)


class RewardModelRecipe(PairRecipe):
    stage = "rm"

    @property
    def vision(self) -> None:
        return None  # (stage rm on a vision-language model is refused by train/run.py)

    def model(self):
        from tunelab.model.load import load_model  # noqa: PLC0415  (peft, bitsandbytes: imported when training)

        return load_model(self.config.model, self.config.finetuning, self.config.training, self.tokenizer,
                          is_trainable=True, reward_head=True)

    def collator(self, model=None) -> PairedCollator:
        return PairedCollator(self.tokenizer.pad_token_id)  # rewards are read at each padded row's end

    def inspection_collator(self) -> PairedCollator:
        return self.collator()

    def run(self) -> dict:
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        from tunelab.train.callbacks import run_callbacks  # noqa: PLC0415
        from tunelab.train.preference_trainer import PreferenceTrainer  # noqa: PLC0415
        config, args = self.config, self.config.training
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        trainer = PreferenceTrainer(
            stage="rm", finetuning=config.finetuning,
            model=model, args=args, train_dataset=data.train, eval_dataset=single_or_named(data.eval),
            data_collator=self.collator(model), processing_class=self.tokenizer,
            callbacks=run_callbacks(config, self.plan.user_callbacks),
        )

        held_out = first_eval_set(data)
        if held_out is not None:
            metrics["reward_accuracy_before"] = trainer.evaluate(held_out, metric_key_prefix="before")["before_accuracy"]
        metrics.update(trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics)
        outputs.save_model(trainer, self.tokenizer, self.template, config)
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

