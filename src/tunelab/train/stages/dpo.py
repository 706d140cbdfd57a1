"""Direct preference optimisation (and ipo, hinge, orpo, simpo): the workflow, top to bottom.

tokenizer + template → pairs (data/pairwise.py) → policy (+ adapters) → reference: a frozen copy
(full / freeze), the policy with its adapter disabled (LoRA), or none (orpo, simpo) →
[precompute reference log-probs] → [preference accuracy and exact match before] → train → save →
[after] → metrics. Stage kto (stages/kto.py) runs the same workflow on unpaired examples.
"""

from __future__ import annotations

import logging

from tunelab import run_folder
from tunelab.config.stages import uses_reference
from tunelab.data.collate import PaddingFreeCollator, PairedCollator, build_paired_collator
from tunelab.data.vision import save_processor_files, token_type_key, vision_collator
from tunelab.infer.generate import held_out_exact_match, held_out_rows
from tunelab.model.resolve import resolve_dtype
from tunelab.train import outputs
from tunelab.train.recipe import single_or_named
from tunelab.train.stages.rm import PairRecipe

logger = logging.getLogger(__name__)


class DPORecipe(PairRecipe):
    """Stage dpo (and its relatives), and kto with `stage = "kto"`."""

    stage = "dpo"

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
        from tunelab.model.adapters import is_quantized  # noqa: PLC0415
        from tunelab.model.load import load_model  # noqa: PLC0415
        from tunelab.train.callbacks import run_callbacks  # noqa: PLC0415
        from tunelab.train.preference_trainer import (  # noqa: PLC0415
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
            columns = KTO_REFERENCE_COLUMNS if stage == "kto" else PAIR_REFERENCE_COLUMNS
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
            data_collator=collator, processing_class=tokenizer, callbacks=run_callbacks(config, self.plan.user_callbacks),
        )

        held_out = next(iter(evals.values())) if evals else None
        rows = held_out_rows(data.eval_rows, config)
        if held_out is not None and stage == "dpo":
            before = trainer.evaluate(held_out, metric_key_prefix="before")
            metrics["preference_accuracy_before"] = before["before_logps/accuracies"]
        if rows is not None:
            metrics["exact_match_before"] = held_out_exact_match(trainer.model, tokenizer, template, rows, config)

        metrics.update(trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics)
        outputs.save_model(trainer, tokenizer, template, config)
        if vision is not None and trainer.is_world_process_zero():
            save_processor_files(vision[0], args.output_dir)

        if held_out is not None:
            after = trainer.evaluate(held_out, metric_key_prefix="after")
            metrics.update(after)
            if stage == "dpo":
                metrics["preference_accuracy_after"] = after["after_logps/accuracies"]
                logger.info(
                    "preference accuracy (log p(chosen) > log p(rejected)) on %d held-out pairs: %.1f%% → %.1f%%",
                    len(held_out), 100 * metrics["preference_accuracy_before"], 100 * metrics["preference_accuracy_after"],
                )
        if rows is not None:
            metrics["exact_match_after"] = held_out_exact_match(trainer.model, tokenizer, template, rows, config)
            logger.info(
                "exact match on %d held-out prompts: %.1f%% before training → %.1f%% after",
                len(rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
            )
        outputs.finish(trainer, metrics, config)
        return metrics

