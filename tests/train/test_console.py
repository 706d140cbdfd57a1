"""The console line (train/console.py): what a short run prints per log line, and that the log keeps every field."""

from __future__ import annotations

import re

import pytest
import yaml

from tunelab.cli import main
from tunelab.run_folder import read_log
from tunelab.train.console import console_line, duration

TRAINING_LINE = re.compile(
    r"^step (\d)/3 \((\d+)%\) \| loss [\d.]+ \| lr \d\.\d\de-\d\d \| grad norm [\d.]+ \| [\d,]+ tok/s \| "
    r"\d+:\d\d elapsed(, \d+:\d\d left)? \| peak RSS [\d,]+ MiB$"
)


@pytest.mark.parametrize("disable_tqdm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["plain", "tqdm bar"])
def test_a_run_prints_one_readable_line_per_log_line(tmp_path, capsys, disable_tqdm):
    config = {
        "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 24,
        "cutoff_len": 48, "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "max_steps": 3,
        "logging_steps": 1, "val_size": 8, "eval_strategy": "steps", "eval_steps": 3, "seed": 0,
        "disable_tqdm": disable_tqdm,
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out and "'loss'" not in out  # the Trainer's printed dict is gone
    lines = [line for line in out.splitlines() if line.startswith(("step ", "eval at ", "done: "))]
    steps = [TRAINING_LINE.match(line) for line in lines if line.startswith("step ")]
    assert all(steps), lines
    assert [(m[1], m[2]) for m in steps] == [("1", "33"), ("2", "66"), ("3", "100")]
    (evaluation,) = [line for line in lines if line.startswith("eval at ")]
    assert re.fullmatch(r"eval at step 3/3 \| eval_loss [\d.]+ \| eval_perplexity [\d.e+]+", evaluation), evaluation
    (summary,) = [line for line in lines if line.startswith("done: ")]
    assert re.fullmatch(r"done: 3 steps in \d+:\d\d \| train_loss [\d.]+ \| peak RSS [\d,]+ MiB", summary), summary
    # trainer_log.jsonl (and so every tracker) still gets each field of each line.
    record = [r for r in read_log(tmp_path / "out") if "loss" in r][0]
    assert {"grad_norm", "tokens_seen", "supervised_tokens_per_second", "memory_rss_mib", "eta_seconds",
            "epoch"} <= set(record)


def test_the_line_shows_stage_metrics_and_leaves_totals_to_the_log():
    logs = {"loss": 0.6931, "rewards/accuracies": 0.75, "learning_rate": 1e-4, "grad_norm": 2.5, "tokens_seen": 9000,
            "tokens_per_second": 12000.4, "supervised_tokens_per_second": 300.0, "elapsed_seconds": 3800.0,
            "eta_seconds": 12.6, "memory_rss_mib": 1800.0, "memory_peak_rss_mib": 1900.0, "epoch": 0.5,
            "skipped_nonfinite_steps": 0}
    assert console_line(logs, 299, 300) == (
        "step 299/300 (99%) | loss 0.6931 | lr 1.00e-04 | grad norm 2.5 | 12,000 tok/s | rewards/accuracies 0.75 | "
        "1:03:20 elapsed, 0:13 left | peak RSS 1,900 MiB"
    )
    assert "skipped_nonfinite_steps 2" in console_line({**logs, "skipped_nonfinite_steps": 2}, 299, 300)
    assert console_line({"reward": 0.5, "kl": 0.01}, 4, 0) == "step 4 | reward 0.5 | kl 0.01"
    assert [duration(s) for s in (0, 59.6, 61, 3600)] == ["0:00", "1:00", "1:01", "1:00:00"]
