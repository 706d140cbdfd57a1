"""`tunelab data` reads training options from transformers' source (config/training_fields.py) into TrainingValues
instead of building TrainingArguments: the same options, types, defaults and messages as a training run's."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import transformers

from tests.config.configs import write
from tunelab.config.training_options import TrainingOptions
from tunelab.preflight import load_config
from tunelab.config.training_fields import METADATA, transformers_training_fields
from tunelab.config.training_values import TrainingValues, training_value_fields
from tunelab.errors import ConfigError

PLAIN = (bool, int, float, str, dict, list, tuple, type(None))


def _plain(annotation):
    """An annotation with every class the loader does not convert (transformers' enums...) as `object`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return frozenset(_plain(a) for a in args)
    if origin is typing.Literal:
        return annotation
    if origin is not None:
        return (origin, tuple(_plain(a) for a in args))
    return annotation if annotation in PLAIN or annotation is typing.Any else object


def test_transformers_options_read_from_source_equal_the_imported_class() -> None:
    hints = typing.get_type_hints(transformers.TrainingArguments)
    imported = [f for f in dataclasses.fields(transformers.TrainingArguments) if f.init and not f.name.startswith("_")]
    read = transformers_training_fields()
    assert list(read) == [f.name for f in imported]
    for f in imported:
        option = read[f.name]
        assert dict(option.metadata) == {k: v for k, v in f.metadata.items() if k in METADATA}, f.name
        assert _plain(option.annotation) == _plain(hints[f.name]), f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name == "optim":  # computed in the class body from the torch version: not a literal
            assert option.default is None and default in ("adamw_torch", "adamw_torch_fused")
        else:
            assert option.default == default, f.name


def test_tunelab_options_win_where_both_declare_one() -> None:
    fields = training_value_fields()
    ours = {f.name: f for f in dataclasses.fields(TrainingOptions)}
    assert ours["resume_from_checkpoint"].name in transformers_training_fields()  # declared by both
    assert fields["resume_from_checkpoint"].metadata["help"] == ours["resume_from_checkpoint"].metadata["help"]
    assert set(fields) == set(transformers_training_fields()) | set(ours)
    with pytest.raises(TypeError, match="unexpected training options: lerning_rate"):
        TrainingValues(lerning_rate=1.0)


def test_data_purpose_holds_the_values_a_training_run_would(tmp_path, base) -> None:
    given = {**base, "seed": 7, "per_device_train_batch_size": "3", "per_device_eval_batch_size": 5,
             "learning_rate": "3e-4", "bf16": False, "eval_strategy": "steps", "eval_steps": 10,
             "val_size": 0.1, "nan_policy": "skip"}
    trained = load_config(write(tmp_path, given))
    read = load_config(write(tmp_path, given), purpose="data")
    assert isinstance(read.training, TrainingValues)
    for key in ("seed", "per_device_train_batch_size", "per_device_eval_batch_size", "learning_rate", "bf16",
                "fp16", "output_dir", "use_cpu", "nan_policy", "logging_steps", "remove_unused_columns", "num_train_epochs"):
        assert getattr(read.training, key) == getattr(trained.training, key), key
    assert read.training.per_device_train_batch_size == 3 and read.training.learning_rate == 3e-4
    assert read.training.eval_strategy == "steps"  # as given: nothing is derived (transformers makes it an enum)


@pytest.mark.parametrize(("extra", "message"), [
    ({"learnig_rate": 1e-4}, "unknown key 'learnig_rate' in {cfg}; did you mean 'learning_rate'?"),
    ({"per_device_train_batch_size": "two"}, "per_device_train_batch_size: expected int, got 'two'"),
    ({"nan_policy": "retry"}, "nan_policy: 'retry' is not one of stop, skip"),
    ({"max_steps": 0, "streaming": True}, None),  # a check that reads a training value: same message as train's
])
def test_data_purpose_refuses_what_train_refuses_in_the_same_words(tmp_path, base, extra, message) -> None:
    path = write(tmp_path, {**base, **extra})
    with pytest.raises(ConfigError) as trained:
        load_config(path)
    with pytest.raises(ConfigError) as read:
        load_config(path, purpose="data")
    assert str(read.value) == str(trained.value)
    if message is not None:
        assert str(read.value) == message.format(cfg=path)
