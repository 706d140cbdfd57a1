"""Knowledge distillation (stage kd): the student learns the teacher's next-token distributions on the dataset's
answers. The workflow, top to bottom:

teacher folder resolved → teacher tokenizer == student tokenizer (checked before any weights load) → datasets (sft's
rows: the labels' mask marks the answer tokens) → student (+ adapters) → teacher (frozen: eval mode, no gradients,
outside the optimizer) → [divergence to the teacher and exact match on held-out rows, before] → train → save →
[after] → metrics.

Each batch goes through both models with the same inputs (padded, packed or padding-free: the position ids and
sequence boundaries the collator made), both keep logits only where a label is supervised, and the loss is the
generalised JSD of train/distillation_losses.py, per supervised token (TRL's GKD names: beta, temperature). With
lmbda > 0 that share of the examples is answered by the student itself first (GKD's on-policy data:
train/distillation_trainer.py).
The rows, collator and held-out exact match are train/recipe.py's, the Trainer its SupervisedRecipe's.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from tunelab import run_folder
from tunelab.config.args import ModelArguments
from tunelab.data.cache import cached_bundle
from tunelab.data.pipeline import DatasetBundle
from tunelab.data.streaming import build_streaming_supervised
from tunelab.errors import ConfigError, ModelError
from tunelab.infer.generate import stop_token_ids
from tunelab.infer.predict import predict
from tunelab.model.folder import resolve_model_folders
from tunelab.model.tokenizer import load_tokenizer
from tunelab.train import outputs
from tunelab.train.recipe import SupervisedRecipe, single_or_named

logger = logging.getLogger(__name__)

# The tokenizer attributes that decide which ids a model reads and stops at, compared between teacher and student.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between two tokenizers for distillation (the ids of every token, the special tokens), or None
    when the two models' next-token distributions are over the same tokens."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if len(student_vocab) != len(teacher_vocab):
        return f"vocabularies of {len(student_vocab):,} vs {len(teacher_vocab):,} tokens"
    moved = sorted((token for token, i in student_vocab.items() if teacher_vocab.get(token) != i),
                   key=student_vocab.get)
    if moved:
        token = moved[0]
        where = teacher_vocab.get(token)
        return (f"{len(moved):,} tokens have other ids, e.g. {token!r} is {student_vocab[token]} vs "
                f"{'absent' if where is None else where}")
    for name in SPECIAL_TOKENS:
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)!r} vs {getattr(teacher, name)!r}"
    extra_student, extra_teacher = set(student.all_special_tokens), set(teacher.all_special_tokens)
    if extra_student != extra_teacher:
        only = sorted(extra_student ^ extra_teacher)
        return f"special tokens differ: {', '.join(map(repr, only[:3]))}{' ...' if len(only) > 3 else ''}"
    return None


class DistillationRecipe(SupervisedRecipe):
    stage = "kd"
    inspection_packs = True  # sft's rows, packed by `tunelab data` as sft's are

    def datasets(self) -> DatasetBundle:
        config, args = self.config, self.config.training
        if config.data.streaming:  # an iterable train set, read as training goes: nothing to cache
            return build_streaming_supervised(config.data, self.tokenizer, self.template, args)
        return cached_bundle(config.data, self.tokenizer, self.template.jinja, self.stage, args.seed,
                             build=lambda: self.encode(config.data), is_main_process=args.local_process_index == 0)

    # ---- the teacher ------------------------------------------------------------------------------------------

    def teacher_arguments(self) -> ModelArguments:
        """The student's model options with the teacher's model: its folder or GGUF file resolved and checked (a Hub
        id fetched, without weights), no adapter. One line naming teacher_model_name_or_path when it is not a model."""
        path = self.config.finetuning.teacher_model_name_or_path
        teacher = dataclasses.replace(self.config.model, model_name_or_path=path, adapter_name_or_path=None,
                                      gguf_file=None)
        try:
            folder, _ = resolve_model_folders(teacher)
        except ConfigError as exc:
            raise ConfigError(f"teacher_model_name_or_path: {exc}".replace(": model_name_or_path:", ":"),
                              key="teacher_model_name_or_path") from None
        return dataclasses.replace(teacher, model_name_or_path=folder)

    def check_teacher_tokenizer(self, teacher: ModelArguments) -> None:
        """Distillation compares the two models' distributions token by token: one tokenizer. Checked before any
        weights load; a mismatch is one line naming both models and what differs."""
        try:
            teacher_tokenizer = load_tokenizer(teacher)
        except ModelError as exc:
            raise ConfigError(f"teacher_model_name_or_path: {exc}".replace(": model_name_or_path:", ":"),
                              key="teacher_model_name_or_path") from None
        difference = tokenizer_difference(self.tokenizer, teacher_tokenizer)
        if difference is not None:
            raise ConfigError(
                f"teacher_model_name_or_path: the teacher {teacher.model_name_or_path} and the student "
                f"{self.config.model.model_name_or_path} have different tokenizers ({difference}); distillation "
                "needs one tokenizer: pick a teacher of the student's family",
                key="teacher_model_name_or_path",
            )

    def teacher(self, teacher: ModelArguments, student: nn.Module) -> nn.Module:
        """The frozen teacher (eval mode, no gradients, never in the optimizer) on the training device."""
        # lazy: peft and bitsandbytes (7.8 s); `tunelab data` imports this module
        from tunelab.model.adapters import is_quantized
        from tunelab.model.load import load_model

        config = self.config
        # (frozen: load_model's dtype for inference, the half dtype under bf16 / fp16; the student's quantization)
        model = load_model(teacher, config.finetuning, config.training, self.tokenizer, is_trainable=False)
        rows = model.get_output_embeddings().weight.shape[0]
        student_rows = student.get_output_embeddings().weight.shape[0]
        if rows != student_rows:
            raise ModelError(
                f"teacher_model_name_or_path: the teacher {teacher.model_name_or_path} predicts {rows:,} token ids, "
                f"the student {config.model.model_name_or_path} {student_rows:,}: distillation needs the same output "
                "vocabulary; pick a teacher of the student's family"
            )
        return model if is_quantized(model) else model.to(config.training.device)  # bitsandbytes places its own

    # ---- the workflow -----------------------------------------------------------------------------------------

    def trainer(self, model: nn.Module, data: DatasetBundle, *callbacks, teacher: nn.Module | None = None):
        # lazy: the Trainer imports peft and bitsandbytes (7.8 s); `tunelab data` imports this module
        from tunelab.train.callbacks import run_callbacks
        from tunelab.train.distillation_trainer import DistillationTrainer

        ft, generation = self.config.finetuning, self.config.generation
        return DistillationTrainer(
            teacher=teacher, beta=ft.beta, temperature=generation.temperature, lmbda=ft.lmbda,
            stop_ids=stop_token_ids(self.tokenizer, self.template), max_new_tokens=generation.max_new_tokens,
            model=model, args=self.config.training, train_dataset=data.train, eval_dataset=single_or_named(data.eval),
            data_collator=self.collator(model), processing_class=self.tokenizer,
            callbacks=run_callbacks(self.config.training, ft, self.plan.user_callbacks, *callbacks), finetuning=ft,
        )

    def run(self) -> dict:
        # lazy: TrainerCallback imports peft and bitsandbytes (7.8 s), as in sft's recipe
        from tunelab.train.generation_metrics import GenerationMetricsCallback

        config, args = self.config, self.config.training
        tokenizer, template = self.tokenizer, self.template
        teacher_args = self.teacher_arguments()
        self.check_teacher_tokenizer(teacher_args)  # 1) before any weights load
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics: dict = self.parameter_counts(model)
        teacher = self.teacher(teacher_args, model)
        generation = ([GenerationMetricsCallback.from_options(data.eval_rows, tokenizer, template, config.generation,
                                                              config.data, args)]
                      if config.generation.generate_at_eval and data.eval_rows else [])
        trainer = self.trainer(model, data, *generation, teacher=teacher)

        # 2) the divergence to the teacher on the first eval set, and greedy exact match, before → after
        held_out = next(iter(data.eval.values())) if data.eval else None
        if held_out is not None:
            metrics["distillation_loss_before"] = trainer.evaluate(held_out, metric_key_prefix="before")["before_loss"]
        rows = self.held_out_rows(data)
        self.exact_match_before(trainer.model, rows, metrics)

        metrics.update(trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics)
        if config.finetuning.lmbda > 0:
            metrics["on_policy_examples"] = trainer.on_policy_examples
            logger.info("lmbda %g: %d training examples answered by the student itself", config.finetuning.lmbda,
                        trainer.on_policy_examples)
        outputs.save_model(trainer, tokenizer, template, args.output_dir)

        if data.eval:
            metrics.update(self.final_eval_metrics(trainer))
        if held_out is not None:
            metrics["distillation_loss_after"] = trainer.evaluate(held_out, metric_key_prefix="after")["after_loss"]
            logger.info("divergence to the teacher on %d held-out rows (per answer token): %.4f before training → "
                        "%.4f after", len(held_out), metrics["distillation_loss_before"],
                        metrics["distillation_loss_after"])
        self.exact_match_after(trainer.model, rows, metrics)
        if args.do_predict and trainer.is_world_process_zero():  # predictions.jsonl + predict_results.json
            metrics.update(predict(
                trainer.model, tokenizer, template, data.eval_rows, args.output_dir,
                max_new_tokens=config.generation.max_new_tokens, batch_size=args.per_device_eval_batch_size,
                template_vars=config.data.template_kwargs,
            ))
        outputs.finish(trainer, metrics, args)
        return metrics

    def summary(self, metrics: dict) -> list[str]:
        lines = super().summary(metrics)
        if "distillation_loss_before" in metrics and "distillation_loss_after" in metrics:
            before, after = metrics["distillation_loss_before"], metrics["distillation_loss_after"]
            lines.insert(0, f"divergence to the teacher (held-out, per answer token): before {before:.4f} → after "
                            f"{after:.4f}")
        return lines
