"""Configuration: option groups (args), YAML + override loading (loader) and the checks of option values (checks).
Pure values: nothing here reads a model, a dataset or the environment (tunelab/preflight.py does, after it).

TrainingArguments lives in tunelab.config.training_args (imported only by commands that train: it imports peft)."""

from tunelab.config.args import (
    DataArguments,
    FinetuningArguments,
    GenerationArguments,
    ModelArguments,
    RunConfig,
)

__all__ = [
    "DataArguments",
    "FinetuningArguments",
    "GenerationArguments",
    "ModelArguments",
    "RunConfig",
]
