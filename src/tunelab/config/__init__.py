"""Configuration: option groups (args), YAML + override loading (loader) and cross-argument checks (checks)."""

from tunelab.config.args import (
    DataArguments,
    FinetuningArguments,
    GenerationArguments,
    ModelArguments,
    RunConfig,
    TrainingArguments,
)
from tunelab.config.loader import load_config

__all__ = [
    "DataArguments",
    "FinetuningArguments",
    "GenerationArguments",
    "ModelArguments",
    "RunConfig",
    "TrainingArguments",
    "load_config",
]
