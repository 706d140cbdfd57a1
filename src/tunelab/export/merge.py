"""`tunelab export`: a plain Hugging Face model folder or a GGUF from a base model and (optionally) a LoRA adapter,
then read back and compared with the model as trained (export/parity.py).

    base (float32) + adapter → PEFT merge_and_unload → export_dtype → save_pretrained (safetensors,
    sharded above export_size, with model.safetensors.index.json) + tokenizer with the chat template
    + generation_config.json whose eos ids are the template's end-of-turn tokens
    + tunelab_config.yaml (the export's resolved options, with the template variables the model trained
    with, so `tunelab chat` / `tunelab eval` on the folder render as training did).

The folder loads with `AutoModelForCausalLM.from_pretrained` alone (no peft, no tunelab). The merge runs
in float32 so rounding happens once, when casting to export_dtype. A reward model (an adapter with
task_type SEQ_CLS, or a base whose architecture is *ForSequenceClassification) is loaded and saved as
AutoModelForSequenceClassification, so its `score` head (saved by PEFT as a module to save) is kept. A
vision-language model loads and saves as AutoModelForImageTextToText, with its processor (image processor
config beside the tokenizer), so AutoProcessor + AutoModelForImageTextToText load the folder alone.

export_quantization (int8-int4, int4-weight, int8-weight; model/qat.py) quantizes the merged model with
torchao through transformers' TorchAoConfig: the merged weights go to a scratch folder inside export_dir,
transformers reloads them quantizing each linear layer but the output head, and saves the torchao tensors with
the quantization_config in config.json, so plain `from_pretrained` (with torchao installed) loads the quantized
model. The same scheme applies whether or not the model trained with `qat` (post-training quantization). It does
not merge into a 4-bit bitsandbytes base (the config check refuses quantization_bit).

export_format gguf writes <export_dir>/model-<export_gguf_type>.gguf (export/gguf_writer.py) from the same merged
float32 model, with the Ollama Modelfile beside it (export/modelfile.py); preflight refuses what it cannot write
(check_export_dir) before any weights load.

Every export is then checked (export_parity, default on): base + adapter against the merged model on the probe
conversations before the adapter is dropped (a float32 merge stays within float noise), then the written folder or
file read back by plain transformers (and llama.cpp, for a GGUF) and compared with the merged float32 model
(parity.check_parity), the run's held-out rows (export_check_dataset, else its eval set) scored by both in exact
match, the report in export_dir/export_report.json; ParityError, with the report, when anything differs beyond
tolerance. The folder is written from a copy in export_dtype, so the float32 model stays the reference. Reward
models are not checked (no next-token logits or answers to compare).

A model_name_or_path that holds a DeepSpeed ZeRO checkpoint (a `latest` file and its global_stepN/ shards, as in a
ZeRO run's checkpoint-N/) is consolidated from the shards (model/zero_checkpoint.py) instead of read from
model.safetensors. Which tokenizer, template and template variables the export carries: infer/trained.py, as for
tunelab eval and chat.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification,
)
from transformers.utils.hub import convert_file_size_to_int

from tunelab import run_folder
from tunelab.config.args import DataArguments, ExportArguments, ModelArguments, RunConfig
from tunelab.config.loader import resolved_dict
from tunelab.config.stages import stage_row
from tunelab.data.formats import prompt_and_reference
from tunelab.data.pipeline import load_canonical_splits
from tunelab.data.templates import Template
from tunelab.errors import ConfigError, ExportError, ModelError, first_line
from tunelab.export import parity
from tunelab.export.modelfile import write_modelfile
from tunelab.export.parity import ParityReport
from tunelab.infer.generate import stop_token_ids
from tunelab.infer.trained import inference_template, inference_template_kwargs, load_inference_tokenizer, trained_folder
from tunelab import hub
from tunelab.model import gguf as model_gguf, qat, rope, vision, zero_checkpoint
from tunelab.model.adapters import load_adapter
from tunelab.model.folder import is_sequence_classification
from tunelab.model.tokenizer import load_processor

logger = logging.getLogger(__name__)


def shard_size_bytes(export_size: float | str) -> int:
    """export_size as bytes: a number is GB (10^9 bytes), a string is a size like '500MB' or '2GiB'."""
    if isinstance(export_size, (int, float)):
        return int(export_size * 10**9)
    try:
        return convert_file_size_to_int(export_size.strip())
    except (ValueError, AttributeError):
        raise ConfigError(
            f"export_size: cannot read {export_size!r}; give GB as a number (e.g. 2) or a size like 500MB or 2GiB"
        ) from None


def export_dtype(export: ExportArguments, model_args: ModelArguments) -> torch.dtype:
    """export_dtype, where auto is the base model's dtype."""
    if export.export_dtype != "auto":
        return getattr(torch, export.export_dtype)
    base = model_gguf.load_config(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
    dtype = getattr(base, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def merge_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """The adapter merged into its base (a model without one as it is), set up to serve generation."""
    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    model.config.use_cache = True  # training runs save use_cache: false; the exported model serves generation
    return model.eval()


def trained_model(model_args: ModelArguments, pad_token_id: int | None) -> torch.nn.Module:
    """The model as trained, in float32: the base with the adapter loaded on it (not merged), or the trained weights."""
    seq_cls = is_sequence_classification(model_args)
    auto = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
    if not seq_cls and vision.is_vision_model_folder(model_args.model_name_or_path):
        auto = AutoModelForImageTextToText
    kwargs: dict = {"dtype": torch.float32, "trust_remote_code": model_args.trust_remote_code}
    if seq_cls:
        kwargs["pad_token_id"] = pad_token_id  # sequence classifiers find each row's last token by it
        base_config = json.loads((Path(model_args.model_name_or_path) / "config.json").read_text(encoding="utf-8"))
        if "num_labels" not in base_config and "id2label" not in base_config:
            kwargs["num_labels"] = 1  # a reward model: one score per sequence
    if zero_checkpoint.zero_tag(model_args.model_name_or_path):
        # A DeepSpeed ZeRO checkpoint: the float32 master weights, joined from every rank's partition.
        state_dict = zero_checkpoint.consolidated_state_dict(model_args.model_name_or_path, model_args.allow_pickle_weights)
        config = rope.scaled_config(model_args.model_name_or_path, rope.of(model_args), model_args.trust_remote_code) \
            or AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
        for name in ("pad_token_id", "num_labels"):  # what from_pretrained would set on the config
            if name in kwargs:
                setattr(config, name, kwargs[name])
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=model_args.trust_remote_code)
        zero_checkpoint.load_into(model, state_dict, model_args.model_name_or_path)
    else:
        hub.fetch_weights(model_args.model_name_or_path, model_args.allow_pickle_weights)
        # rope_scaling (model/rope.py): the merged model's config.json carries it
        kwargs = rope.with_rope_scaling(model_args.model_name_or_path, rope.of(model_args),
                                        model_args.trust_remote_code, kwargs)
        try:
            model = model_gguf.from_pretrained(auto, model_args.model_name_or_path, **kwargs)  # a GGUF base: dequantized
        except Exception as exc:  # noqa: BLE001
            raise ModelError(
                f"model_name_or_path: cannot load {model_args.model_name_or_path} as {auto.__name__}: {first_line(exc)}"
            ) from exc
    if model_args.adapter_name_or_path:
        model = load_adapter(model, model_args.adapter_name_or_path, is_trainable=False)
    return model.eval()


@dataclass
class Exported:
    """What `tunelab export` wrote: the folder (export_format hf) or .gguf file, and what its check measured."""

    path: Path
    report: ParityReport | None  # None when export_parity is false or the model is not one the check reads
    unchecked: str | None = None  # why there is no report


def export_model(config: RunConfig) -> Exported:
    """Write the export into export_dir (hf: the merged model, tokenizer, chat template and generation config; gguf:
    one .gguf file and its Ollama Modelfile), then, with export_parity, read it back and compare it with the model as
    trained (export/parity.py) into export_report.json; ParityError, carrying the report, when they differ.
    export_check_only (`tunelab export --check-only`): the same check on what an earlier export wrote there."""
    out = Path(config.export.export_dir)
    check_only = config.export.export_check_only
    tokenizer = load_inference_tokenizer(config.model)
    template, template_vars = None, None
    if stage_row(config.finetuning.stage).reads != "text" and (config.data.template or tokenizer.chat_template):
        template = inference_template(config.data.template, tokenizer, trained_folder(config.model))
        template_vars = inference_template_kwargs(config.data.template_kwargs, trained_folder(config.model), template)
    if template is not None:
        tokenizer.chat_template = template.jinja
    gguf = config.export.export_format == "gguf"
    # What the check renders the probes with: the GGUF's template (none for pt), or what the folder's tokenizer holds.
    chat_template = _template(template) if gguf else tokenizer.chat_template
    unchecked = _unchecked_reason(config.export, config.model)

    model = trained_model(config.model, tokenizer.pad_token_id)
    merge = None
    if isinstance(model, PeftModel) and unchecked is None:
        # The merge is checked here, where base + adapter still exist: on the probes, before and after.
        ids = parity.probe_ids(tokenizer, chat_template, template_vars)
        before = [_logits(model, probe) for probe in ids]
        model = merge_adapter(model)
        gap = max(parity.logit_gap(b, _logits(model, probe)) for b, probe in zip(before, ids))
        merge = parity.MergeResult(gap, parity.TOLERANCES["f32"])
    model = merge_adapter(model)
    out.mkdir(parents=True, exist_ok=True)
    record = {**resolved_dict(config), "template_kwargs": template_vars or None}  # the run record beside it
    if check_only:
        path, kind = (_gguf_path(config.export, out), "gguf") if gguf else (out, "hf")
    elif gguf:
        path = _write_gguf(config.export, config.model, record, model, tokenizer, template, template_vars, out)
        kind = "gguf"
    else:
        # The check compares with the float32 model: the folder is written from a copy in export_dtype.
        dtype = export_dtype(config.export, config.model)
        keep = unchecked is None and dtype != torch.float32 and not config.export.export_quantization
        _write_folder(config.export, config.model, config.finetuning.qat_group_size, record,
                      copy.deepcopy(model) if keep else model, tokenizer, template, template_vars, out)
        path, kind = out, "hf"
    if unchecked is not None:
        logger.info("export check skipped: %s", unchecked)
        return Exported(path, None, unchecked)
    held_out = _held_out_rows(config.export, config.data, config.training.seed, template)
    report = parity.check_parity(model, tokenizer, chat_template, template_vars, path, kind, raise_on_mismatch=False,
                                 held_out=held_out, max_drop=config.export.export_check_max_drop,
                                 held_out_tokens=config.generation.max_new_tokens)
    report.merge = merge
    report.write(out / run_folder.EXPORT_REPORT)
    if report.problems:
        raise parity.ParityError(report.failure(), report)
    return Exported(path, report)


def _gguf_path(export: ExportArguments, out: Path) -> Path:
    return out / f"model-{export.export_gguf_type}.gguf"


def _check_existing_export(export: ExportArguments, out: Path) -> None:
    """--check-only needs the export the same options would write, and the check switched on."""
    if not export.export_parity:
        raise ConfigError("--check-only runs the export check, but export_parity is false: remove one of them")
    if export.export_format == "gguf":
        wanted, what = _gguf_path(export, out), f"export_gguf_type {export.export_gguf_type}"
    else:
        wanted, what = out / "config.json", "export_format hf"
    if not wanted.is_file():
        raise ConfigError(f"--check-only: {wanted} does not exist ({what}); export first, or point export_dir and "
                          "the export options at the existing export")


def _template(template: Template | None) -> str | None:
    return template.jinja if template is not None else None


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _held_out_rows(export: ExportArguments, data_args: DataArguments, seed: int,
                   template: Template | None) -> tuple[str, list] | None:
    """(name, [(prompt messages, reference answer)]) of the first export_check_samples rows of export_check_dataset,
    else of the run's first eval set (val_size or eval_dataset, split as training split it); None without one or
    without a chat template (a pt model answers no prompts)."""
    if template is None or not (export.export_check_dataset or data_args.eval_dataset or data_args.val_size > 0):
        return None
    if export.export_check_samples < 1:
        raise ConfigError(f"export_check_samples: expected an integer >= 1, got {export.export_check_samples}")
    if export.export_check_dataset:  # only that set, read as a training set is (the run's data is not read)
        data = dataclasses.replace(data_args, dataset=[export.export_check_dataset], val_size=0.0, eval_dataset=None)
        name, (rows, _) = export.export_check_dataset, load_canonical_splits(data, seed, report={})
    else:
        _, rows_by_name = load_canonical_splits(data_args, seed, report={})
        name, rows = next(iter(rows_by_name.items()))
    rows = rows.select(range(min(export.export_check_samples, len(rows))))
    logger.info("export check: scoring %d held-out rows of %s", len(rows), name)
    return name, [prompt_and_reference(row, template) for row in rows]


def _unchecked_reason(export: ExportArguments, model_args: ModelArguments) -> str | None:
    """Why this export is not read back, or None: export_parity says so, or a reward model (its check reads logits
    and greedy answers of a language model)."""
    if not export.export_parity:
        return "export_parity: false"
    if is_sequence_classification(model_args):
        return "a reward model (sequence classification) has no next-token logits or answers to compare"
    return None


def _write_gguf(export: ExportArguments, model_args: ModelArguments, record: dict, model: torch.nn.Module, tokenizer,
                template: Template | None, template_vars: dict | None, out: Path) -> Path:
    """<export_dir>/model-<type>.gguf and the Ollama Modelfile beside it, and `record` (the run record)."""
    # lazy: gguf_writer imports gguf: the gguf extra, which may be missing
    from tunelab.export.gguf_writer import source_provenance, write_gguf

    tensor_type = export.export_gguf_type
    # general.name: the run (its adapter folder's name) with the base as general.base_model.0; a model exported
    # without an adapter keeps its own name, organization and licence.
    adapter = model_args.adapter_name_or_path
    run_name = Path(str(adapter).split(",")[-1].rstrip("/")).name if adapter else None
    source = source_provenance(model_args.model_name_or_path)
    path = write_gguf(model, tokenizer, _template(template), template_vars, _gguf_path(export, out), tensor_type,
                      name=run_name, source=source)
    stop_words = list(template.stop_words) if template is not None else None
    write_modelfile(path, tokenizer, _template(template), template_vars, stop_words=stop_words)
    run_folder.write_run_record(out, record)
    logger.info("exported %s as GGUF %s to %s (with its Ollama Modelfile)", type(model).__name__, tensor_type, path)
    return path


def _write_folder(export: ExportArguments, model_args: ModelArguments, group_size: int | None, record: dict,
                  model: torch.nn.Module, tokenizer, template: Template | None, template_vars: dict | None,
                  out: Path) -> None:
    """The merged model in export_dtype (or quantized with torchao in groups of `group_size`), tokenizer, processor,
    generation config and `record` (the run record)."""
    max_shard_size = shard_size_bytes(export.export_size)
    dtype = export_dtype(export, model_args)
    scheme = export.export_quantization
    _warn_scheme_mismatch(model_args, scheme, group_size)
    if scheme:  # quantized from the float32 weights, rounded to dtype as transformers reloads them
        model = save_quantized(model, scheme, group_size, dtype, out, max_shard_size)
    else:
        model = model.to(dtype)
        model.save_pretrained(out, max_shard_size=max_shard_size)
    if model.can_generate():
        tokenizer.padding_side = "left"  # what batched generation wants; tunelab's training sets its own
    tokenizer.save_pretrained(out)
    processor = load_processor(model_args)
    if processor is not None:  # a vision-language model: its image processor beside the tokenizer, as it came
        processor.tokenizer, processor.chat_template = tokenizer, tokenizer.chat_template
        processor.save_pretrained(out)
    run_folder.write_run_record(out, record)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        generation_config.eos_token_id = stop_token_ids(tokenizer, template) if template else tokenizer.eos_token_id
        if generation_config.pad_token_id is None:
            generation_config.pad_token_id = tokenizer.pad_token_id
        generation_config.save_pretrained(out)
    quantized = f", linear layers {scheme} in groups of {group_size}" if scheme else ""
    logger.info("exported %s (%s%s) to %s", type(model).__name__, str(dtype).removeprefix("torch."), quantized, out)


def save_quantized(
    model: torch.nn.Module, scheme: str, group_size: int, dtype: torch.dtype, out: Path, max_shard_size: int
) -> torch.nn.Module:
    """Save `model` quantized with `scheme` into `out`; returns the quantized model.

    transformers quantizes with torchao while loading (and only a model it loaded that way saves torchao tensors),
    so the full-precision model goes through a scratch folder inside `out`, removed afterwards.
    """
    quantization_config = qat.torchao_config(scheme, group_size, model)
    with tempfile.TemporaryDirectory(prefix=".merged-", dir=out) as scratch:
        model.save_pretrained(scratch)
        quantized = AutoModelForCausalLM.from_pretrained(scratch, dtype=dtype, quantization_config=quantization_config,
                                                         use_kernels=False)
        quantized.save_pretrained(out, max_shard_size=max_shard_size)
    return quantized.eval()


def _warn_scheme_mismatch(model_args: ModelArguments, scheme: str | None, group: int | None) -> None:
    """A model trained with qat exported without its scheme (or with another one) is allowed, but said."""
    trained, trained_group = qat.trained_scheme(trained_folder(model_args).path)
    if not trained:
        return
    if not scheme:
        logger.warning("the model trained with qat: %s; this export stays full precision: add "
                       "export_quantization=%s to quantize it as it trained", trained, trained)
    elif (scheme, group) != (trained, trained_group):
        logger.warning("export_quantization: %s in groups of %s differs from what the model trained with (qat: %s, "
                       "qat_group_size: %s)", scheme, group, trained, trained_group)


def check_export_dir(export: ExportArguments, model_args: ModelArguments, overwrite_output_dir: bool) -> None:
    """export_dir is empty, or overwrite_output_dir says it may be replaced; with export_check_only, it holds the
    export these options write."""
    out = Path(export.export_dir)
    if export.export_check_only:
        _check_existing_export(export, out)
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite_output_dir:
        raise ConfigError(f"export_dir: {out} is not empty; choose another folder or set overwrite_output_dir: true")
    if export.export_format == "gguf":
        _check_gguf_source(model_args)


def _check_gguf_source(model_args: ModelArguments) -> None:
    """export_format gguf: the gguf package is there and the model is a causal LM of a family gguf_writer writes."""
    try:
        # lazy: gguf_writer imports gguf: the gguf extra, which may be missing
        from tunelab.export.gguf_writer import model_family
    except ImportError as exc:
        raise ConfigError(f"export_format gguf needs the gguf package ({first_line(exc)}): pip install "
                          "'tunelab[gguf]'") from None
    if is_sequence_classification(model_args):
        raise ConfigError("export_format gguf: a reward model (sequence classification) has no GGUF form llama.cpp "
                          "runs; export it with export_format: hf")
    if vision.is_vision_model_folder(model_args.model_name_or_path):
        raise ConfigError("export_format gguf: tunelab writes GGUF for text models; a vision-language model exports "
                          "with export_format: hf")
    config = model_gguf.load_config(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
    try:
        model_family(config)
    except ExportError as exc:
        raise ConfigError(str(exc)) from None
