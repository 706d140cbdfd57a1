"""Turn a YAML file plus command-line overrides into a RunConfig whose values are checked.

The YAML file is flat (LlamaFactory style): every key belongs to exactly one option group.
Overrides come as `key=value` or `--key value` and win over the file; a run may also be given by
overrides alone. Values given as text are converted to the type the option declares. Unknown keys
fail together, in one message that says where each came from (the file or the command line) and,
for each, a close match, or what to do instead of a LlamaFactory option tunelab lacks
(config/llamafactory.py); a LlamaFactory key whose value asks for what tunelab does anyway
(`use_fast_tokenizer: true`) is accepted with one info line instead. Liger kernels (use_liger_kernel, LlamaFactory's
enable_liger_kernel) are refused for training on a machine without a CUDA GPU. A template alias (LlamaFactory's
`qwen3_nothink`...) becomes its built-in and the template variables it implies. An explicit `save_steps` turns on
`save_strategy: steps`, as in LlamaFactory and the Trainer (tunelab's own default is `no`: checkpoints are opt-in).
Early stopping and load_best_model_at_end watch `eval_loss` unless metric_for_best_model says otherwise (perplexity:
lower is better).

Two steps, `read_values` then `build_config`, with nothing but values between them. The config's YAML is the one
file read here; what needs other files, the environment or the layers above (the model folder, the datasets, the
DeepSpeed file...) is tunelab/preflight.py's, which runs these two and then those checks. The hardware a default
depends on, and ACCELERATE_USE_CPU, come in as a `Machine` (config/precision.py), read by preflight.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tunelab.config import checks
from tunelab.config.args import DataArguments, RunConfig, option_groups, training_group
from tunelab.config.llamafactory import (
    LLAMAFACTORY_HABIT_OPTIONS,
    LLAMAFACTORY_HABITS,
    llamafactory_advice,
)
from tunelab.config.precision import (
    Machine,
    PrecisionChoice,
    choose_precision,
    resolve_flags,
)
from tunelab.config.template_names import resolve_template_name
from tunelab.config.training_fields import OptionField, dataclass_options
from tunelab.config.training_options import TRAINING_DEFAULTS, tracker_names
from tunelab.config.training_values import training_value_fields
from tunelab.errors import ConfigError

COMMAND_LINE = "the command line"

logger = logging.getLogger(__name__)


# Names that LlamaFactory configs (written for transformers 4) use for options transformers 5 renamed.
ALIASES = {
    "warmup_ratio": "warmup_steps", "evaluation_strategy": "eval_strategy",
    "early_stopping_steps": "early_stopping_patience",  # LlamaFactory's name: a count of evaluations, not steps
    "enable_liger_kernel": "use_liger_kernel",  # LlamaFactory's name for transformers' switch
}


def _apply_use_swanlab(raw: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
    """LlamaFactory's `use_swanlab: true` is report_to with swanlab added (false: nothing)."""
    if "use_swanlab" not in raw:
        return raw
    out = dict(raw)
    origin = origins.pop("use_swanlab")
    if not _coerce("use_swanlab", out.pop("use_swanlab"), bool):
        return out
    names = [name for name in tracker_names(out.get("report_to", "none")) if name != "none"]
    out["report_to"] = names if "swanlab" in names else [*names, "swanlab"]
    origins.setdefault("report_to", origin)
    return out


def _apply_aliases(raw: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
    out = dict(raw)
    for old, new in ALIASES.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{old} and {new} are the same option: keep {new}")
            out[new] = out.pop(old)
            origins[new] = origins.pop(old)
    return out


def _where(origin: str) -> str:
    return f"on {origin}" if origin == COMMAND_LINE else f"in {origin}"


def _shown(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def _habit_value(key: str, value: Any) -> tuple[bool, Any]:
    """(True, the accepted value `value` is) when it asks for what tunelab does anyway (config/llamafactory.py
    LLAMAFACTORY_HABITS), else (False, None). Command-line text is read as the accepted value's type."""
    for accepted in LLAMAFACTORY_HABITS[key]:
        if accepted is None or value is None:
            if accepted is value:
                return True, accepted
            continue
        try:
            typed = _coerce(key, value, accepted if isinstance(accepted, type) else type(accepted))
        except ConfigError:
            continue
        if accepted is int:
            same = typed >= 1  # any positive count
        else:
            same = typed.lower() == accepted if isinstance(accepted, str) else typed == accepted
        if same:
            return True, accepted
    return False, None


def _accept_llamafactory_habits(raw: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
    """LlamaFactory keys whose value asks for what tunelab does anyway: each accepted with one info line (and the
    tunelab options it stands for set); another value is refused with what to do instead."""
    out = dict(raw)
    for key in [k for k in raw if k in LLAMAFACTORY_HABITS]:
        value, origin = out.pop(key), origins.pop(key)
        matched, accepted = _habit_value(key, value)
        if not matched and set(LLAMAFACTORY_HABITS[key]) == {True, False}:
            raise ConfigError(f"{key}: expected true or false, got {value!r}", key=key)
        if not matched:
            takes = " or ".join("a positive integer" if v is int else _shown(v) for v in LLAMAFACTORY_HABITS[key])
            raise ConfigError(f"{key}: {_shown(value)} {_where(origin)}; LlamaFactory option: {llamafactory_advice(key)} "
                              f"(tunelab accepts {key}: {takes})", key=key)
        for option, implied in LLAMAFACTORY_HABIT_OPTIONS.get((key, accepted), {}).items():
            if option in out and _coerce(option, out[option], type(implied)) != implied:
                raise ConfigError(f"{key}: {_shown(value)} means {option}: {_shown(implied)}, but {option} is "
                                  f"{_shown(out[option])}: keep one", key=key)
            out[option], origins[option] = implied, origin
        logger.info("%s: %s %s", key, _shown(value), LLAMAFACTORY_HABITS[key][accepted])
    return out


def _check_liger_device(training_values: dict[str, Any], name: str, machine: Machine) -> None:
    """Liger's kernels are Triton programs for CUDA GPUs: refused before anything loads where there is none."""
    if not training_values.get("use_liger_kernel"):
        return
    if not machine.has_cuda:
        raise ConfigError(f"{name}: Liger kernels need a CUDA GPU (Triton); this machine has none: remove it",
                          key="use_liger_kernel", fix=f"remove {name}")
    if training_values.get("use_cpu"):
        raise ConfigError(f"{name}: Liger kernels run on the GPU, but use_cpu is true: remove one of them",
                          key="use_liger_kernel")


def _unknown_keys_message(unknown: list[str], origins: dict[str, str], owners: dict) -> str:
    """Every unknown key in one message, grouped by where it came from, each with a close spelling or, for a
    LlamaFactory option tunelab lacks, what to do instead."""
    def detail(key: str) -> str | None:
        advice = llamafactory_advice(key)
        if advice is not None:
            return f"LlamaFactory option: {advice}"
        # Only a near spelling: a distant "match" (freeze_language_model → freeze_trainable_modules) misleads.
        close = difflib.get_close_matches(key, owners, n=1, cutoff=0.8)
        return f"did you mean '{close[0]}'?" if close else None

    help_hint = "see `tunelab train --help` for the options"
    if len(unknown) == 1:
        key = unknown[0]
        return f"unknown key '{key}' {_where(origins[key])}; {detail(key) or help_hint}"
    groups: dict[str, list[str]] = {}
    for key in unknown:
        text = detail(key)
        groups.setdefault(origins[key], []).append(f"'{key}'" + (f" → {text}" if text else ""))
    listed = "; ".join(f"{_where(origin)}: {'; '.join(keys)}" for origin, keys in groups.items())
    tail = f"; {help_hint}" if any(detail(key) is None for key in unknown) else ""
    return f"{len(unknown)} unknown keys {'— ' if len(groups) > 1 else ''}{listed}{tail}"


def _group_fields(group: type) -> dict[str, OptionField]:
    if not dataclasses.is_dataclass(group):  # TrainingValues (purpose "data"): the options as declared

        return training_value_fields()
    return dataclass_options(group)


def _fields_by_key(groups: tuple[type, ...]) -> dict[str, tuple[type, OptionField]]:
    owners: dict[str, tuple[type, OptionField]] = {}
    for group in groups:
        for name, option in _group_fields(group).items():
            owners.setdefault(name, (group, option))
    return owners


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """`key=value` and `--key value` / `--key=value` / bare `--flag` (true) into a dict of strings."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key = arg[2:]
            if "=" in key:
                key, value = key.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and "=" not in argv[i + 1]:
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        elif "=" in arg:
            key, value = arg.split("=", 1)
        else:
            raise ConfigError(f"cannot read override {arg!r}: write key=value or --key value")
        overrides[key.replace("-", "_")] = value
        i += 1
    return overrides


def _base_types(annotation: Any) -> tuple[Any, ...]:
    """The non-None members of a (possibly Optional / union) annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML or command-line value to the declared type, or fail naming the key."""
    if value is None:
        return None
    candidates = _base_types(annotation)
    for typ in candidates:
        origin = typing.get_origin(typ)
        if origin is list:
            (item_type,) = typing.get_args(typ) or (str,)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (list, tuple)):
                return [_coerce(key, v, item_type) for v in value]
        if origin is typing.Literal:
            allowed = typing.get_args(typ)
            if value in allowed:
                return value
            if isinstance(value, str) and len(candidates) == 1:
                raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
            continue
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
        elif typ is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                try:
                    return int(value)
                except ValueError:
                    pass
        elif typ is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        elif typ is str:
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
        elif typ is dict or typing.get_origin(typ) is dict:
            if isinstance(value, dict):
                return value
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    return parsed
        elif isinstance(typ, type) and issubclass(typ, str):  # str-valued enums of transformers
            return value if isinstance(value, str) else str(value)
        else:  # anything exotic (enums, unions with classes): let the dataclass decide
            return value
    if any(t is dict or typing.get_origin(t) is dict for t in candidates):
        raise ConfigError(
            f"{key}: expected a mapping (YAML, or JSON on the command line: {key}='{{\"name\": value}}'), got {value!r}"
        )
    names = " or ".join(getattr(t, "__name__", str(t)) for t in candidates)
    raise ConfigError(f"{key}: expected {names}, got {value!r}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level")
    return data


PRECISION_KEYS = ("bf16", "fp16")


def _auto_precision(training_values: dict[str, Any], purpose: str, machine: Machine) -> str | None:
    """Set bf16 / fp16 where they were left to auto (config/precision.py), and say what was chosen and why.
    None when both were given, or for commands that train and compute nothing (export, serve)."""
    given = {key: training_values.get(key) for key in PRECISION_KEYS}
    if purpose in ("export", "serve") or True in given.values() or None not in given.values():
        return None
    # The launching process of a multi-process run keeps its hands off the GPUs (train/launch.py): it decides
    # for the CPU, only to check the config; each worker decides again for its own device.
    use_cpu = bool(training_values.get("use_cpu")) or machine.accelerate_use_cpu
    facts = machine.facts(use_cpu)
    choice = choose_precision(facts)
    if choice.mode == "bf16" and facts.kind == "cpu" and not use_cpu:
        # use_cpu: false said outright on a machine without a GPU: transformers refuses bf16 on a CPU without it.
        choice = PrecisionChoice("fp32", f"{choice.reason}, but use_cpu is false (transformers trains bf16 on a CPU "
                                 "only with use_cpu: true)")
    bf16, fp16 = resolve_flags(given["bf16"], given["fp16"], choice)
    training_values["bf16"], training_values["fp16"] = bf16, fp16
    chosen = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    explicit = ", ".join(f"{k}: {str(v).lower()}" for k, v in given.items() if v is not None)
    wins = "" if chosen == choice.mode else f" (auto would choose {choice.mode}; {explicit} wins)"
    return f"{chosen} (auto): {choice.reason}{wins}"


Purpose = Literal["train", "data", "eval", "export", "estimate", "serve"]


@dataclass
class ConfigValues:
    """A configuration read, merged and typed, each option group's values not yet built into its dataclass (the
    DeepSpeed file is checked between the two steps: transformers reads it while TrainingArguments is built)."""

    groups: tuple[type, ...]
    values: dict[type, dict[str, Any]]
    given: set[str]  # the keys the file and the command line set
    purpose: str
    source: str | None
    precision: str | None

    @property
    def training(self) -> dict[str, Any]:
        return self.values[self.groups[4]]


def read_values(
    path: str | Path | None, overrides: dict[str, Any] | list[str] | None, purpose: Purpose, machine: Machine
) -> ConfigValues:
    """Read, merge and type a configuration, and check the training values (ranges, precision flags). `machine`:
    what the defaults that depend on the hardware read (use_cpu, dataloader_pin_memory, bf16 / fp16 auto)."""
    raw: dict[str, Any] = dict(read_yaml(path)) if path else {}
    origins = dict.fromkeys(raw, str(path))
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    raw.update(overrides or {})
    origins.update(dict.fromkeys(overrides or {}, COMMAND_LINE))
    liger_name = "enable_liger_kernel" if "enable_liger_kernel" in raw else "use_liger_kernel"
    raw = _accept_llamafactory_habits(_apply_aliases(raw, origins), origins)
    raw = _apply_use_swanlab(raw, origins)

    # bf16 / fp16: auto is the default; the value is decided below, from the hardware, unless given.
    for key in PRECISION_KEYS:
        if key in raw and isinstance(raw[key], str) and raw[key].strip().lower() == "auto":
            del raw[key]
    groups, training = option_groups(purpose), training_group(purpose)
    owners = _fields_by_key(groups)
    unknown = [k for k in raw if k not in owners]
    if unknown:
        raise ConfigError(_unknown_keys_message(unknown, origins, owners))

    values: dict[type, dict[str, Any]] = {group: {} for group in groups}
    values[training].update(TRAINING_DEFAULTS)
    if "use_cpu" not in raw and not machine.has_accelerator:
        # transformers refuses bf16 on a CPU-only machine unless use_cpu is said explicitly.
        values[training]["use_cpu"] = True
    for key, value in raw.items():
        group, option = owners[key]
        if option.metadata.get("const") is True and str(value).lower() in ("true", "1", "yes", "on"):
            values[group][key] = True  # a text option that is also a switch (fsdp: true)
            continue
        values[group][key] = _coerce(key, value, option.annotation)
    _resolve_template_alias(values[DataArguments])
    training_values = values[training]
    if "save_steps" in raw and "save_strategy" not in raw:
        training_values["save_strategy"] = "steps"  # a checkpoint interval means checkpoints (LlamaFactory, Trainer)
    if training_values.get("dataloader_num_workers", 0) > 0 and "dataloader_persistent_workers" not in raw:
        # Re-forking workers every epoch re-opens every file and memory map; keep them alive.
        training_values["dataloader_persistent_workers"] = True
    if training_values.get("early_stopping_patience") is not None or training_values.get("load_best_model_at_end"):
        training_values.setdefault("metric_for_best_model", "eval_loss")  # what early stopping watches by default
    metric = str(training_values.get("metric_for_best_model") or "")
    if metric.endswith("perplexity") and "greater_is_better" not in raw:
        training_values["greater_is_better"] = False  # transformers takes only names ending in "loss" as lower-is-better
    if "dataloader_pin_memory" not in raw:
        training_values["dataloader_pin_memory"] = machine.has_cuda  # pinning only helps host→GPU copies
    precision = _auto_precision(training_values, purpose, machine)
    if purpose == "train":
        _check_liger_device(training_values, liger_name, machine)

    if purpose == "train" and not training_values.get("output_dir"):
        raise ConfigError("output_dir is not set: add `output_dir: saves/my-run` to the config")
    if purpose == "eval" and not training_values.get("output_dir"):
        raise ConfigError("output_dir is not set: tunelab eval writes predictions.jsonl there; add output_dir=...")
    # Checks on training values that transformers would otherwise report in its own words first.
    checks.check_training_values(training_values)
    return ConfigValues(groups, values, set(raw), purpose, str(path) if path else None, precision)


def build_config(read: ConfigValues, warn: bool = True) -> RunConfig:
    """The option groups built from their values, and every value check of the purpose (config/checks.py).

    purpose "data" (`tunelab data ...`) and "estimate" read the config without training from it:
    output_dir may be unset or hold a finished run. "eval" writes its predictions into output_dir,
    which may hold the run being evaluated. "export" needs no dataset, template or output_dir, only
    the model (and adapter) and export_dir; "serve" (`tunelab chat / api cfg.yaml`) only the model and
    adapter (the engine checks the template it serves with). `warn`: log the warnings about options that
    have no effect (a process that only launches the workers leaves them to the workers).
    """
    built = []
    for group in read.groups:
        try:
            built.append(group(**read.values[group]))
        except (ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(f"invalid {group.__name__} values: {message}") from None
    config = RunConfig(*built, source=read.source, precision=read.precision)
    checks.check_config(config, read.purpose)
    if warn and read.purpose == "train":
        checks.warn_ineffective_keys(config.training, config.finetuning, config.precision, read.given)
    return config


def _resolve_template_alias(data_values: dict[str, Any]) -> None:
    """template: qwen3_nothink → qwen3 with template_kwargs {enable_thinking: false} (given template_kwargs win)."""
    name = data_values.get("template")
    if name is not None:
        data_values["template"], kwargs = resolve_template_name(name, data_values.get("template_kwargs"))
        if kwargs is not None:
            data_values["template_kwargs"] = kwargs


def resolved_dict(config: RunConfig) -> dict[str, Any]:
    """A YAML-ready dict of every option the run used (written to output_dir/tunelab_config.yaml)."""
    out: dict[str, Any] = {}
    for group in (config.model, config.data, config.finetuning, config.generation, config.export):
        out.update(dataclasses.asdict(group))
    training = config.training.to_dict()
    default_training = _default_training_dict(config.training.output_dir)
    out.update({k: v for k, v in training.items() if v != default_training.get(k) or k in TRAINING_DEFAULTS})
    out["output_dir"] = config.training.output_dir
    return out


def _default_training_dict(output_dir: str) -> dict[str, Any]:
    """TrainingArguments' defaults (ours applied) as to_dict() writes them.

    Building TrainingArguments sets up the process's accelerate state; a second, default instance
    would reset it and silently turn a distributed run into independent single-process runs. The
    existing state is reused instead (transformers' `use_configured_state`).
    """
    # lazy: TrainingArguments imports peft and bitsandbytes (peft alone 7.8 s): commands that train only
    from tunelab.config.training_args import TrainingArguments

    try:
        default = TrainingArguments(
            output_dir=output_dir, accelerator_config={"use_configured_state": True}, **TRAINING_DEFAULTS
        )
    except ValueError:  # no state configured yet in this process: nothing to disturb
        default = TrainingArguments(output_dir=output_dir, **TRAINING_DEFAULTS)
    return default.to_dict()
