"""The configuration form: its fields (one per config key), form values <-> options <-> YAML, and the checks.

A field left empty is a key left out, so the YAML the form shows holds exactly the keys the person set, and a
loaded YAML fills the fields it has keys for; keys without a field of their own live in the "other options"
YAML box and round-trip unchanged. Checking builds the same RunConfig as `tunelab train` (config/loader.py:
load_config, which runs config/checks.py) and reports its one-line message, with the field it names.
Paths typed into the form are confined to the allowed roots (security.py) before anything reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from tunelab.errors import ConfigError, TunelabError
from tunelab.webui.security import Roots


@dataclass(frozen=True)
class Field:
    key: str
    label: str
    kind: str = "text"  # text | number | select
    choices: tuple[str, ...] = ()
    hint: str = ""  # shown as the placeholder: the default, or an example
    section: str = "run"
    shows_for: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> values under which the field shows


BOOL = ("", "true", "false")

# The keys the form has a field for, in the order the form shows them.
FIELDS: tuple[Field, ...] = (
    Field("stage", "Stage", "select", ("", "pt", "sft", "rm", "dpo", "kto", "ppo", "grpo"), "sft", "model"),
    Field("model_name_or_path", "Model folder", hint="tiny, or a model folder / Hub id", section="model"),
    Field("template", "Chat template", "select", (), "none", "model"),  # choices filled from the built-ins
    Field("finetuning_type", "Finetuning type", "select", ("", "lora", "freeze", "full"), "lora", "model"),
    Field("lora_rank", "LoRA rank", "number", hint="8", section="model", shows_for={"finetuning_type": ("", "lora")}),
    Field("lora_alpha", "LoRA alpha", "number", hint="2 × rank", section="model",
          shows_for={"finetuning_type": ("", "lora")}),
    Field("lora_target", "LoRA target modules", hint="all", section="model", shows_for={"finetuning_type": ("", "lora")}),
    Field("dataset_dir", "Dataset folder", hint="built-in datasets only", section="data"),
    Field("dataset", "Datasets", hint="names, comma separated", section="data"),
    Field("eval_dataset", "Eval datasets", hint="names, comma separated", section="data"),
    Field("val_size", "Eval split (val_size)", "number", hint="0", section="data"),
    Field("max_samples", "Max samples per dataset", "number", hint="all", section="data"),
    Field("cutoff_len", "Cutoff length (tokens)", "number", hint="2048", section="data"),
    Field("packing", "Packing", "select", BOOL, "false", "data"),
    Field("per_device_train_batch_size", "Batch size", "number", hint="8", section="train"),
    Field("gradient_accumulation_steps", "Gradient accumulation", "number", hint="1", section="train"),
    Field("learning_rate", "Learning rate", "number", hint="5e-05", section="train"),
    Field("num_train_epochs", "Epochs", "number", hint="3", section="train"),
    Field("max_steps", "Max steps", "number", hint="-1 (epochs decide)", section="train"),
    Field("lr_scheduler_type", "LR schedule", "select", ("", "linear", "cosine", "constant", "constant_with_warmup"),
          "linear", "train"),
    Field("warmup_steps", "Warmup (steps, or fraction < 1)", "number", hint="0", section="train"),
    Field("bf16", "bf16", "select", BOOL, "auto", "train"),
    Field("fp16", "fp16", "select", BOOL, "auto", "train"),
    Field("logging_steps", "Log every (steps)", "number", hint="10", section="train"),
    Field("save_steps", "Checkpoint every (steps)", "number", hint="no checkpoints", section="train"),
    Field("output_dir", "Output folder", hint="saves/my-run", section="output"),
    Field("overwrite_output_dir", "Overwrite output folder", "select", BOOL, "false", "output"),
    Field("seed", "Seed", "number", hint="42", section="output"),
)
FIELD_KEYS = tuple(f.key for f in FIELDS)
OTHER = "other"  # the form's YAML box for every other key
SECTIONS = {"model": "Model and method", "data": "Data", "train": "Training", "output": "Output"}


def template_choices() -> tuple[str, ...]:
    from tunelab.data.templates import TEMPLATE_NAMES  # noqa: PLC0415

    return ("", "model", *TEMPLATE_NAMES)  # "model": the model folder's own chat_template


def form_fields() -> list[Field]:
    return [Field(f.key, f.label, f.kind, template_choices(), f.hint, f.section) if f.key == "template" else f
            for f in FIELDS]


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
    from tunelab.preflight import load_config  # noqa: PLC0415

    try:
        roots.check_options(options)
        config = load_config(None, dict(options), purpose=purpose, warn=False)
    except TunelabError as exc:
        message = str(exc)
        key = getattr(exc, "key", None)  # a check that knows its key says so (ConfigError.key); else the message's
        return None, CheckResult(False, message, key if key in options else key_of_message(message, options))
    return config, CheckResult(True, "the config passes the checks of tunelab train")
