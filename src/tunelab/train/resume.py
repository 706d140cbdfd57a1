"""Which checkpoint a run resumes from, checked before any model loads.

`resume_from_checkpoint: true` resolves to the newest checkpoint of output_dir whose manifest verifies (every file
there, of its size and checksum: run_folder.py writes the manifest last), logging each newer one it skipped and why;
an explicit folder that does not verify is an error. A checkpoint without optimizer state (save_only_model, or its
optimizer file removed) is refused unless `resume_weights_only: true`. The copy of tunelab_config.yaml a checkpoint
holds lets `check_resume` refuse to continue a checkpoint of another run (`config_differences`), unless
`resume_config_mismatch: allow`. Writing checkpoints is train/checkpoints.py's.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from tunelab.errors import ConfigError
from tunelab.run_folder import (
    MANIFEST, RUN_RECORD, STAGING_PREFIX, TRAINER_STATE, checkpoint_folders, read_manifest, read_run_record,
)
from tunelab.run_folder import checksums as file_checksums  # checkpoint_problem has a `checksums` switch

logger = logging.getLogger(__name__)

# Files a weights-only resume may lack (the Trainer then starts them fresh): optimizer, LR scheduler,
# gradient scaler, RNG states; DeepSpeed keeps its optimizer shards in global_stepN/.
OPTIMIZER_STATE_PREFIXES = ("optimizer", "scheduler", "scaler", "rng_state", "global_step")


def _is_optimizer_state(name: str) -> bool:
    return name.split("/", 1)[0].startswith(OPTIMIZER_STATE_PREFIXES)


def checkpoint_problem(folder: str | Path, weights_only: bool = False, checksums: bool = True) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None: its manifest must list files that are all
    there with their size (and, with `checksums`, their SHA-256). `weights_only`: optimizer-state files
    may be absent (the Trainer then starts them fresh); present, they must still be intact."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        if (folder / MANIFEST).exists():
            return f"its {MANIFEST} is unreadable"
        return f"it has no {MANIFEST} (not written completely by this version of tunelab)"
    files = manifest["files"]
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            if weights_only and _is_optimizer_state(name):
                continue
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{name} is {size:,} bytes, the manifest says {entry.get('size'):,}"
    if checksums:
        present = [name for name in files if (folder / name).is_file()]
        for name, digest in file_checksums(folder, present).items():
            if digest != files[name].get("sha256"):
                return f"{name} does not match its checksum (damaged after it was written)"
    return None


def has_optimizer_state(folder: str | Path) -> bool:
    """Whether resuming from folder restores the optimizer (its manifest says so and the file is there)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is not None and not manifest.get("optimizer_state", True):
        return False
    return any(p.name.startswith(("optimizer", "global_step")) for p in folder.iterdir())


# --- finding checkpoints ----------------------------------------------------------------------


_WEIGHTS_ONLY_HINT = "resume_weights_only: true resumes the weights with a fresh optimizer"


def resolve_resume(
    value: Any, output_dir: str | Path, weights_only: bool = False, checksums: bool = True
) -> str | None:
    """`resume_from_checkpoint` → the checkpoint folder to resume from, or None for a fresh start.

    true (or "true"/"last") means the newest checkpoint of output_dir that verifies (`checkpoint_problem`;
    each newer one skipped is logged with why); a path must verify itself, except a folder without a manifest
    (written by transformers or an older tunelab), which is taken with a warning that it cannot be checked.
    Either way the checkpoint must hold optimizer state unless `weights_only`. Fails with a ConfigError
    naming the key, the checkpoint and the fix.
    """
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "false", "no", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "last")):
        skipped = []
        for folder in reversed(checkpoint_folders(output_dir)):
            problem = checkpoint_problem(folder, weights_only, checksums)
            if problem is None:
                for line in skipped:
                    logger.warning("resume_from_checkpoint: true skips %s", line)
                _check_optimizer_state(folder, weights_only)
                return str(folder)
            skipped.append(f"{folder.name}: {problem}")
        found = f" ({'; '.join(skipped)})" if skipped else ""
        raise ConfigError(
            f"resume_from_checkpoint: true, but output_dir {output_dir} holds no complete checkpoint{found}; save "
            "some with save_strategy: steps and save_steps, point resume_from_checkpoint at a checkpoint folder, "
            "or remove it"
        )
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a folder; give a checkpoint-N folder or true")
    if read_manifest(path) is None and not (path / MANIFEST).exists():
        try:
            json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ConfigError(
                f"resume_from_checkpoint: {path} is not a complete checkpoint (no {MANIFEST}, no readable "
                f"{TRAINER_STATE}); give another checkpoint-N folder, or true for the newest complete one"
            ) from None
        logger.warning(
            "resume_from_checkpoint: %s has no %s (written by transformers or an older tunelab): its files cannot "
            "be checked before they load", path, MANIFEST,
        )
    else:
        problem = checkpoint_problem(path, weights_only, checksums)
        if problem is not None:
            fix = "give an older checkpoint-N folder, or true for the newest one that verifies"
            name = problem.split(" ", 1)[0]
            if _is_optimizer_state(name) and not weights_only:
                remove = "" if problem.endswith("is missing") else f"delete {name} and "
                fix += f"; or {remove}set resume_weights_only: true to resume the weights with a fresh optimizer"
            raise ConfigError(f"resume_from_checkpoint: {path} is damaged: {problem}; {fix}")
    _check_optimizer_state(path, weights_only)
    return str(path)


def _check_optimizer_state(folder: Path, weights_only: bool) -> None:
    if has_optimizer_state(folder):
        return
    if not weights_only:
        raise ConfigError(
            f"resume_from_checkpoint: {folder} has no optimizer state (saved with save_only_model, or its optimizer "
            "file was removed): the optimizer would restart from zero and the run would not continue as it was; "
            f"{_WEIGHTS_ONLY_HINT}, or give a checkpoint that has it"
        )
    logger.warning(
        "resume_weights_only: %s has no optimizer state: the weights and the step count resume, the optimizer "
        "starts from zero (its moments rebuilt over the next steps); this run will not match an uninterrupted one",
        folder,
    )


# Options that change the training trajectory: resuming a checkpoint written with other values would
# continue another run. Left out on purpose: max_steps / num_train_epochs (raised to continue a finished run),
# where and how often to log, save and evaluate, and what changes speed or memory but not the numbers
# (gradient_checkpointing, padding_free, dataloader workers, attention implementation).
TRAJECTORY_KEYS = (
    # model
    "model_name_or_path", "model_revision", "adapter_name_or_path", "compute_dtype", "add_special_tokens",
    "quantization_bit", "quantization_type", "double_quantization", "rope_scaling", "rope_factor",
    # data
    "template", "template_kwargs", "dataset", "dataset_dir", "cutoff_len", "train_on_prompt", "mask_history",
    "mix_strategy", "interleave_probs", "max_samples", "val_size", "packing", "dedup", "dedup_threshold", "stride",
    "min_length", "tail", "text_column", "txt_sample_by", "streaming", "buffer_size", "skip_bad_rows",
    # method
    "stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target",
    "use_dora", "use_rslora", "init_lora_weights", "pissa_init", "pissa_iter", "oft_rank", "oft_block_size",
    "oft_target", "module_dropout", "vera_rank", "vera_target", "freeze_trainable_layers", "freeze_trainable_modules",
    "freeze_extra_modules",
    "pref_beta", "pref_loss", "pref_ftx", "dpo_label_smoothing", "simpo_gamma", "kto_desirable_weight",
    "kto_undesirable_weight", "label_smoothing_factor", "neftune_noise_alpha",
    # optimizer and schedule
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
    "optim_args", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "use_galore", "galore_target",
    "galore_rank", "galore_update_interval", "galore_scale", "galore_proj_type", "use_apollo", "apollo_target",
    "apollo_rank", "apollo_update_interval", "apollo_scale", "apollo_proj", "apollo_proj_type", "apollo_scale_type",
    "apollo_scale_front", "use_badam", "badam_start_block", "badam_switch_mode", "badam_switch_interval",
    "use_adam_mini", "use_muon", "loraplus_lr_ratio", "loraplus_lr_embedding",
    # batch and randomness
    "per_device_train_batch_size", "gradient_accumulation_steps", "nproc_per_node", "nnodes", "seed", "data_seed",
    "bf16", "fp16",
)


def config_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key (recorded → current)` for each trajectory option that differs. A key absent from one side holds its
    default there (tunelab_config.yaml leaves out training options at transformers' defaults)."""
    missing = object()
    differences = []
    for key in TRAJECTORY_KEYS:
        before, after = recorded.get(key, missing), current.get(key, missing)
        if before == after:
            continue
        show = [("default" if value is missing else repr(value)) for value in (before, after)]
        differences.append(f"{key} ({show[0]} → {show[1]})")
    return differences


def check_resume(args, current_options: dict[str, Any]) -> str | None:
    """The checkpoint `resume_from_checkpoint` names, checked before any model loads, or None for a fresh start: it
    verifies (true: the newest of output_dir that does), holds optimizer state (or resume_weights_only), and was
    written by a run with the same trajectory options as `current_options` (or resume_config_mismatch: allow)."""
    found = resolve_resume(args.resume_from_checkpoint, args.output_dir, args.resume_weights_only)
    if found is None:
        return None
    recorded = read_run_record(found)
    if recorded is None:
        logger.warning(
            "resume_from_checkpoint: %s has no %s, so it cannot be checked to come from a run with the same "
            "options", found, RUN_RECORD,
        )
        return found
    differences = config_differences(recorded, current_options)
    if not differences:
        return found
    listed = ", ".join(differences)
    if args.resume_config_mismatch == "allow":
        logger.warning("resume_config_mismatch: allow: resuming %s although its run had %s", found, listed)
        return found
    raise ConfigError(
        f"resume_from_checkpoint: {found} comes from a run with other options: {listed}; resuming would continue "
        "that run, not this one. Start a fresh run (another output_dir, or overwrite_output_dir: true without "
        "resume_from_checkpoint), restore those values, or set resume_config_mismatch: allow"
    )


def clear_previous_run(output_dir: str | Path) -> list[Path]:
    """overwrite_output_dir without resuming: delete the checkpoints (and staging folders) an earlier run left,
    so that a later `resume_from_checkpoint: true` can only continue this run."""
    old = [p for p in checkpoint_folders(output_dir)]
    out = Path(output_dir)
    if out.is_dir():
        old += [p for p in out.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX + "-")]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    if old:
        logger.warning(
            "overwrite_output_dir: deleted %d checkpoint folder(s) of the earlier run in %s (%s)",
            len(old), output_dir, ", ".join(p.name for p in old),
        )
    return old
