"""What tunelab adds to transformers' TrainingArguments, and the defaults of theirs it changes.

A plain dataclass of its own, so that `tunelab data` knows these options without importing transformers' training
arguments (and peft through them; config/training_values.py), while training builds both into one dataclass
(config/training_args.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def option_help(text: str, applies=None, **kwargs):
    """A dataclass field whose help text (`tunelab train --help`, the web UI) is `text`; `applies`
    (config/applicability.py) says under which stage or method it acts."""
    metadata = {"help": text} if applies is None else {"help": text, "applies": applies}
    return field(metadata=metadata, **kwargs)


@dataclass
class TrainingOptions:
    """What tunelab adds to transformers.TrainingArguments (LlamaFactory's names where it has them).

    A plain dataclass so that commands reading only a run's data know these options without importing
    transformers' training arguments (and peft with them): `TrainingArguments` below is both.
    """

    overwrite_output_dir: bool = option_help("Allow training into a non-empty output_dir.", default=False)
    plot_loss: bool = option_help(
        "Draw the curves of trainer_log.jsonl at the end of training (as in LlamaFactory): training_loss.png, and when "
        "the run evaluated eval_loss.png, eval_token_accuracy.png and eval_generation.png.",
        default=True,
    )
    compute_token_accuracy: bool = option_help(
        "Evaluation also reports eval_token_accuracy: the share of supervised tokens whose argmax prediction is "
        "the label (counted batch by batch; logits are never gathered).",
        default=False,
    )
    # Extending and watching the loop (docs/training.md): train/callbacks.py.
    callbacks: list[str] | None = option_help(
        "Your own transformers TrainerCallback classes, comma separated: path/to/file.py:Class (relative to the "
        "working directory, then the config file's folder) or package.module:Class. Each is built with its "
        "callback_kwargs and handed to the Trainer (stages pt, sft, rm, dpo, kto). Nothing is imported unless named here.",
        default=None,
    )
    callback_kwargs: dict[str, dict[str, Any]] | None = option_help(
        "Keyword arguments of the callbacks, by class name (or the full callbacks entry), e.g. "
        "{SampleGenerations: {every: 50}}. On the command line as JSON.",
        default=None,
    )
    early_stopping_patience: int | None = option_help(
        "Stop training when metric_for_best_model (default eval_loss) has not improved for this many evaluations in a "
        "row (LlamaFactory's early_stopping_steps). Needs an eval set and eval_strategy. The final model is the one "
        "at the stop, or the best checkpoint's with load_best_model_at_end: true.",
        default=None,
    )
    early_stopping_threshold: float = option_help(
        "early_stopping_patience: an evaluation counts as an improvement only when it beats the best by more than this.",
        default=0.0,
    )
    # Reliability (docs/reliability.md): train/checkpoints.py, train/guards.py.
    resume_from_checkpoint: bool | str | None = option_help(
        "Resume from a checkpoint: true for the newest complete checkpoint-N in output_dir, or a checkpoint folder. "
        "Restores weights, optimizer, scheduler, RNG states and the exact data position. The checkpoint's files "
        "must match its manifest (sizes and checksums); true skips damaged ones (logged).",
        default=None,
    )
    resume_config_mismatch: Literal["refuse", "allow"] = option_help(
        "A checkpoint whose run had other values of options that change training (data, model, method, optimizer, "
        "schedule, batch, seed) is refused, naming them; allow resumes it anyway (logged).",
        default="refuse",
    )
    resume_weights_only: bool = option_help(
        "Resume a checkpoint that has no optimizer state (save_only_model, or its optimizer file removed): the "
        "weights and step count continue, the optimizer starts from zero (warned). Refused otherwise.",
        default=False,
    )
    nan_policy: Literal["stop", "skip"] = option_help(
        "On a NaN/inf loss or gradient norm: stop (with a message naming the step), or skip that optimizer step "
        "(counted and logged) and go on.",
        default="stop",
    )
    nan_max_consecutive: int = option_help(
        "nan_policy: skip still stops at this many non-finite steps in a row.", default=5
    )
    # Launching (train/launch.py): `tunelab train` re-executes itself under torchrun when asked for
    # more than one process; under torchrun / accelerate launch these must agree with the launcher.
    nproc_per_node: int | None = option_help(
        "Processes per machine (one per GPU; CPU: gloo DDP). >1 re-launches under torchrun. "
        "Default $TUNELAB_NPROC_PER_NODE, else 1.",
        default=None,
    )
    nnodes: int = option_help(
        "Machines in the run (multi-node: also set node_rank, master_addr, master_port).", default=1
    )
    node_rank: int = option_help("This machine's index among nnodes (0 on the machine at master_addr).", default=0)
    master_addr: str | None = option_help("Multi-node: address of the node_rank 0 machine.", default=None)
    master_port: int | None = option_help(
        "Rendezvous port; default a free port (one node) or 29500 (several).", default=None
    )


# Defaults we change from transformers' own, for a fine-tuning tool run from a terminal. Checkpoints are
# opt-in (a signal always saves one, and the final model is always saved); an explicit save_steps turns
# them on (config/loader.py), as it does in LlamaFactory.
TRAINING_DEFAULTS = {
    "logging_steps": 10,
    "report_to": "none",
    "save_strategy": "no",
    "remove_unused_columns": False,
    "ddp_find_unused_parameters": False,
    "prediction_loss_only": True,  # evaluation computes losses per batch; never gathers logits (PEERS #13)
}


def tracker_names(report_to: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """report_to as a list of names: `none` → []; `a,b` (the command line's way to give a list) → [a, b]."""
    if report_to is None:
        return []
    entries = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [name.strip() for entry in entries for name in str(entry).split(",") if name.strip()]
    return [] if names == ["none"] else names


# What tunelab adds to transformers' help of its options (`tunelab train --help`).
TRAINING_NOTES = {
    "save_strategy": "tunelab: checkpoints are opt-in; the final model is always saved, and SIGTERM / SIGINT save one.",
    "save_steps": "tunelab: setting it without save_strategy turns on save_strategy: steps (as in LlamaFactory).",
    "eval_steps": "Only with eval_strategy: steps (otherwise tunelab warns that it has no effect).",
    "warmup_steps": "A float < 1 is a ratio of the total steps (warmup_ratio is accepted as its old name).",
    "bf16": "auto: bf16 where the device runs it natively and fast (GPU compute capability >= 8.0, "
            "a CPU with avx512_bf16 / amx_bf16 whose measured bf16 matmul beats fp32); true / false always wins.",
    "fp16": "auto: fp16 with loss scaling on CUDA GPUs older than compute capability 8.0; "
            "true / false always wins.",
}
