"""A stage's workflow as a recipe: one object per stage whose methods are the steps of the job, shared by every
command that needs the stage's data or model (torchtune's recipe shape).

    recipe = recipe_for(plan)          the plan tunelab/preflight.py resolved
    recipe.tokenizer                   the model folder's tokenizer; .template, .vision (a VLM's processor)
    recipe.datasets()                  what the stage trains on, through the tokenized cache
    recipe.collator(model)             the collator its trainer batches with, for the loaded model or a skeleton
    recipe.model()                     the model set up to train (adapters, quantization)
    recipe.trainer(model, data)        sft / pt: the Trainer on them (the pair stages build their PreferenceTrainer)
    recipe.run()                       tunelab train: train, save, evaluate → the run's metrics
    recipe.summary(metrics)            the lines tunelab train ends with
    recipe.inspection()                tunelab data stats|verify|coverage: the samples before packing, the packed
                                       rows, the collator chosen on a meta-device skeleton (data/run_data.py)

`tunelab estimate` (train/estimate.py) reads datasets(), model() and collator() too; none of these commands builds
a stage's data or model by hand. The stages: train/stages/sft.py, pt.py, rm.py, dpo.py (dpo, kto), grpo.py and
ppo.py (the generating stages, on train/rl/workflow.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from functools import cached_property
from typing import Any, ClassVar

from torch import nn

from tunelab.config.stages import stage_row
from tunelab.data.collate import PackedCollator, PaddingFreeCollator, SupervisedCollator, build_collator
from tunelab.data.pipeline import DatasetBundle
from tunelab.data.run_data import RunData, pack_rows
from tunelab.data.templates import Template, get_template
from tunelab.data.vision import vision_inputs
from tunelab.model import skeleton
from tunelab.model.tokenizer import load_processor, load_tokenizer
from tunelab.train.plan import RunPlan

logger = logging.getLogger(__name__)



def recipe_for(plan: RunPlan) -> Recipe:
    """The recipe of the plan's stage, as the stage table names it (its module imported now: the stages import the
    Trainer, which `tunelab data` reaches only through this call)."""
    row = stage_row(plan.config.finetuning.stage)
    return getattr(importlib.import_module(row.recipe_module), row.recipe_class)(plan)


class Recipe:
    stage: ClassVar[str]
    sides: ClassVar[tuple[str, str] | None] = None  # pair stages: the column prefixes of a row's two sequences
    # sft: `tunelab data` packs the encoded samples itself, to keep each packed row's sample lengths (the rows are
    # the pipeline's). pt packs chunks in its own pipeline; pairs are never packed.
    inspection_packs: ClassVar[bool] = False

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.config = plan.config

    # ---- what every stage shares ---------------------------------------------------------------------------

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.config.model)

    @cached_property
    def template(self) -> Template | None:
        return get_template(self.config.data.template, self.tokenizer)

    @cached_property
    def vision(self) -> tuple[Any, Any] | None:
        """A vision-language model's (processor, image settings) (data/vision.py), None for a text model."""
        return vision_inputs(load_processor(self.config.model), self.config.model)

    def skeleton(self) -> nn.Module:
        return skeleton.skeleton(self.config)

    def model(self) -> nn.Module:
        from tunelab.model.load import load_model  # noqa: PLC0415  (peft, bitsandbytes: imported when training)

        return load_model(self.config.model, self.config.finetuning, self.config.training, self.tokenizer,
                          is_trainable=True)

    @staticmethod
    def parameter_counts(model: nn.Module) -> dict[str, int]:
        """Logged once, and the first entries of the run's metrics."""
        from tunelab.model.load import count_parameters  # noqa: PLC0415  (as model())

        trainable, total = count_parameters(model)
        logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))
        return {"trainable_parameters": trainable, "total_parameters": total}

    def example_collator(self) -> SupervisedCollator | PackedCollator | PaddingFreeCollator:
        """The collator build_collator picks for the trained model, picked on a skeleton (no weights)."""
        pad, data_args = self.tokenizer.pad_token_id, self.config.data
        if not data_args.packing and data_args.padding_free is False:
            return SupervisedCollator(pad)
        if self.config.model.flash_attn == "fa2" and not self.config.model.trust_remote_code:
            # What for_model picks for flash attention (the skeleton is built without flash-attn installed).
            varlen = PackedCollator(pad, "varlen")
            return varlen if data_args.packing else PaddingFreeCollator(varlen)
        return build_collator(self.skeleton(), pad, data_args.packing, data_args.padding_free)

    def trainer(self, model: nn.Module, data: DatasetBundle, *callbacks):
        """The Trainer of the stages that train on examples (sft, pt): the run's datasets, collator and callbacks
        (train/callbacks.py: the log, early stopping, the user's) plus the stage's own."""
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        from tunelab.train.callbacks import run_callbacks  # noqa: PLC0415
        from tunelab.train.trainer import TunelabTrainer  # noqa: PLC0415

        return TunelabTrainer(
            model=model,
            args=self.config.training,
            train_dataset=data.train,
            eval_dataset=single_or_named(data.eval),
            data_collator=self.collator(model),
            processing_class=self.tokenizer,
            callbacks=run_callbacks(self.config, self.plan.user_callbacks, *callbacks),
            finetuning=self.config.finetuning,
        )

    # ---- what each stage defines ---------------------------------------------------------------------------

    def encode(self, data_args) -> DatasetBundle:
        """The stage's encoded datasets for `data_args`, built afresh (no cache)."""
        raise NotImplementedError

    def datasets(self) -> DatasetBundle:
        """What the stage trains on, through the tokenized cache (built once, reused while the inputs are the same)."""
        raise NotImplementedError

    def collator(self, model: nn.Module):
        raise NotImplementedError

    def run(self) -> dict:
        raise NotImplementedError

    # ---- the commands that read a run without training it --------------------------------------------------

    def inspection(self) -> RunData:
        """`tunelab data`'s view: the samples before packing (packed aside with each row's sample lengths, as the
        trainer's pack_dataset places them), the collator chosen on a meta-device skeleton, the model's vocab_size."""
        data_args = self.config.data
        bundle = self.encode(dataclasses.replace(data_args, packing=False) if self.inspection_packs else data_args)
        data = RunData(
            self.config, self.tokenizer, bundle.train, bundle.eval, bundle.report, sides=self.sides,
            vision=self.vision if self.sides is None else None,  # (the images of pairs are checked by their collator)
            collator=self.inspection_collator(),
            vocab_size=skeleton.vocab_size(self.config.model.model_name_or_path),
        )
        if self.inspection_packs and data_args.packing:
            data.packed = {name: pack_rows(ds, data_args.cutoff_len) for name, ds in data.splits.items()}
            data.report["packing"] = {name: packed.stats.as_dict() for name, packed in data.packed.items()}
        return data

    def inspection_collator(self):
        """The collator `tunelab data verify` batches with, chosen without loading weights."""
        raise NotImplementedError

    def summary(self, metrics: dict) -> list[str]:
        """The lines `tunelab train` ends with: what the run measured before and after, where it saved."""
        lines = []
        before, after = metrics.get("exact_match_before"), metrics.get("exact_match_after")
        if before is not None and after is not None:
            lines.append(f"exact match (held-out): before {100 * before:.1f}% → after {100 * after:.1f}%")
        for key, what in (
            ("reward_accuracy", "reward accuracy (held-out pairs, r(chosen) > r(rejected))"),
            ("preference_accuracy", "preference accuracy (held-out pairs, log p(chosen) > log p(rejected))"),
        ):
            if f"{key}_before" in metrics and f"{key}_after" in metrics:
                lines.append(f"{what}: before {100 * metrics[f'{key}_before']:.1f}% → "
                             f"after {100 * metrics[f'{key}_after']:.1f}%")
        if "reward_first" in metrics and "reward_last" in metrics:  # grpo / ppo: mean reward of the rollouts
            lines.append(f"train reward (mean of rollouts): first log {metrics['reward_first']:.3f} → "
                         f"last log {metrics['reward_last']:.3f}")
        if "eval_loss" in metrics:
            lines.append(f"eval loss: {metrics['eval_loss']:.4f}")
        lines.append(f"saved to {self.config.training.output_dir}")
        return lines


def single_or_named(evals: dict):
    """The trainer's eval_dataset: None, the one set (logged as plain eval_*), or the sets by name."""
    if not evals:
        return None
    return next(iter(evals.values())) if len(evals) == 1 else evals


def first_eval_set(data: DatasetBundle):
    """The held-out set the before/after figures are measured on: the first eval set."""
    return next(iter(data.eval.values())) if data.eval else None
