"""What a run writes to output_dir, so it can be loaded, understood and reproduced later.

- the model (full/freeze) or the adapter (LoRA), safetensors, via save_pretrained;
- the tokenizer with the chat template training used (tokenizer_config.json / chat_template.jinja);
  stage pt trains without one and saves the tokenizer as it was loaded;
- generation_config.json whose eos ids are the template's end-of-turn tokens (pt: the tokenizer's
  eos), so plain `model.generate` stops where training taught it to;
- tunelab_config.yaml (every resolved option), data_report.json (counts), all_results.json
  (metrics, and the process's peak memory: memory_peak_rss_mib, on a GPU gpu_peak_allocated_mib), run_info.json (versions; `hub`: the repo and commit of every model read by Hub id),
  trainer_log.jsonl and the loss plots. A model given by Hub id stays a Hub id in tunelab_config.yaml, with
  model_revision pinned to the commit the run read, so the file reruns the same weights anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from tunelab.config.args import RunConfig
from tunelab.config.loader import RUN_RECORD, resolved_dict
from tunelab.train.memory import peak_memory_metrics
from tunelab.train.plots import plot_loss
from tunelab.versions import versions


def write_json(output_dir: str, name: str, data: Any) -> Path:
    """Write output_dir/name as JSON. In a distributed run only global rank 0 writes: the other ranks hold
    the same data and would race on the same file."""
    path = Path(output_dir) / name
    if int(os.environ.get("RANK", "0")) != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def run_options(config: RunConfig) -> dict[str, Any]:
    """Every resolved option as tunelab_config.yaml records it (YAML values): a model read by Hub id stays its
    Hub id, with model_revision pinned to the commit the run read, so the file reruns the same weights anywhere."""
    options, sources = resolved_dict(config), hub_sources(config)
    for key, source in sources.items():  # the Hub id, not this machine's cache folder
        options[key] = source["repo_id"]
    if "model_name_or_path" in sources:
        options["model_revision"] = sources["model_name_or_path"]["commit"]
    return yaml.safe_load(yaml.safe_dump(options, sort_keys=False))


def write_run_start(config: RunConfig) -> None:
    """The run's options and versions. A fresh run into output_dir (overwrite_output_dir, no resume) first
    deletes the checkpoints an earlier run left there, so no later resume can continue that run."""
    from tunelab.train.checkpoints import clear_previous_run  # noqa: PLC0415

    out = Path(config.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.training.overwrite_output_dir and not config.training.resume_from_checkpoint:
        clear_previous_run(out)
    options = run_options(config)
    (out / RUN_RECORD).write_text(yaml.safe_dump(options, sort_keys=False, default_flow_style=None), encoding="utf-8")
    sources = hub_sources(config)
    write_json(str(out), "run_info.json", versions() | ({"hub": sources} if sources else {}))


def hub_sources(config: RunConfig) -> dict[str, dict[str, str]]:
    """{key: repo id, revision asked for, commit read, cache folder} of the models a run read by Hub id."""
    from tunelab.model.hub import snapshot_of  # noqa: PLC0415

    folders = {
        "model_name_or_path": (config.model.model_name_or_path, config.model.model_revision),
        "adapter_name_or_path": (config.model.adapter_name_or_path, "main"),
        "reward_model": (config.finetuning.reward_model, "main"),
    }
    sources = {}
    for key, (folder, revision) in folders.items():
        snapshot = snapshot_of(folder) if folder else None
        if snapshot is not None:
            sources[key] = snapshot.record(revision) | {"folder": str(snapshot.folder)}
    return sources


def save_model(trainer, tokenizer, template, config: RunConfig) -> None:
    """Model or adapter, tokenizer with the chat template, generation config with stop ids.

    `template` is None for stages without one (pt): the tokenizer is saved unchanged and eos stops.
    """
    out = config.training.output_dir
    try:
        trainer.save_model(out)
    except Exception as exc:  # safetensors reports a full disk as SafetensorError("... (os error 28)")
        error = as_os_error(exc, out)
        if error is exc:
            raise
        raise error from exc
    if trainer.is_world_process_zero():
        save_tokenizer_and_generation_config(trainer.accelerator.unwrap_model(trainer.model), tokenizer, template, out)


def save_tokenizer_and_generation_config(model, tokenizer, template, out: str) -> None:
    """The files beside the weights: tokenizer with the chat template, generation config with stop ids.
    (Stages that run their own loop — grpo, ppo — save the weights themselves, then call this.)"""
    from tunelab.infer.generate import stop_token_ids  # noqa: PLC0415

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


# torch.save reports a failed write (a full disk, a file-size limit) without an errno: "[enforce fail at
# inline_container.cc:...] . unexpected pos N vs M" or "PytorchStreamWriter failed writing file ...".
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")
_NEARLY_FULL = 64 << 20  # bytes free below which a failed write is taken for a full disk


def as_os_error(exc: Exception, where: str) -> Exception:
    """An I/O failure that surfaced as another type as the OSError it is (so the CLI explains it in one line),
    or `exc` unchanged. safetensors' Rust errors carry "(os error N)"; torch.save's carry no errno, so a disk
    with (almost) no space left under `where` makes it ENOSPC, a file-size limit (ulimit -f) EFBIG."""
    import errno  # noqa: PLC0415
    import re  # noqa: PLC0415
    import resource  # noqa: PLC0415

    if isinstance(exc, OSError):
        return exc
    match = re.search(r"os error (\d+)\)", str(exc))
    if match and int(match.group(1)) in errno.errorcode:
        code = int(match.group(1))
        return OSError(code, os.strerror(code), where)
    if not (isinstance(exc, RuntimeError) and any(text in str(exc) for text in _TORCH_WRITE_FAILED)):
        return exc
    try:
        stats = os.statvfs(where)
    except OSError:
        return exc
    if stats.f_bavail * stats.f_frsize < _NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), where)
    return exc


def finish(trainer, metrics: dict, config: RunConfig) -> None:
    if not trainer.is_world_process_zero():
        return
    out = config.training.output_dir
    metrics.update(peak_memory_metrics(config.training.device))  # the whole run's, generation after training included
    write_json(out, "all_results.json", metrics)
    if config.training.plot_loss:
        plot_loss(out)
