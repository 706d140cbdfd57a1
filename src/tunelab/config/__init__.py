"""Configuration: option groups (args), YAML + override loading (loader) and cross-argument checks (checks).

TrainingArguments lives in tunelab.config.training_args (imported only by commands that train: it imports peft)."""

from tunelab.config.args import (
    DataArguments,
    FinetuningArguments,
    GenerationArguments,
    ModelArguments,
    RunConfig,
)
from tunelab.config.loader import load_config

__all__ = [
    "DataArguments",
    "FinetuningArguments",
    "GenerationArguments",
    "ModelArguments",
    "RunConfig",
    "load_config",
]
