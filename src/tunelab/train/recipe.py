"""A stage's workflow as a recipe: one object per stage whose methods are the steps of the job, shared by every
command that needs the stage's data or model (torchtune's recipe shape). Two levels: the bases here hold what a kind
of stage shares, and each stage (train/stages/) is one subclass of one of them, named by the stage table
(config/stages.py):

    Recipe              the tokenizer, template, model, conversation rows, held-out exact match before → after
      SupervisedRecipe  the token loss in transformers' Trainer (sft, pt): the Trainer, the final eval metrics
      PairRecipe        two sequences per row in the PreferenceTrainer (rm, dpo, kto): the whole workflow
      RLRecipe          sampled answers in the RL loop (grpo, ppo; train/rl/): the whole workflow

    recipe = recipe_for(plan)          the plan tunelab/preflight.py resolved
    recipe.tokenizer                   the model folder's tokenizer; .template, .vision (a VLM's processor)
    recipe.datasets()                  what the stage trains on, through the tokenized cache
    recipe.collator(model)             the collator its trainer batches with, for the loaded model or a skeleton
    recipe.model()                     the model set up to train (adapters, quantization)
    recipe.trainer(model, data)        sft / pt: the Trainer on them (PairRecipe builds its PreferenceTrainer)
    recipe.run()                       tunelab train: train, save, evaluate → the run's metrics
    recipe.summary(metrics)            the lines tunelab train ends with
    recipe.inspection()                tunelab data stats|verify|coverage: the samples before packing, the packed
                                       rows, the collator chosen on a meta-device skeleton (data/run_data.py)

`tunelab estimate` (train/estimate.py) reads datasets(), model() and collator() too; none of these commands builds
a stage's data or model by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from functools import cached_property
from typing import Any, ClassVar

import transformers
from torch import nn

from tunelab import run_folder
from tunelab.config.stages import stage_row, uses_reference
from tunelab.data.collate import (
    PackedCollator, PaddingFreeCollator, PairedCollator, SupervisedCollator, build_collator, build_paired_collator,
)
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.pairwise import ReferenceAnswerEncoder, pair_sides, preference_bundle, preference_encoder
from tunelab.data.pipeline import DatasetBundle, build_datasets
from tunelab.data.prompts import build_prompt_datasets
from tunelab.data.run_data import RunData, pack_rows
from tunelab.data.templates import Template, get_template
from tunelab.data.vision import save_processor_files, token_type_key, vision_collator, vision_inputs
from tunelab.infer.generate import exact_match, held_out_predictions, held_out_rows, stop_token_ids
from tunelab.model import skeleton
from tunelab.model.resolve import resolve_dtype
from tunelab.model.tokenizer import load_processor, load_tokenizer
from tunelab.train import outputs
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
        return skeleton.skeleton(self.config.model, self.config.finetuning, self.config.training)

    def model(self) -> nn.Module:
        # lazy: model/load imports peft (7.8 s); `tunelab data` imports this module
        from tunelab.model.load import load_model

        return load_model(self.config.model, self.config.finetuning, self.config.training, self.tokenizer,
                          is_trainable=True)

    @staticmethod
    def parameter_counts(model: nn.Module) -> dict[str, int]:
        """Logged once, and the first entries of the run's metrics."""
        from tunelab.model.load import count_parameters  # lazy: as in model()

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

    # ---- held-out greedy exact match before → after (eval_generation), the same in every stage --------------

    def held_out_rows(self, data: DatasetBundle):
        """The rows exact match is measured on (the first eval set's first eval_generation_samples), or None."""
        return held_out_rows(data.eval_rows, self.config.generation)

    def exact_match_before(self, model: nn.Module, rows, metrics: dict, vision=None) -> None:
        if rows is not None:
            metrics.update(self.held_out_scores(model, rows, "before", vision))

    def exact_match_after(self, model: nn.Module, rows, metrics: dict, vision=None) -> None:
        if rows is None:
            return
        metrics.update(self.held_out_scores(model, rows, "after", vision))
        logger.info(
            "exact match on %d held-out rows: %.1f%% before training → %.1f%% after",
            len(rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
        )

    def held_out_scores(self, model: nn.Module, rows, when: str, vision=None) -> dict[str, float]:
        """Greedy answers to `rows` with the run's generation settings, scored: exact match, then what the stage
        adds (score_answers)."""
        config = self.config
        predictions = held_out_predictions(model, self.tokenizer, self.template, rows, config.generation, config.data,
                                           config.training, vision)
        return {f"exact_match_{when}": exact_match(predictions), **self.score_answers(predictions, when)}

    def score_answers(self, predictions, when: str) -> dict[str, float]:
        """The stage's own scores of the held-out greedy answers beside exact match (none here)."""
        return {}

    # ---- the rows: conversations, as sft trains on them (pt and the pair stages read their own) ----------------

    def encode(self, data_args) -> DatasetBundle:
        """The stage's encoded datasets for `data_args`, built afresh (no cache)."""
        return build_datasets(data_args, self.tokenizer, self.template, seed=self.config.training.seed,
                              vision=self.vision)

    def collator(self, model: nn.Module):
        data_args = self.config.data
        collator = build_collator(model, self.tokenizer.pad_token_id, data_args.packing, data_args.padding_free)
        if self.vision is not None:
            collator = vision_collator(collator, model, self.vision, data_args.padding_free)
        return collator

    def inspection_collator(self):
        """The collator `tunelab data verify` batches with, chosen without loading weights."""
        return self.example_collator()  # (the images' own checks are data/verify.py's verify_images)

    # ---- what each stage defines ---------------------------------------------------------------------------

    def datasets(self) -> DatasetBundle:
        """What the stage trains on, through the tokenized cache (built once, reused while the inputs are the same)."""
        raise NotImplementedError

    def run(self) -> dict:
        """tunelab train: train, save, evaluate → the run's metrics."""
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


class SupervisedRecipe(Recipe):
    """The stages that train the token loss in transformers' Trainer (sft, pt)."""

    def trainer(self, model: nn.Module, data: DatasetBundle, *callbacks):
        """The Trainer of the stages that train on examples (sft, pt): the run's datasets, collator and callbacks
        (train/callbacks.py: the log, early stopping, the user's) plus the stage's own."""
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        # lazy: the Trainer (through peft, 7.8 s); `tunelab data` imports this module
        from tunelab.train.callbacks import run_callbacks
        from tunelab.train.trainer import TunelabTrainer

        return TunelabTrainer(
            model=model,
            args=self.config.training,
            train_dataset=data.train,
            eval_dataset=single_or_named(data.eval),
            data_collator=self.collator(model),
            processing_class=self.tokenizer,
            callbacks=run_callbacks(self.config.training, self.config.finetuning, self.plan.user_callbacks, *callbacks),
            finetuning=self.config.finetuning,
        )

    @staticmethod
    def final_eval_metrics(trainer) -> dict:
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


class PairRecipe(Recipe):
    """The stages whose rows are two sequences (rm, dpo, kto: data/pairwise.py), trained by the PreferenceTrainer:

    tokenizer + template → pairs → policy (+ adapters) → reference: a frozen copy (full / freeze), the policy with
    its adapter disabled (LoRA), or none (rm; orpo, simpo) → [precompute reference log-probs] → [held-out accuracy
    and exact match before] → train → save → [after] → metrics."""

    # The held-out pair accuracy the stage reports before → after: (metric name, its eval key, what it measures).
    held_out_accuracy: ClassVar[tuple[str, str, str] | None] = None

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

    def collator(self, model):
        collator = build_paired_collator(model, self.tokenizer.pad_token_id, *self.sides,
                                         padding_free=self.config.data.padding_free)
        if self.vision is not None:
            if collator.padding_free is not None and token_type_key(model, self.vision[0]) is not None:
                collator.padding_free = None  # images attending both ways: padded (vision_collator's reason)
            collator = vision_collator(collator, model, self.vision)
        return collator

    def inspection_collator(self) -> PairedCollator:
        # The pairs' sequences laid out as examples are (never packed).
        example = self.example_collator()
        return PairedCollator(self.tokenizer.pad_token_id, *self.sides,
                              padding_free=example if isinstance(example, PaddingFreeCollator) else None)

    def run(self) -> dict:
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        # lazy: peft (7.8 s) and the Trainer (through peft, 7.8 s); `tunelab data` imports this module
        from tunelab.model.adapters import is_quantized
        from tunelab.model.load import load_model
        from tunelab.train.callbacks import run_callbacks
        from tunelab.train.preference_trainer import (
            KTO_REFERENCE_COLUMNS, PAIR_REFERENCE_COLUMNS, PreferenceTrainer, precompute_reference_log_probs,
        )
        config, stage = self.config, self.stage
        args, ft = config.training, config.finetuning
        tokenizer, template, vision = self.tokenizer, self.template, self.vision
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        collator = self.collator(model)

        # LoRA: the reference is the policy with its adapter disabled; full / freeze: a frozen copy, except
        # when precomputing, where the policy before training is the reference.
        ref_model = None
        uses_lora = ft.finetuning_type == "lora" or is_quantized(model)
        if uses_reference(ft) and not uses_lora and not ft.precompute_ref_log_probs:
            # In the policy's dtype (float32 master weights under bf16): the two start equal, rewards at exactly 0.
            ref_model = load_model(config.model, ft, args, tokenizer, is_trainable=False,
                                   dtype=resolve_dtype(config.model, args, ft))
        train_set, evals = data.train, dict(data.eval)
        if uses_reference(ft) and ft.precompute_ref_log_probs:
            columns = KTO_REFERENCE_COLUMNS if stage_row(stage).reads == "unpaired" else PAIR_REFERENCE_COLUMNS
            model.to(args.device)

            def precompute(dataset):
                return precompute_reference_log_probs(
                    dataset, model, None, collator, columns, args.per_device_eval_batch_size, args.device
                )

            train_set = precompute(train_set)
            evals = {name: precompute(dataset) for name, dataset in evals.items()}
            logger.info("reference log-probs precomputed for %d training rows", len(train_set))

        trainer = PreferenceTrainer(
            stage=stage, finetuning=ft, ref_model=ref_model,
            model=model, args=args, train_dataset=train_set, eval_dataset=single_or_named(evals),
            data_collator=collator, processing_class=tokenizer,
            callbacks=run_callbacks(args, ft, self.plan.user_callbacks),
        )

        held_out = next(iter(evals.values())) if evals else None
        accuracy = self.held_out_accuracy if held_out is not None else None
        rows = self.held_out_rows(data)
        if accuracy is not None:
            name, key, _ = accuracy
            metrics[f"{name}_before"] = trainer.evaluate(held_out, metric_key_prefix="before")[f"before_{key}"]
        self.exact_match_before(trainer.model, rows, metrics)

        metrics.update(trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics)
        outputs.save_model(trainer, tokenizer, template, args.output_dir)
        if vision is not None and trainer.is_world_process_zero():
            save_processor_files(vision[0], args.output_dir)

        if held_out is not None:
            after = trainer.evaluate(held_out, metric_key_prefix="after")
            metrics.update(after)
            if accuracy is not None:
                name, key, what = accuracy
                metrics[f"{name}_after"] = after[f"after_{key}"]
                logger.info("%s on %d held-out pairs: %.1f%% before training → %.1f%% after", what, len(held_out),
                            100 * metrics[f"{name}_before"], 100 * metrics[f"{name}_after"])
        self.exact_match_after(trainer.model, rows, metrics)
        outputs.finish(trainer, metrics, args)
        return metrics


class RLRecipe(Recipe):
    """The stages that sample answers and train on their scores in their own loop (grpo, ppo: train/rl/):

    tokenizer + template → prompts (the shared pipeline, rendered with the generation prompt) → the stage's scorer →
    policy (+ adapters) and reference → [exact match before] → the loop (rl/loop.py with the stage's algorithm) →
    save → [exact match after] → metrics. The held-out greedy answers are also scored by the reward functions that
    can score them (code_tests: pass@1 before → after). `tunelab data` reads their rows as sft does (each prompt with its
    reference answer, which held-out exact match compares with)."""

    _held_out_rewards: tuple = ()  # the reward functions score_answers uses, chosen in run()

    def encode(self, data_args) -> DatasetBundle:
        # A ranking set's rows (an eval set, say) hold their reference as the chosen answer: it is their last turn.
        encoder = ReferenceAnswerEncoder(SupervisedEncoder(
            tokenizer=self.tokenizer, template=self.template, cutoff_len=data_args.cutoff_len,
            train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history,
            template_vars=data_args.template_kwargs or {},
        ))
        return build_datasets(data_args, self.tokenizer, self.template, self.config.training.seed, encoder=encoder)

    def algorithm(self):
        """The step: `algorithm(loop, reference, tokenizer, stop_ids, scorer, finetuning, generation)` (rl/grpo.py,
        rl/ppo.py)."""
        raise NotImplementedError

    def scorer(self, device):
        """What scores the samples (reward functions, a reward model)."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict]:
        """The schemas of the tools the prompts render beside each row's own (grpo's option tools)."""
        return []

    def policy(self, model: nn.Module) -> nn.Module:
        """The module the loop trains."""
        return model

    def after_save(self, loop) -> None:
        """What the stage saves beside the model."""

    def score_answers(self, predictions, when: str) -> dict[str, float]:
        """The reward functions' scores of the held-out greedy answers (code_tests: pass@1), set by run()."""
        from tunelab.train.rl import workflow  # lazy: peft (7.8 s); `tunelab data` imports this module

        return workflow.reward_metrics(predictions, self._held_out_rewards, when)

    def run(self) -> dict:
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        # lazy: peft (7.8 s) and the Trainer (through peft, 7.8 s); `tunelab data` imports this module
        from tunelab.model.adapters import is_quantized
        from tunelab.train.rl import workflow
        from tunelab.train.rl.loop import RLLoop, build_accelerator

        config = self.config
        args, ft = config.training, config.finetuning
        transformers.set_seed(args.seed)
        accelerator = build_accelerator(args)
        tokenizer, template = self.tokenizer, self.template
        prompts = build_prompt_datasets(config.data, tokenizer, template, args.seed, self.tool_schemas())
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, prompts.report)
        scorer = self.scorer(accelerator.device)
        self._held_out_rewards = workflow.held_out_rewards(scorer)

        model = self.model()
        if not is_quantized(model):  # bitsandbytes places quantized weights itself and refuses .to()
            model = model.to(accelerator.device)
        metrics: dict = self.parameter_counts(model)
        reference = workflow.build_reference(model, ft.kl_coef, accelerator.device)
        rows = self.held_out_rows(prompts)
        self.exact_match_before(model, rows, metrics)

        loop = RLLoop(args, ft, accelerator, self.policy(model), prompts.train, ft.num_iterations)
        step = self.algorithm()(loop, reference, tokenizer, stop_token_ids(tokenizer, template), scorer, ft,
                                config.generation)
        metrics.update(loop.train(step))
        metrics.update(loop.final_metrics(("reward", "kl")))
        trained = workflow.save_policy(loop, tokenizer, template, args.output_dir)
        self.after_save(loop)
        self.exact_match_after(trained, rows, metrics)
        if rows is not None:
            workflow.log_reward_metrics(self._held_out_rewards, metrics, len(rows))
        workflow.finish(loop, metrics, args)
        return metrics


def single_or_named(evals: dict):
    """The trainer's eval_dataset: None, the one set (logged as plain eval_*), or the sets by name."""
    if not evals:
        return None
    return next(iter(evals.values())) if len(evals) == 1 else evals

