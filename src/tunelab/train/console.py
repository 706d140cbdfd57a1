"""What a person sees of each log line on the console: one short line instead of the Trainer's printed dict.

    step 25/300 | loss 3.618 | lr 2.00e-03 | grad norm 1.02 | 111 tok/s | 4:09 elapsed, 45:43 left | peak RSS 810 MiB
    eval at step 300/300 | eval_loss 0.1234 | eval_perplexity 1.131
    done: 300 steps in 5:12 | train_loss 0.8512

The line is only a view: trainer_log.jsonl and the trackers of `report_to` get every field of the line as logged
(callbacks.py). The Trainer prints each line through its ProgressCallback (above the tqdm bar), or its PrinterCallback
with disable_tqdm; `use_console_lines` swaps those for subclasses that print this line instead, through the
Trainer's public add_callback / remove_callback. The RL loop (rl/loop.py) logs the same line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import transformers

# Fields the line shows in its own words (LABELLED), and fields it leaves to trainer_log.jsonl: running totals,
# the Trainer's per-second rates of evaluation and its run summary, and what the labelled ones already say.
LABELLED = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "elapsed_seconds", "eta_seconds",
            "memory_peak_rss_mib", "gpu_peak_allocated_mib", "train_runtime")
LEFT_TO_THE_LOG = ("epoch", "total_flos", "tokens_seen", "supervised_tokens_seen", "supervised_tokens_per_second",
                   "memory_rss_mib", "gpu_allocated_mib", "gpu_reserved_mib", "max_steps")
LEFT_TO_THE_LOG_SUFFIXES = ("_samples_per_second", "_steps_per_second", "_runtime")


def console_line(logs: Mapping[str, Any], step: int, max_steps: int) -> str:
    """The console's view of one log line (see the module docstring): the training line, an evaluation's line, the
    run summary, or any other line (its fields as `name value`)."""
    where = f"{step}/{max_steps}" if max_steps else f"{step}"
    if "train_runtime" in logs:
        parts = [f"done: {step} steps in {duration(logs['train_runtime'])}"]
    elif "loss" in logs:
        percent = f" ({100 * step // max_steps}%)" if max_steps else ""
        parts = [f"step {where}{percent}", f"loss {number(logs['loss'])}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if "grad_norm" in logs:
            parts.append(f"grad norm {number(logs['grad_norm'])}")
        if "tokens_per_second" in logs:
            parts.append(f"{logs['tokens_per_second']:,.0f} tok/s")
    elif any(key.startswith("eval_") for key in logs):
        parts = [f"eval at step {where}"]
    else:
        parts = [f"step {where}"]
    parts += [f"{key} {number(value)}" for key, value in logs.items() if _shown_as_is(key, value)]
    if "loss" in logs and "elapsed_seconds" in logs:  # time and memory: on the training lines and the summary
        left = f", {duration(logs['eta_seconds'])} left" if "eta_seconds" in logs and step < max_steps else ""
        parts.append(f"{duration(logs['elapsed_seconds'])} elapsed{left}")
    if "loss" in logs or "train_runtime" in logs:
        if "memory_peak_rss_mib" in logs:
            parts.append(f"peak RSS {logs['memory_peak_rss_mib']:,.0f} MiB")
        if "gpu_peak_allocated_mib" in logs:
            parts.append(f"peak GPU {logs['gpu_peak_allocated_mib']:,.0f} MiB")
    return " | ".join(parts)


def _shown_as_is(key: str, value: Any) -> bool:
    if key in LABELLED or key in LEFT_TO_THE_LOG or key.endswith(LEFT_TO_THE_LOG_SUFFIXES):
        return False
    if key == "skipped_nonfinite_steps":
        return bool(value)  # worth a look only once a step was skipped
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def number(value: Any) -> str:
    """Four significant digits for a float (3.618, 0.001995, 1.2e-05); ints and strings as they are."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ConsoleProgress(transformers.ProgressCallback):
    """The Trainer's tqdm bar, with the console line written above it instead of the dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(console_line(logs, state.global_step, state.max_steps))


class ConsolePrinter(transformers.PrinterCallback):
    """disable_tqdm: the console line printed instead of the dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(console_line(logs, state.global_step, state.max_steps), flush=True)


def use_console_lines(trainer: transformers.Trainer) -> None:
    """Replace the printer the Trainer chose (ProgressCallback, or PrinterCallback under disable_tqdm) by the
    subclass that prints the console line. A notebook's progress table, or any other printer, is left alone."""
    present = {type(callback) for callback in trainer.callback_handler.callbacks}
    swaps = ((transformers.ProgressCallback, ConsoleProgress), (transformers.PrinterCallback, ConsolePrinter))
    for theirs, ours in swaps:
        if theirs in present:
            trainer.remove_callback(theirs)
            trainer.add_callback(ours)
