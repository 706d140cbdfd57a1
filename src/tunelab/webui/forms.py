"""The configuration form: its fields (one per config key), form values <-> options <-> YAML, and the checks.

The form's layout (which keys, in which order, their labels and sections) is written here; everything else a field
is comes from the option's own declaration in config/ (args.py, training_options.py, and transformers' training
options read from its source by training_fields.py, never imported): its kind and choices from the type, its
placeholder from the default (HINTS where the default alone says nothing useful), its tooltip from the help, and
when it shows from its applicability rules.

A field left empty is a key left out, so the YAML the form shows holds exactly the keys the person set, and a
loaded YAML fills the fields it has keys for; keys without a field of their own live in the "other options"
YAML box and round-trip unchanged. Checking builds the same RunConfig as `tunelab train` (config/loader.py:
load_config, which runs config/checks.py) and reports its one-line message, with the field it names.
Paths typed into the form are confined to the allowed roots (security.py) before anything reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from tunelab.config.applicability import default_of, rules_of
from tunelab.config.args import (DataArguments, ExportArguments, FinetuningArguments, GenerationArguments,
                                 ModelArguments)
from tunelab.config.training_fields import OptionField, transformers_training_fields
from tunelab.config.training_options import TRAINING_DEFAULTS, TRAINING_NOTES, TrainingOptions
from tunelab.errors import ConfigError, TunelabError
from tunelab.webui.security import Roots


@dataclass(frozen=True)
class Field:
    key: str
    label: str
    kind: str = "text"  # text | number | select
    choices: tuple[str, ...] = ()
    hint: str = ""  # shown as the placeholder (a select: its empty choice): the default, or an example
    section: str = "run"
    shows_for: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> values under which the field shows
    help: str = ""  # the option's help text, the row's tooltip


# The form's layout: the keys it has a field for, by section, in the order it shows them, with their labels.
# What each field is — kind, choices, default, help, when it shows — is the option's own declaration (form_fields).
LAYOUT: dict[str, dict[str, str]] = {
    "model": {
        "stage": "Stage",
        "model_name_or_path": "Model folder",
        "template": "Chat template",
        "finetuning_type": "Finetuning type",
        "lora_rank": "LoRA rank",
        "lora_alpha": "LoRA alpha",
        "lora_target": "LoRA target modules",
    },
    "data": {
        "dataset_dir": "Dataset folder",
        "dataset": "Datasets",
        "eval_dataset": "Eval datasets",
        "val_size": "Eval split (val_size)",
        "max_samples": "Max samples per dataset",
        "cutoff_len": "Cutoff length (tokens)",
        "packing": "Packing",
    },
    "train": {
        "per_device_train_batch_size": "Batch size",
        "gradient_accumulation_steps": "Gradient accumulation",
        "learning_rate": "Learning rate",
        "num_train_epochs": "Epochs",
        "max_steps": "Max steps",
        "lr_scheduler_type": "LR schedule",
        "warmup_steps": "Warmup (steps, or fraction < 1)",
        "bf16": "bf16",
        "fp16": "fp16",
        "logging_steps": "Log every (steps)",
        "save_steps": "Checkpoint every (steps)",
    },
    "output": {
        "output_dir": "Output folder",
        "overwrite_output_dir": "Overwrite output folder",
        "seed": "Seed",
    },
}
FIELD_KEYS = tuple(key for keys in LAYOUT.values() for key in keys)
OTHER = "other"  # the form's YAML box for every other key
SECTIONS = {"model": "Model and method", "data": "Data", "train": "Training", "output": "Output"}

# Placeholders where the default alone says nothing useful: an unset option tunelab fills in (None, or a value it
# reads specially), or a free-text field better shown by an example of what goes in it.
HINTS = {
    "model_name_or_path": "tiny, or a model folder / Hub id",  # the default 'tiny' hides that a path goes here
    "template": "model",  # None: the model folder's own chat_template, as "model" (data/templates/choice.py)
    "lora_alpha": "2 × rank",  # None: 2 * lora_rank (FinetuningArguments' help)
    "dataset_dir": "built-in datasets only",  # None: only the built-in registry
    "dataset": "names, comma separated",  # None: an example of the format (the check asks for one)
    "eval_dataset": "names, comma separated",  # None: as dataset
    "max_samples": "all",  # None: no limit
    "max_steps": "-1 (epochs decide)",  # -1 alone does not say that num_train_epochs then decides
    "bf16": "auto",  # transformers declares False; tunelab leaves it unset and decides (config/precision.py)
    "fp16": "auto",  # as bf16
    "save_steps": "no checkpoints",  # 500 acts only with save_strategy steps; tunelab's default save_strategy is no
    "output_dir": "saves/my-run",  # None: an example (a run needs one)
}
BOOL = ("", "true", "false")  # "": the option left out, so its default holds
# Choices the options do not declare as a Literal.
CHOICES = {
    # transformers types it as its SchedulerType enum (transformers.trainer_utils, which imports peft: not here);
    # the form offers the usual four, each a SchedulerType value (tests/webui/test_forms.py holds them so).
    "lr_scheduler_type": ("", "linear", "cosine", "constant", "constant_with_warmup"),
}
OPTION_GROUPS = (ModelArguments, DataArguments, FinetuningArguments, GenerationArguments, TrainingOptions,
                 ExportArguments)


@functools.cache
def declared_options() -> dict[str, OptionField]:
    """Every option a config takes, as declared: transformers' training options (read from its source, not
    imported), then tunelab's groups (which win where both name one, as in TrainingArguments), with the defaults
    tunelab changes (TRAINING_DEFAULTS). A transformers option's help is its first sentence and tunelab's note,
    as `tunelab train --help` shows it."""
    options = {}
    for name, option in transformers_training_fields().items():
        text = " ".join(str(option.metadata.get("help", "")).split())
        text = text.split(". ")[0].rstrip(".") + "." if text else ""
        text = f"{text} {TRAINING_NOTES[name]}" if name in TRAINING_NOTES else text
        options[name] = dataclasses.replace(option, metadata=MappingProxyType({**option.metadata, "help": text}))
    for group in OPTION_GROUPS:
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            if f.init and not f.name.startswith("_"):
                options[f.name] = OptionField(f.name, hints[f.name], default_of(f), f.metadata)
    for name, value in TRAINING_DEFAULTS.items():
        options[name] = dataclasses.replace(options[name], default=value)
    return options


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of an annotation, None left out (`int | None` -> (int,))."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _choices(option: OptionField) -> tuple[str, ...]:
    (member, *more) = _members(option.annotation)
    if more:
        return ()
    if typing.get_origin(member) is typing.Literal:
        return ("", *map(str, typing.get_args(member)))
    return BOOL if member is bool else ()


def _kind(option: OptionField, choices: tuple[str, ...]) -> str:
    if choices:
        return "select"
    numbers = _members(option.annotation)
    return "number" if all(t in (int, float) for t in numbers) else "text"


def default_text(value: Any) -> str:
    """A default as the form would take it typed: 3.0 -> "3", False -> "false", ["all"] -> "all"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "" if value is None or value is dataclasses.MISSING else str(value)


def _shows_for(option: OptionField, options: dict[str, OptionField]) -> dict[str, tuple[str, ...]]:
    """The option's applicability rules (config/applicability.py) as values of the deciding fields; "" (left
    out) is among them when the deciding option's default is. A rule on an option the form has no field for
    is left to the check: the page cannot follow a value typed in the YAML box."""
    shows = {}
    for rule in rules_of(option):
        if rule.key in FIELD_KEYS:
            unset = ("",) if default_text(options[rule.key].default) in rule.values else ()
            shows[rule.key] = (*unset, *rule.values)
    return shows


def template_choices() -> tuple[str, ...]:
    from tunelab.data.templates import TEMPLATE_NAMES  # lazy: the web UI starts without the data stack

    return ("", "model", *TEMPLATE_NAMES)  # "model": the model folder's own chat_template


@functools.cache
def _form_fields() -> tuple[Field, ...]:
    options = declared_options()
    fields = []
    for section, labels in LAYOUT.items():
        for key, label in labels.items():
            option = options[key]
            choices = template_choices() if key == "template" else CHOICES.get(key) or _choices(option)
            fields.append(Field(key, label, _kind(option, choices), choices,
                                HINTS.get(key, default_text(option.default)), section, _shows_for(option, options),
                                " ".join(str(option.metadata.get("help", "")).split())))
    return tuple(fields)


def form_fields() -> list[Field]:
    """The form's fields: LAYOUT's keys with what their options declare."""
    return list(_form_fields())


def options_from_form(form: dict[str, Any]) -> dict[str, Any]:
    """The options a form sets: its non-empty fields (as typed: the loader converts them as it does
    command-line values), then the keys of its "other options" YAML box."""
    options: dict[str, Any] = {}
    for key in FIELD_KEYS:
        value = form.get(key)
        if value is not None and str(value).strip() != "":
            options[key] = str(value).strip()
    other = str(form.get(OTHER) or "").strip()
    if other:
        try:
            extra = yaml.safe_load(other)
        except yaml.YAMLError as exc:
            raise ConfigError(f"other options: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError("other options: expected key: value lines")
        taken = [k for k in extra if k in options]
        if taken:
            raise ConfigError(f"other options: {', '.join(map(str, taken))} has its own field; set it there")
        options.update({str(k): v for k, v in extra.items()})
    return options


def _yaml_value(text: Any) -> Any:
    """A typed field value as YAML would write it (2.0e-3 stays a number, tiny stays text)."""
    if not isinstance(text, str):
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (int, float, bool)) else text


def options_yaml(options: dict[str, Any]) -> str:
    """The YAML file `tunelab train` reads for these options."""
    typed = {key: _yaml_value(value) for key, value in options.items()}
    return yaml.safe_dump(typed, sort_keys=False, default_flow_style=False, allow_unicode=True)


def form_from_yaml(text: str) -> dict[str, str]:
    """A YAML config as form values: the keys with a field fill it, the rest go to the "other options" box."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(f"YAML: {where}not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError("YAML: expected a mapping of key: value at the top level")
    form: dict[str, str] = {}
    rest: dict[str, Any] = {}
    for key, value in data.items():
        if key in FIELD_KEYS and not isinstance(value, (dict, list)) or key in ("dataset", "eval_dataset", "lora_target"):
            form[key] = ",".join(map(str, value)) if isinstance(value, list) else _field_text(value)
        else:
            rest[key] = value
    form[OTHER] = yaml.safe_dump(rest, sort_keys=False, default_flow_style=False) if rest else ""
    return form


def _field_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


@dataclass
class CheckResult:
    ok: bool
    message: str = ""
    key: str | None = None  # the field the message is about, when the message names one

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "message": self.message, "key": self.key}


_NAMED_KEY = re.compile(r"^(?:unknown key '|invalid \w+ values: )?'?([a-z_][a-z0-9_]*)'?[: ]")


def key_of_message(message: str, options: dict[str, Any]) -> str | None:
    """The config key a check's message is about: the messages start with it ("cutoff_len: ...")."""
    match = _NAMED_KEY.match(message)
    if match and match.group(1) in options:
        return match.group(1)
    for key in options:  # "... needs an eval set: set eval_dataset ..." and the like: the first key it names
        if re.search(rf"\b{re.escape(key)}\b", message):
            return key
    return None


def check_options(options: dict[str, Any], roots: Roots, purpose: str = "train"):
    """(RunConfig or None, CheckResult): the paths confined, then the config built and checked as the CLI does."""
    # lazy: the web UI starts without torch, datasets and transformers (torch alone 2.8 s)
    from tunelab.preflight import load_config

    try:
        roots.check_options(options)
        config = load_config(None, dict(options), purpose=purpose, warn=False)
    except TunelabError as exc:
        message = str(exc)
        key = getattr(exc, "key", None)  # a check that knows its key says so (ConfigError.key); else the message's
        return None, CheckResult(False, message, key if key in options else key_of_message(message, options))
    return config, CheckResult(True, "the config passes the checks of tunelab train")
