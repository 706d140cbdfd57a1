"""The training loop's options, checked before anything loads: callbacks, early stopping, generate_at_eval,
and the LlamaFactory keys ignore_pad_token_for_loss / early_stopping_steps. Exact one-line messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.config.configs import error_of, write
from tunelab.config.metric_names import eval_metric_names
from tunelab.preflight import load_config

CALLBACKS = """\
import transformers

class Recorder(transformers.TrainerCallback):
    def __init__(self, path, every=1):
        self.path, self.every = path, every

class NotACallback:
    pass

recorder = Recorder("x")
"""
EVALUATING = {"eval_dataset": ["demo_reverse_test"], "eval_strategy": "steps", "eval_steps": 5}


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "my_callbacks.py").write_text(CALLBACKS)
    (folder / "broken.py").write_text("raise RuntimeError('boom')\n")
    return folder


# ---- callbacks --------------------------------------------------------------------------------------------


def test_callbacks_resolve_relative_to_the_config_file(tmp_path, base, user_file):
    path = user_file / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base, "callbacks": ["my_callbacks.py:Recorder"],
                                    "callback_kwargs": {"Recorder": {"path": "events.jsonl", "every": 2}}}))
    config = load_config(path)
    assert config.training.callbacks == ["my_callbacks.py:Recorder"]
    assert config.training.callback_kwargs == {"Recorder": {"path": "events.jsonl", "every": 2}}
    # on the command line: comma separated, kwargs as JSON
    config = load_config(path, ["callbacks=my_callbacks.py:Recorder", 'callback_kwargs={"Recorder": {"path": "e"}}'])
    assert config.training.callback_kwargs == {"Recorder": {"path": "e"}}


def test_callback_errors_are_one_line(tmp_path, base, user_file):
    f = user_file / "my_callbacks.py"
    cases = [
        ({"callbacks": ["Recorder"]},
         "callbacks: 'Recorder' names no class; write path/to/file.py:Class or package.module:Class"),
        ({"callbacks": ["missing.py:Recorder"]},
         f"callbacks: file missing.py or {tmp_path}/missing.py does not exist; give a path relative to the working "
         "directory or the config file"),
        ({"callbacks": [f"{f}:Nope"]},
         f"callbacks: {f} has no class 'Nope'; define class Nope(transformers.TrainerCallback)"),
        ({"callbacks": [f"{f}:NotACallback"]},
         f"callbacks: {f}:NotACallback is a class that does not subclass it, not a transformers.TrainerCallback; "
         "define class NotACallback(transformers.TrainerCallback)"),
        ({"callbacks": [f"{f}:recorder"]},
         f"callbacks: {f}:recorder is a Recorder, not a transformers.TrainerCallback; "
         "define class recorder(transformers.TrainerCallback)"),
        ({"callbacks": [f"{user_file}/broken.py:X"]},
         f"callbacks: importing {user_file}/broken.py failed: RuntimeError: boom"),
        ({"callbacks": ["no_such_package_xyz.mod:Cb"]},
         "callbacks: cannot import module 'no_such_package_xyz.mod' (No module named 'no_such_package_xyz'); check "
         "the name or use path/to/file.py:Cb"),
        ({"callbacks": [f"{f}:Recorder"]},
         "callback_kwargs: Recorder(): missing a required argument: 'path'"),
        ({"callbacks": [f"{f}:Recorder"], "callback_kwargs": {"Recorder": {"path": "p", "often": 3}}},
         "callback_kwargs: Recorder(often=..., path=...): got an unexpected keyword argument 'often'"),
        ({"callbacks": [f"{f}:Recorder"], "callback_kwargs": {"Recorder": {"path": "p"}, "Other": {}}},
         f"callback_kwargs: 'Other' names no entry of callbacks ({f}:Recorder); key them by class name"),
        ({"callback_kwargs": {"Recorder": {"path": "p"}}},
         "callback_kwargs is set but callbacks is not: name the callback classes in callbacks"),
        ({"callbacks": [f"{f}:Recorder"], "stage": "grpo", "reward_funcs": ["exact_match"]},
         "callbacks: stage grpo trains in its own loop, where the Trainer's callback events do not fire; remove "
         "callbacks (trainer_log.jsonl still records every logged step)"),
    ]
    for extra, message in cases:
        assert error_of(tmp_path, {**base, **extra}) == message


def test_callbacks_are_imported_only_when_training(tmp_path, base, user_file):
    """Nothing runs unless named, and only for the run that uses it: `tunelab data` / `estimate` do not import."""
    data = {**base, "callbacks": [f"{user_file}/broken.py:X"], "eval_dataset": ["demo_reverse_test"]}
    for purpose in ("data", "estimate", "eval"):
        load_config(write(tmp_path, data), purpose=purpose)


# ---- early stopping and metric_for_best_model -------------------------------------------------------------


def test_early_stopping_defaults_and_llamafactory_name(tmp_path, base):
    config = load_config(write(tmp_path, {**base, **EVALUATING, "early_stopping_steps": 3}))  # LlamaFactory's name
    args = config.training
    assert (args.early_stopping_patience, args.early_stopping_threshold) == (3, 0.0)
    assert (args.metric_for_best_model, args.greater_is_better) == ("eval_loss", False)
    config = load_config(write(tmp_path, {**base, **EVALUATING, "early_stopping_patience": 2,
                                          "metric_for_best_model": "perplexity"}))
    assert config.training.greater_is_better is False  # transformers alone would take perplexity as higher-is-better
    config = load_config(write(tmp_path, {**base, **EVALUATING, "early_stopping_patience": 2, "generate_at_eval": True,
                                          "metric_for_best_model": "eval_rouge_l"}))
    assert config.training.greater_is_better is True


def test_early_stopping_checks(tmp_path, base):
    cases = [
        ({"early_stopping_patience": 2},
         "early_stopping_patience needs an eval set to watch: set eval_dataset or val_size"),
        ({"early_stopping_patience": 2, "val_size": 0.1},
         "early_stopping_patience counts evaluations, but eval_strategy is 'no': set eval_strategy: steps with "
         "eval_steps (or epoch)"),
        ({**EVALUATING, "early_stopping_patience": 0},
         "early_stopping_patience must be at least 1 (evaluations without improvement), got 0"),
        ({**EVALUATING, "early_stopping_threshold": 0.1},
         "early_stopping_threshold only applies with early_stopping_patience: set it or remove the threshold"),
        ({**EVALUATING, "early_stopping_patience": 2, "metric_for_best_model": "eval_rouge"},
         "metric_for_best_model: 'eval_rouge' is not an eval metric this run logs (early_stopping_patience watches "
         "it); did you mean 'eval_loss'? it logs eval_loss, eval_perplexity"),
        ({**EVALUATING, "eval_dataset": ["demo_reverse_test", "demo_add_test"], "early_stopping_patience": 2},
         "metric_for_best_model: 'eval_loss' is not an eval metric this run logs (early_stopping_patience watches "
         "it); it logs eval_demo_reverse_test_loss, "
         "eval_demo_reverse_test_perplexity, eval_demo_add_test_loss, eval_demo_add_test_perplexity"),
        ({**EVALUATING, "load_best_model_at_end": True},
         "load_best_model_at_end: true reloads the best checkpoint, so checkpoints must be saved where evaluations "
         "happen: set save_strategy: steps (got no) with save_steps a multiple of eval_steps"),
        ({**EVALUATING, "load_best_model_at_end": True, "save_steps": 3},
         "load_best_model_at_end: true needs save_steps (3) to be a multiple of eval_steps (5), so that the best "
         "evaluation has a checkpoint"),
        ({"load_best_model_at_end": True},
         "load_best_model_at_end: true needs evaluations to pick the best: set eval_strategy (steps or epoch)"),
    ]
    for extra, message in cases:
        assert error_of(tmp_path, {**base, **extra}) == message
    grpo = {**base, "stage": "grpo", "reward_funcs": ["exact_match"], "early_stopping_patience": 2}
    assert error_of(tmp_path, grpo) == "early_stopping_patience: stage grpo has no evaluations to stop on; remove it"
    # the checkpoint at every evaluation: accepted
    load_config(write(tmp_path, {**base, **EVALUATING, "load_best_model_at_end": True, "save_steps": 10,
                                 "early_stopping_patience": 2}))


def test_eval_metric_names_follow_the_run(tmp_path, base):
    config = load_config(write(tmp_path, {**base, **EVALUATING, "val_size": 0.1, "compute_token_accuracy": True}))
    assert eval_metric_names(config.data, config.finetuning, config.generation, config.training) == [
        f"eval_{name}_{metric}" for name in ("val", "demo_reverse_test") for metric in ("loss", "perplexity", "token_accuracy")
    ]
    config = load_config(write(tmp_path, {**base, **EVALUATING, "generate_at_eval": True}))
    assert eval_metric_names(config.data, config.finetuning, config.generation, config.training) == [
        "eval_loss", "eval_perplexity", "eval_exact_match", "eval_bleu", "eval_rouge_l"]


# ---- generate_at_eval ------------------------------------------------------------------------------------


def test_generate_at_eval_checks(tmp_path, base):
    assert error_of(tmp_path, {**base, "generate_at_eval": True}) == (
        "generate_at_eval generates at each evaluation, but eval_strategy is 'no': set eval_strategy: steps with eval_steps"
    )
    assert error_of(tmp_path, {**base, **EVALUATING, "generate_at_eval": True, "eval_generation_samples": 0}) == (
        "eval_generation_samples must be at least 1, got 0"
    )
    pt = {**base, "stage": "pt", "dataset": ["demo_corpus"], "template": None, **EVALUATING,
          "eval_dataset": ["demo_corpus"], "generate_at_eval": True}
    assert error_of(tmp_path, pt) == (
        "generate_at_eval applies to stage sft (answers to generate and compare), got stage pt; remove it"
    )


# ---- LlamaFactory keys --------------------------------------------------------------------------------------


def test_ignore_pad_token_for_loss_is_accepted_as_true_only(tmp_path, base):
    assert load_config(write(tmp_path, {**base, "ignore_pad_token_for_loss": True})).data.ignore_pad_token_for_loss
    assert error_of(tmp_path, {**base, "ignore_pad_token_for_loss": False}) == (
        "ignore_pad_token_for_loss: false would train on padding; tunelab never does (padding labels are always "
        "-100): remove it"
    )


def test_plot_loss_is_a_switch_as_in_llamafactory(tmp_path, base):
    assert load_config(write(tmp_path, base)).training.plot_loss is True
    assert load_config(write(tmp_path, {**base, "plot_loss": False})).training.plot_loss is False
