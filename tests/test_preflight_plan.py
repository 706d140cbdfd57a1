"""preflight.py makes the plan once, from new values: what its checks resolve travels in new frozen values, and the
config it built from the file is never changed in place (its option groups are frozen; TrainingArguments, which
tunelab does not freeze, is copied)."""

from __future__ import annotations

import dataclasses

import pytest

from tunelab import preflight
from tunelab.config.loader import build_config


def test_preflight_resolves_into_new_values_and_leaves_the_built_config_as_it_was(tmp_path, monkeypatch) -> None:
    built = []

    def keep(read, warn=True):
        config = build_config(read, warn)
        built.append((config, dict(vars(config.training))))
        return config

    monkeypatch.setattr(preflight, "build_config", keep)
    plan = preflight.plan_run(None, {
        "model_name_or_path": "tiny", "dataset": "demo_sort", "template": "chatml", "output_dir": str(tmp_path / "out"),
        "qat": "int8-int4",
    })
    ((config, training_before),) = built
    changed = [name for name, value in training_before.items() if vars(config.training)[name] is not value]
    assert changed == [], f"preflight set TrainingArguments in place: {changed}"
    assert config.finetuning.qat_group_size is None  # as the file left it ...
    assert plan.config.finetuning.qat_group_size == 32  # ... and resolved in the plan
    assert plan.config.training is not config.training  # report_to, checked, is set on a copy


def test_the_option_groups_and_the_config_are_frozen(tmp_path) -> None:
    config = preflight.load_config(None, {"model_name_or_path": "tiny", "dataset": "demo_sort", "template": "chatml",
                                          "output_dir": str(tmp_path / "out")}, purpose="data")
    for group in ("model", "data", "finetuning", "generation", "export"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(config, group), "cutoff_len", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data = config.data  # type: ignore[misc]
