"""The loop a user extends and watches: their callbacks (events in order), generation metrics at each evaluation
(equal to `tunelab eval` on the same checkpoint and rows), early stopping (stops where its rule says, and says
why), memory on every log line. Real runs of the embedded tiny model through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import yaml

from tunelab.cli import main
from tunelab.errors import ConfigError
from tunelab.run_folder import read_log
from tunelab.train.callbacks import EarlyStopping, resolve_user_callbacks

from .reliability_helpers import assert_same_weights, weights

RECORDER = """\
import json
import transformers


class RecordEvents(transformers.TrainerCallback):
    \"\"\"Appends [event, global_step] for each event it sees to `path`.\"\"\"

    def __init__(self, path):
        self.path = path

    def _write(self, event, state):
        with open(self.path, "a") as handle:
            handle.write(json.dumps([event, state.global_step]) + "\\n")

    def on_init_end(self, args, state, control, **kwargs):
        self._write("init_end", state)

    def on_train_begin(self, args, state, control, **kwargs):
        self._write("train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._write("step_end", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._write("log", state)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._write("evaluate", state)

    def on_save(self, args, state, control, **kwargs):
        self._write("save", state)

    def on_train_end(self, args, state, control, **kwargs):
        self._write("train_end", state)
"""
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "callbacks" / "sample_generations.py"
BASE = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 48,
    "cutoff_len": 64, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8, "learning_rate": 5e-3,
    "seed": 0, "disable_tqdm": True, "plot_loss": False,
}


def write_config(folder: Path, **options) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(folder / "out"), **options}))
    return path


@pytest.mark.slow
def test_user_callback_events_and_generation_metrics_equal_tunelab_eval(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    events = tmp_path / "events.jsonl"
    # Full fine-tuning on demo_sort: by step 8 the answers are digits in some order (BLEU and ROUGE-L above 0).
    config = write_config(
        tmp_path, dataset="demo_sort", eval_dataset="demo_sort_test", finetuning_type="full", max_samples=256,
        per_device_train_batch_size=32, learning_rate=3e-3, max_steps=8, logging_steps=4, eval_strategy="steps",
        eval_steps=4, save_steps=4, generate_at_eval=True, eval_generation_samples=8, max_new_tokens=8,
        callbacks=f"recorder.py:RecordEvents,{EXAMPLE}:SampleGenerations",
        callback_kwargs={"RecordEvents": {"path": str(events)}, "SampleGenerations": {
            "template": "chatml", "every": 4, "max_new_tokens": 8, "references": ["1 2 3", "4 5 6"],
            "questions": ["Sort the numbers from smallest to largest.\n3 1 2", "Sort the numbers from smallest to largest.\n6 4 5"],
        }},
    )
    assert main(["train", str(config)]) == 0
    out = tmp_path / "out"

    # the example callback of docs/training.md, second in the list: two answers at steps 4 and 8
    samples = [json.loads(line) for line in (out / "sample_generations.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reference"]) for r in samples] == [(4, "1 2 3"), (4, "4 5 6"), (8, "1 2 3"), (8, "4 5 6")]
    assert all(0 <= r["rouge_l"] <= 100 and isinstance(r["answer"], str) for r in samples)

    recorded = [tuple(json.loads(line)) for line in events.read_text().splitlines()]
    per_interval = lambda step: [*(("step_end", s) for s in range(step - 3, step + 1)),  # noqa: E731
                                 ("log", step), ("log", step), ("evaluate", step), ("save", step)]
    assert recorded == [
        ("init_end", 0), ("train_begin", 0), *per_interval(4), *per_interval(8), ("log", 8), ("train_end", 8),
    ]

    log = read_log(out)
    evaluations = {r["step"]: r for r in log if "eval_loss" in r}
    assert sorted(evaluations) == [4, 8]
    for record in log:  # memory on every line: training, evaluation and the summary
        assert record["memory_rss_mib"] > 0 and record["memory_peak_rss_mib"] >= record["memory_rss_mib"]
    results = json.loads((out / "all_results.json").read_text())
    # The kernel folds per-thread RSS counters into VmHWM lazily, so a later reading can sit a fraction of a MiB
    # below an earlier one (measured: 0.2 MiB); the run's peak is never far below what its lines saw.
    assert results["memory_peak_rss_mib"] >= max(r["memory_peak_rss_mib"] for r in log) - 1.0

    # tunelab eval on the step-8 checkpoint, the same rows (max_samples bounds the eval set to its first 8, the rows
    # generate_at_eval answered): equal numbers
    eval_dir = tmp_path / "eval-8"
    assert main(["eval", str(config), f"model_name_or_path={out}/checkpoint-8", "max_samples=8",
                 f"output_dir={eval_dir}"]) == 0
    predicted = json.loads((eval_dir / "predict_results.json").read_text())
    assert predicted["predict_samples"] == 8
    for metric in ("exact_match", "bleu", "rouge_l"):
        assert evaluations[8][f"eval_{metric}"] == predicted[f"predict_{metric}"], metric
    assert evaluations[8]["eval_bleu"] > 0 and evaluations[8]["eval_rouge_l"] > 0  # more than zeros compared


@pytest.mark.slow
def test_early_stopping_stops_where_its_rule_says_and_says_why(tmp_path, caplog):
    """Trained on demo_reverse at a high learning rate and evaluated on another task (demo_add_test), the eval
    loss soon rises: the run stops at the first evaluation that makes `patience` in a row without improvement.
    With load_best_model_at_end the saved model and the final eval metrics are the best evaluation's."""
    patience, max_steps = 2, 40
    config = write_config(
        tmp_path, eval_dataset="demo_add_test", max_samples=32, learning_rate=1e-2, max_steps=max_steps,
        logging_steps=2, eval_strategy="steps", eval_steps=2, early_stopping_patience=patience,
        save_steps=2, load_best_model_at_end=True,
    )
    assert main(["train", str(config)]) == 0
    out = tmp_path / "out"
    evals = [(r["step"], r["eval_loss"]) for r in read_log(out) if "eval_loss" in r]

    best, best_step, worse, expected = None, None, 0, None
    for step, loss in evals:  # the rule, replayed on the logged losses
        if best is None or loss < best:
            best, best_step, worse = loss, step, 0
        else:
            worse += 1
        if worse >= patience:
            expected = step
            break
    assert expected is not None and expected < max_steps
    assert evals[-1][0] == expected  # no evaluation after the stop
    summary = read_log(out)[-1]
    reason = (
        f"early stopping at step {expected}: eval_loss has not improved on its best {best:.6g} (step {best_step}) "
        f"for {patience} evaluations (last {evals[-1][1]:.6g}; early_stopping_patience: {patience})"
    )
    assert (summary["step"], summary["early_stopping_step"], summary["early_stopping_reason"]) == (expected, expected, reason)
    results = json.loads((out / "all_results.json").read_text())
    assert (results["early_stopping_step"], results["early_stopping_reason"]) == (expected, reason)
    assert reason in caplog.messages  # and in the run's log, once it stops
    # load_best_model_at_end: the summary names the best checkpoint, whose weights are the saved model's, and the
    # final eval metrics are its evaluation's (not the stopped step's)
    best_checkpoint = out / f"checkpoint-{best_step}"
    assert (summary["best_model_checkpoint"], summary["best_metric"]) == (str(best_checkpoint), best)
    assert_same_weights(weights(out), weights(best_checkpoint))
    assert results["eval_loss"] == best


def test_early_stopping_counts_only_its_metric_and_not_the_normal_end(tmp_path):
    """Driven with the Trainer's own state objects: the normal end (should_training_stop at max_steps) is not an
    early stop; another eval set's evaluation neither counts nor warns."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), eval_strategy="steps",
                                          metric_for_best_model="eval_a_loss", greater_is_better=False)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback = EarlyStopping(early_stopping_patience=2, early_stopping_threshold=0.05)
    for step, loss in ((1, 2.0), (2, 1.97), (3, 1.5)):  # 1.97 does not beat 2.0 by more than 0.05
        state.global_step = step
        callback.on_evaluate(args, state, control, metrics={"eval_b_loss": 9.0})
        callback.on_evaluate(args, state, control, metrics={"eval_a_loss": loss})
        state.best_metric = min(loss, state.best_metric or loss)
    control.should_training_stop = True  # max_steps reached
    assert callback.stopped is None and callback.summary() == {}
    state.global_step, state.best_metric = 4, 1.5
    callback.on_evaluate(args, state, control, metrics={"eval_a_loss": 1.6})
    callback.on_evaluate(args, state, control, metrics={"eval_a_loss": 1.49})
    assert callback.summary() == {
        "early_stopping_step": 4,
        "early_stopping_reason": "early stopping at step 4: eval_a_loss has not improved by more than 0.05 on its best "
        "1.5 (step 3) for 2 evaluations (last 1.49; early_stopping_patience: 2)",
    }


def test_user_callbacks_resolve_to_classes_and_their_arguments(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    ((cls, kwargs),) = resolve_user_callbacks(["recorder.py:RecordEvents"], {"RecordEvents": {"path": "x"}}, tmp_path)
    assert (cls.__name__, issubclass(cls, transformers.TrainerCallback), kwargs) == ("RecordEvents", True, {"path": "x"})
    # keyed by the full entry works too; both at once is ambiguous
    spec = f"{tmp_path}/recorder.py:RecordEvents"
    assert resolve_user_callbacks([spec], {spec: {"path": "y"}})[0][1] == {"path": "y"}
    with pytest.raises(ConfigError, match=r"^callback_kwargs: both '.*recorder.py:RecordEvents' and 'RecordEvents' are set: keep one$"):
        resolve_user_callbacks([spec], {spec: {"path": "y"}, "RecordEvents": {"path": "z"}})


def test_final_eval_metrics_are_the_final_models_evaluation(tmp_path):
    """all_results.json's eval metrics reuse the evaluation of the final model: the last step's, every eval set's
    line of it; with load_best_model_at_end the best checkpoint's step. Driven with the Trainer's own state."""
    from types import SimpleNamespace

    from tunelab.train.recipe import SupervisedRecipe

    _final_eval_metrics = SupervisedRecipe.final_eval_metrics

    state = transformers.TrainerState()
    state.log_history = [
        {"step": 2, "eval_a_loss": 1.0}, {"step": 2, "eval_b_loss": 2.0},
        {"step": 4, "loss": 0.5}, {"step": 4, "eval_a_loss": 1.5}, {"step": 4, "eval_b_loss": 2.5, "eval_b_perplexity": 12.2},
    ]
    state.global_step, state.best_global_step, state.best_model_checkpoint = 4, 2, str(tmp_path / "checkpoint-2")

    def trainer(load_best: bool):
        args = SimpleNamespace(load_best_model_at_end=load_best)
        return SimpleNamespace(state=state, args=args, evaluate=lambda: {"evaluated": True})

    assert _final_eval_metrics(trainer(False)) == {"eval_a_loss": 1.5, "eval_b_loss": 2.5, "eval_b_perplexity": 12.2}
    assert _final_eval_metrics(trainer(True)) == {"eval_a_loss": 1.0, "eval_b_loss": 2.0}
    state.global_step = 5  # no evaluation at the last step: one is run
    assert _final_eval_metrics(trainer(False)) == {"evaluated": True}
