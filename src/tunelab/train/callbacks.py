"""Trainer callbacks: the JSON-lines training log (the plots drawn from it are in plots.py).

trainer_log.jsonl gets one object per log event: step, epoch, loss / eval metrics, learning rate,
grad norm, tokens per second (all and supervised) since the previous line, elapsed seconds and ETA.
Only the main process writes. A resumed run keeps the lines up to its checkpoint's step and goes on
from there, so the file reads as one run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import transformers

LOG_FILE = "trainer_log.jsonl"


class JsonlLogCallback(transformers.TrainerCallback):
    def __init__(self, output_dir: str):
        self.path = Path(output_dir) / LOG_FILE
        self.start = None
        self.last_time = None
        self.last_tokens = (0, 0)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if state.global_step == 0:  # a fresh run
                self.path.unlink(missing_ok=True)
            elif self.path.exists():  # resumed: drop what the stopped run logged after its checkpoint
                kept = [r for r in read_log(self.path.parent) if r.get("step", 0) <= state.global_step]
                self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self.start = self.last_time = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        record = {"step": state.global_step, "max_steps": state.max_steps, "epoch": round(state.epoch or 0.0, 4)}
        record.update({k: v for k, v in logs.items() if k not in ("tokens_seen", "supervised_tokens_seen")})
        if "tokens_seen" in logs:
            tokens, supervised = logs["tokens_seen"], logs["supervised_tokens_seen"]
            window = max(now - self.last_time, 1e-9)
            record["tokens_per_second"] = round((tokens - self.last_tokens[0]) / window, 1)
            record["supervised_tokens_per_second"] = round((supervised - self.last_tokens[1]) / window, 1)
            self.last_tokens, self.last_time = (tokens, supervised), now
        elapsed = now - (self.start or now)
        record["elapsed_seconds"] = round(elapsed, 2)
        if state.global_step and state.max_steps:
            record["eta_seconds"] = round(elapsed / state.global_step * (state.max_steps - state.global_step), 2)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def read_log(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / LOG_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

