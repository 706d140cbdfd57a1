"""What a run writes to output_dir, so it can be loaded, understood and reproduced later.

- the model (full/freeze) or the adapter (LoRA, OFT, VeRA), safetensors, via save_pretrained; a LoRA that did not
  start at zero (init_lora_weights pissa / olora / loftq) as its change from that start, a plain LoRA of the
  original base (model/adapters.py `save_as_change_from_start`), so everything that loads it gets the trained model;
- the tokenizer with the chat template training used (tokenizer_config.json / chat_template.jinja);
  stage pt trains without one and saves the tokenizer as it was loaded;
- generation_config.json whose eos ids are the template's end-of-turn tokens (pt: the tokenizer's
  eos), so plain `model.generate` stops where training taught it to;
- tunelab_config.yaml (every resolved option), data_report.json (counts), all_results.json
  (metrics, and the process's peak memory: memory_peak_rss_mib, on a GPU gpu_peak_allocated_mib), run_info.json (versions; `hub`: the repo and commit of every model read by Hub id;
  `gguf`: the GGUF file trained from, its SHA-256 and quantization type),
  trainer_log.jsonl and the loss plots. A model given by Hub id stays a Hub id in tunelab_config.yaml, with
  model_revision pinned to the commit the run read, so the file reruns the same weights anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tunelab import run_folder
from tunelab.config.args import FinetuningArguments, ModelArguments, RunConfig
from tunelab.config.loader import resolved_dict
from tunelab.errors import ConfigError, as_os_error
from tunelab.hub import snapshot_containing, snapshot_of
from tunelab.infer.generate import stop_token_ids
from tunelab.model import gguf
from tunelab.train.memory import peak_memory_metrics
from tunelab.train.plots import plot_loss
from tunelab.train.resume import clear_previous_run
from tunelab.versions import versions

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments


def run_options(config: RunConfig) -> dict[str, Any]:
    """Every resolved option as tunelab_config.yaml records it (YAML values): a model read by Hub id stays its
    Hub id, with model_revision pinned to the commit the run read, so the file reruns the same weights anywhere."""
    options, sources = resolved_dict(config), hub_sources(config.model, config.finetuning)
    for key, source in sources.items():  # the Hub id, not this machine's cache folder
        options[key] = source["repo_id"]
    if "model_name_or_path" in sources:
        options["model_revision"] = sources["model_name_or_path"]["commit"]
        if gguf.is_gguf(config.model.model_name_or_path):  # the file inside the repo
            options["gguf_file"] = Path(config.model.model_name_or_path).relative_to(
                sources["model_name_or_path"]["folder"]).as_posix()
    return yaml.safe_load(yaml.safe_dump(options, sort_keys=False))


def write_run_start(config: RunConfig) -> None:
    """The run's options and versions. A fresh run into output_dir (overwrite_output_dir, no resume) first
    deletes the checkpoints an earlier run left there, so no later resume can continue that run."""
    out = Path(config.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.training.overwrite_output_dir and not config.training.resume_from_checkpoint:
        clear_previous_run(out)
    run_folder.write_run_record(out, run_options(config))
    sources = hub_sources(config.model, config.finetuning)
    info = versions() | ({"hub": sources} if sources else {})
    if gguf.is_gguf(config.model.model_name_or_path):  # the file trained from: its SHA-256 and quantization type
        info["gguf"] = gguf.file_record(config.model.model_name_or_path)
    run_folder.write_json(out, run_folder.RUN_INFO, info)


def hub_sources(model: ModelArguments, finetuning: FinetuningArguments) -> dict[str, dict[str, str]]:
    """{key: repo id, revision asked for, commit read, cache folder} of the models a run read by Hub id."""
    folders = {
        "model_name_or_path": (model.model_name_or_path, model.model_revision),
        "adapter_name_or_path": (model.adapter_name_or_path, "main"),
        "reward_model": (finetuning.reward_model, "main"),
    }
    sources = {}
    for key, (folder, revision) in folders.items():
        snapshot = (snapshot_containing(folder) if gguf.is_gguf(folder) else snapshot_of(folder)) if folder else None
        if snapshot is not None:
            sources[key] = snapshot.record(revision) | {"folder": str(snapshot.folder)}
    return sources


def save_model(trainer, tokenizer, template, out: str) -> None:
    """Model or adapter, tokenizer with the chat template, generation config with stop ids, into `out` (output_dir).

    `template` is None for stages without one (pt): the tokenizer is saved unchanged and eos stops.
    """
    try:
        trainer.save_model(out)
    except Exception as exc:  # safetensors reports a full disk as SafetensorError("... (os error 28)")
        error = as_os_error(exc, out)
        if error is exc:
            raise
        raise error from exc
    if trainer.is_world_process_zero():
        model = trainer.accelerator.unwrap_model(trainer.model)
        save_adapter_as_trained(model, out)
        save_tokenizer_and_generation_config(model, tokenizer, template, out)


def save_adapter_as_trained(model, out: str) -> None:
    """After the weights are saved: an adapter that started away from zero (PiSSA, OLoRA, LoftQ) becomes its change
    from that start, which the original base plus it reproduces (checkpoints keep the trained form, for resuming)."""
    # lazy: model/adapters imports peft (7.8 s); preflight imports this module
    from tunelab.model.adapters import save_as_change_from_start

    save_as_change_from_start(model, out)


def save_tokenizer_and_generation_config(model, tokenizer, template, out: str) -> None:
    """The files beside the weights: tokenizer with the chat template, generation config with stop ids.
    (Stages that run their own loop — grpo, ppo — save the weights themselves, then call save_adapter_as_trained and
    this.)"""

    if template is not None:
        tokenizer.chat_template = template.jinja
    tokenizer.save_pretrained(out)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        if template is not None:
            generation_config.eos_token_id = stop_token_ids(tokenizer, template)
        elif tokenizer.eos_token_id is not None:
            generation_config.eos_token_id = tokenizer.eos_token_id
        if generation_config.pad_token_id is None:
            generation_config.pad_token_id = tokenizer.pad_token_id
        generation_config.save_pretrained(out)


def finish(trainer, metrics: dict, args: TrainingArguments) -> None:
    """all_results.json (the metrics and the peak memory) and the loss plots."""
    if not trainer.is_world_process_zero():
        return
    metrics.update(peak_memory_metrics(args.device))  # the whole run's, generation after training included
    run_folder.write_json(args.output_dir, run_folder.RESULTS, metrics)
    if args.plot_loss:
        plot_loss(args.output_dir)


def check_output_dir(args: TrainingArguments) -> None:
    """output_dir can be written, and holds no earlier run unless this one overwrites or resumes it (what `tunelab
    data stats` wrote there does not count)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 checked it and may already be writing there; other ranks would see it non-empty
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} exists and is not a folder")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == out.absolute() else f" (it would be created in {existing})"
        raise ConfigError(f"output_dir: {out} is not writable{what}; choose a folder you can write to")
    if out.is_dir() and any(p.name != run_folder.DATA_STATS_DIR for p in out.iterdir()):
        if not (args.overwrite_output_dir or args.resume_from_checkpoint):
            raise ConfigError(
                f"output_dir: {out} is not empty; set overwrite_output_dir: true, resume_from_checkpoint, "
                "or choose another folder"
            )
