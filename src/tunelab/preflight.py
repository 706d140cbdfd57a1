"""Resolve a run once, before any weights load, into a frozen plan, and ask each layer to check what it owns.

    tunelab <command> cfg.yaml key=value
      config/loader.py read_values     YAML + overrides → typed values (unknown keys, types, ranges; bf16 / fp16
                                       auto from this machine: model/device.py)
      train/launch.py                  the DeepSpeed file (transformers reads it while TrainingArguments is built)
      config/loader.py build_config    the option groups, and every check of the values alone (config/checks.py)
      then the layers' own checks, each resolving once what later steps take from the plan:
      model/qat.py                     torchao for qat / export_quantization; an adapter's export names its base
      model/folder.py                  Hub id → cache folder; a model folder or a readable GGUF file (gguf_file
                                       joined to its folder / Hub repo); its remote code; the adapter's files
      model/rope.py                    rope_scaling suits the model (RoPE, not scaled     → rope_factor
                                       already); an adapter's recorded one
      model/qat.py                     the quantized layers fit the group size            → qat_group_size
      data/templates/choice.py         the template exists and reads the template_kwargs given
      data/registry.py                 the datasets exist and suit the stage              → plan.registry
      data/dedup.py                    datasketch for dedup: near
      train/optimizers.py              the package of use_galore / use_apollo / use_badam / use_adam_mini
      train/rl/rewards.py              the reward functions import                        → plan.reward_functions
      train/rl/tools.py                the tools import and describe themselves           → plan.tools
      model/folder.py                  the reward model folder (ppo)
      model/sharding.py                what FSDP on CPU cannot do
      train/callbacks.py               the user's callback classes import and take their arguments
                                                                                          → plan.user_callbacks
      train/trackers.py                report_to's trackers are known and installed      → report_to as a list
      infer/metrics.py                 sacrebleu and rouge-score for the generation scores
      (here)                           the liger-kernel package for use_liger_kernel
      train/outputs.py                 output_dir
      train/resume.py                  the checkpoint to resume verifies and comes from the same run
      export/merge.py                  export_dir

Which of them a command runs depends on its purpose (train, data, estimate, eval, export, serve), as in the value
checks: only a training run checks its output_dir and imports its callbacks, export and serve read no dataset. The
messages are the layers' own, one line each (ConfigError). The config the plan holds is the resolved one: local
folders for Hub ids, the checkpoint folder for `resume_from_checkpoint: true`, the group size QAT and quantized
exports use. Each is a new value (dataclasses.replace; the option groups are frozen): a check returns what it
resolved and nothing is changed in place, so the config built from the file stays as it was read.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.config.args import FinetuningArguments, ModelArguments, RunConfig
from tunelab.config.loader import Purpose, build_config, read_values
from tunelab.config.stages import stage_row
from tunelab.config.training_values import training_with
from tunelab.data import dedup
from tunelab.data.registry import check_datasets
from tunelab.data.templates.choice import check_template
from tunelab.errors import ConfigError
from tunelab.infer.metrics import check_scoring_packages
from tunelab.model import device, qat, rope, sharding
from tunelab.model.folder import resolve_model_folders, resolve_reward_model
from tunelab.train import launch, optimizers, outputs, resume
from tunelab.train.plan import RunPlan
from tunelab.train.rl.rewards import RewardFunction, load_reward_functions
from tunelab.train.rl.tools import Tool, load_tools
from tunelab.train.trackers import check_trackers

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments


def plan_run(
    path: str | Path | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    purpose: Purpose = "train",
    warn: bool = True,
) -> RunPlan:
    """Read, check and resolve a configuration: fails with one line before any weights or data load."""
    read = read_values(path, overrides, purpose, device.machine())
    launch.check_deepspeed(read.training)
    config = build_config(read, warn)
    qat.check_quantization_sources(config.model, config.finetuning, config.export)
    model_folder, adapter_folder = resolve_model_folders(config.model)
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, model_name_or_path=model_folder, adapter_name_or_path=adapter_folder, gguf_file=None,
    ))  # a GGUF given as folder / Hub id + gguf_file is its file's path from here on
    config = dataclasses.replace(config, model=rope.resolve_rope_scaling(config.model, config.data))
    if purpose not in ("data", "eval", "serve"):  # (eval and serve may load the quantized export of a qat run)
        group_size = qat.check_quantized_layers(config.model, config.finetuning, config.export)
        config = dataclasses.replace(config, finetuning=dataclasses.replace(config.finetuning,
                                                                            qat_group_size=group_size))
    reads_data = purpose not in ("export", "serve")
    if reads_data:
        check_template(config.model, config.data, config.finetuning)
    registry = check_datasets(config.data, config.finetuning.stage) if reads_data else None
    if reads_data:
        dedup.check_dedup_available(config.data)
    if purpose in ("train", "estimate"):
        optimizers.check_optimizer_package(config.finetuning)
    reward_functions: tuple[RewardFunction, ...] = ()
    tools: tuple[Tool, ...] = ()
    config_dir = Path(config.source).parent if config.source else None  # relative reward / callback files
    if purpose != "serve":
        config = dataclasses.replace(config, finetuning=_with_reward_model_folder(config.finetuning, config.model))
        reward_functions = _reward_functions(config.finetuning, config_dir)
        tools = _tools(config.finetuning, config_dir)
    if config.training.fsdp and config.training.use_cpu:  # on CPU transformers shards at load, with its own limits
        processes = max(launch.nproc_per_node(config.training) * config.training.nnodes,
                        int(os.environ.get("WORLD_SIZE", "1")))
        sharding.check_cpu_fsdp(config.training, processes, config.finetuning.stage)
    if config.data.streaming and purpose != "data":  # (`tunelab data` builds no TrainingArguments)
        config = dataclasses.replace(config, training=launch.per_rank_streams(config.training))
    user_callbacks = _user_callbacks(config.training, config_dir) if purpose == "train" else ()
    if config.generation.generate_at_eval and purpose not in ("export", "serve"):
        check_scoring_packages("generate_at_eval")
    if purpose == "train":
        config = dataclasses.replace(config, training=training_with(config.training, report_to=check_trackers(
            config.training.report_to)))
        _check_liger_package(config.training)
        outputs.check_output_dir(config.training)
        found = resume.check_resume(config.training, outputs.run_options(config))
        if found is not None:
            config = dataclasses.replace(config, training=training_with(config.training, resume_from_checkpoint=found))
    if purpose == "eval" or (purpose == "train" and config.training.do_predict):
        check_scoring_packages("tunelab eval" if purpose == "eval" else "do_predict")
    if purpose == "export":
        # lazy: export/merge imports peft (7.8 s); `tunelab data` plans through here
        from tunelab.export.merge import check_export_dir

        check_export_dir(config.export, config.model, config.training.overwrite_output_dir)
    return RunPlan(config, purpose, registry, reward_functions, user_callbacks, tools)


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    purpose: Purpose = "train",
    warn: bool = True,
) -> RunConfig:
    """The resolved config of `plan_run`, for commands that need nothing else of the plan."""
    return plan_run(path, overrides, purpose, warn).config


def _with_reward_model_folder(ft: FinetuningArguments, model: ModelArguments) -> FinetuningArguments:
    """A stage scored by a reward model (ppo): reward_model resolved to its folder (checked now)."""
    if stage_row(ft.stage).scorer != "reward_model":
        return ft
    return dataclasses.replace(ft, reward_model=resolve_reward_model(ft.reward_model, model.allow_pickle_weights))


def _reward_functions(ft: FinetuningArguments, config_dir: Path | None) -> tuple[RewardFunction, ...]:
    """A stage scored by reward functions (grpo): them, imported (a missing file or function fails now)."""
    if stage_row(ft.stage).scorer != "reward_functions":
        return ()
    return tuple(load_reward_functions(ft.reward_funcs, ft.reward_weights, config_dir))


def _tools(ft: FinetuningArguments, config_dir: Path | None) -> tuple[Tool, ...]:
    """grpo with tools: them, imported and described (a missing file, function or docstring fails now)."""
    if stage_row(ft.stage).scorer != "reward_functions" or not ft.tools:
        return ()
    return load_tools(ft.tools, config_dir)


def _check_liger_package(args: TrainingArguments) -> None:
    """use_liger_kernel: transformers applies Liger's kernels with the liger-kernel package (the GPU itself is checked
    as the config is read: config/loader.py)."""
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("use_liger_kernel: the liger-kernel package is not installed: pip install 'tunelab[liger]', "
                          "or remove it", key="use_liger_kernel")


def _user_callbacks(args: TrainingArguments, config_dir: Path | None) -> tuple[tuple[type, dict[str, Any]], ...]:
    if not args.callbacks:
        return ()
    # lazy: train/callbacks imports transformers' TrainerCallback, which imports peft and bitsandbytes (7.8 s)
    from tunelab.train.callbacks import resolve_user_callbacks

    return tuple(resolve_user_callbacks(args.callbacks, args.callback_kwargs, config_dir))
