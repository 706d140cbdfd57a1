"""A run's training options as plain values, for the commands that read its data and never train.

`tunelab data stats|verify|coverage` and the web UI's data preview read a config whole (the same file trains),
check every key and type its value, and use a few training options (seed, batch sizes, output_dir, precision).
Building transformers' TrainingArguments for that would import peft and bitsandbytes; TrainingValues holds
the same options — transformers' as its source declares them (config/training_fields.py) and tunelab's
TrainingOptions — with their defaults and the given values, and derives nothing (no __post_init__).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from typing import Any

from tunelab.config.training_options import TrainingOptions
from tunelab.config.training_fields import OptionField, dataclass_options, transformers_training_fields


@functools.cache
def training_value_fields() -> dict[str, OptionField]:
    """transformers' training options, then tunelab's (which win where both name one, as in TrainingArguments)."""
    return {**transformers_training_fields(), **dataclass_options(TrainingOptions)}


class TrainingValues(types.SimpleNamespace):
    """The training options by name: defaults, with the given values over them."""

    def __init__(self, **given: Any):
        fields = training_value_fields()
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise TypeError(f"unexpected training options: {', '.join(unknown)}")
        defaults = {name: None if f.default is dataclasses.MISSING else copy.copy(f.default) for name, f in fields.items()}
        super().__init__(**{**defaults, **given})


def training_with(args, **changes: Any):
    """A copy of a run's training options (TrainingArguments or TrainingValues) holding `changes`, `args` left as
    it was: how a resolved training value reaches the plan. Set on the copy after its construction, because
    dataclasses.replace would run transformers' __post_init__ again (the accelerate state, the DeepSpeed file) on
    values it has already normalised."""
    new = copy.copy(args)
    for name, value in changes.items():
        setattr(new, name, value)
    return new
