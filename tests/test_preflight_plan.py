"""preflight.py makes the plan once, from new values: what its checks resolve travels in new frozen values, and the
config it built from the file is never changed in place (its option groups are frozen; TrainingArguments, which
tunelab does not freeze, is copied). The run trains with the TrainingArguments the plan holds, never changed while it
runs, and the functions it calls take the option groups they read."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import transformers

import tunelab
from tunelab import preflight
from tunelab.config.args import RunConfig
from tunelab.config.loader import build_config
from tunelab.run_folder import complete_checkpoints
from tunelab.train.recipe import recipe_for
from tunelab.train.run import run


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


# ---- the run: the plan's TrainingArguments are the ones it trains with, never changed while it runs ----------------

def _plan(tmp_path, **options):
    return preflight.plan_run(None, {
        "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 16,
        "cutoff_len": 48, "per_device_train_batch_size": 4, "max_steps": 2, "logging_steps": 1, "disable_tqdm": True,
        "plot_loss": False, "dataloader_num_workers": 0, "output_dir": str(tmp_path / "out"), **options,
    })


def test_reading_a_stream_leaves_the_training_arguments_as_planned(tmp_path) -> None:
    plan = _plan(tmp_path, stage="pt", dataset="demo_corpus", streaming=True)
    planned = plan.config.training.to_dict()
    recipe_for(plan).datasets()
    assert plan.config.training.to_dict() == planned
    assert plan.config.training.accelerator_config.dispatch_batches is False  # made so by the plan, before the run


@pytest.mark.slow
def test_training_leaves_the_training_arguments_as_planned(tmp_path) -> None:
    seen = []

    class WatchThePlan(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append((plan.config.training.save_total_limit, args.save_total_limit))

    plan = dataclasses.replace(_plan(tmp_path, save_steps=1, save_total_limit=1),
                               user_callbacks=((WatchThePlan, {}),))
    planned = plan.config.training.to_dict()
    run(plan)
    assert seen == [(1, None), (1, None)]  # the plan keeps the limit; the Trainer's own copy holds none ...
    assert plan.config.training.to_dict() == planned
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == ["checkpoint-2"]  # ... tunelab rotates


# ---- functions take the option groups they read -------------------------------------------------------------------

# The functions still allowed to take the whole RunConfig, and the one word of why: an entry point that reads most of
# it, one that writes every option into a run record, one that builds a RunPlan from it, or one that hands it on to
# `estimate`. Any other function takes the option groups (or the values) it reads.
WHOLE_CONFIG = {
    "config/checks.py:check_config": "entry",
    "config/loader.py:resolved_dict": "record",
    "export/merge.py:export_model": "entry",
    "infer/predict.py:run_predict": "entry",
    "train/estimate.py:estimate": "entry",
    "train/estimate.py:row_lengths": "plan",
    "train/oom.py:out_of_memory_message": "estimate",
    "train/outputs.py:run_options": "record",
    "train/outputs.py:write_run_start": "record",
    "webui/tryout.py:preview": "plan",
}


def _takes_whole_config(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A parameter annotated RunConfig, or an unannotated `config` whose option groups the body reads."""
    groups = {field.name for field in dataclasses.fields(RunConfig)}
    for arg in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs):
        if arg.annotation is not None and "RunConfig" in ast.unparse(arg.annotation):
            return True
        if arg.annotation is None and arg.arg == "config" and any(
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config"
            and node.attr in groups for node in ast.walk(function)
        ):
            return True
    return False


def test_only_the_listed_functions_take_the_whole_run_config() -> None:
    package = Path(tunelab.__file__).parent
    found = set()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_whole_config(node):
                found.add(f"{path.relative_to(package).as_posix()}:{node.name}")
    assert not found - WHOLE_CONFIG.keys(), "pass these the option groups they read, not the whole RunConfig"
    assert not WHOLE_CONFIG.keys() - found, "no longer take the whole RunConfig: remove them from WHOLE_CONFIG"
