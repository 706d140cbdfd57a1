"""The data before training and the model after it, for the web UI, through the CLI's own functions.

- preview: a few encoded training samples split into supervised / unsupervised text (the labels the loss sees,
  as `tunelab template show` marks them) and `tunelab data stats` (data/stats.py: stats_report), its
  histogram as numbers for the page to draw;
- chat: one ChatEngine at a time (infer/engine.py: load_engine, the folder's own template), answers streamed;
- eval / export: the `tunelab eval` / `tunelab export` command lines for a run folder, from what it recorded.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator


from tunelab.errors import ConfigError
from tunelab.infer.sampling import SamplingOptions
from tunelab.run_folder import PREDICT_RESULTS, PREDICTIONS, RUN_RECORD, read_run_record

IGNORE_INDEX = -100


def _segments(tokenizer, ids: list[int], labels: list[int]) -> list[dict[str, Any]]:
    """Consecutive tokens grouped by whether they reach the loss, each group decoded."""
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            out.append({"text": tokenizer.decode(ids[start:i], skip_special_tokens=False),
                        "supervised": labels[start] != IGNORE_INDEX})
            start = i
    return out


def preview(config, count: int = 3) -> dict[str, Any]:
    # lazy: the web UI starts without torch, datasets and transformers (torch alone 2.8 s)
    from tunelab.data.stats import stats_report
    from tunelab.train.plan import RunPlan
    from tunelab.train.recipe import recipe_for

    data = recipe_for(RunPlan(config, "data")).inspection()
    prefixes = data.sides or ("",)
    examples = []
    for index in range(min(count, len(data.train))):
        row = data.train[index]
        for prefix in prefixes:
            ids, labels = row.get(f"{prefix}input_ids"), row.get(f"{prefix}labels")
            if ids is None or labels is None:
                continue
            examples.append({"title": f"sample {index + 1}" + (f" ({prefix.rstrip('_')})" if prefix else ""),
                             "tokens": len(ids), "segments": _segments(data.tokenizer, list(ids), list(labels))})
    with tempfile.TemporaryDirectory() as tmp:
        lines = stats_report(data, Path(tmp))
        stats = json.loads((Path(tmp) / "stats.json").read_text(encoding="utf-8"))
    # The text histogram and the files written to the temporary folder are the CLI's; the page draws its own.
    at = next((i for i, line in enumerate(lines) if line.startswith("length histogram")), len(lines))
    return {"examples": examples, "lines": lines[:at], "histogram": stats["histogram"],
            "cutoff_len": config.data.cutoff_len}


class EngineCache:
    """The chat engine of the last folder chatted with (one model in memory at a time)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key: tuple | None = None
        self.engine = None

    def get(self, folder: Path):
        # lazy: the web UI starts without torch, datasets and transformers (torch alone 2.8 s)
        from tunelab.infer.engine import load_engine

        weights = [p.stat().st_mtime for p in folder.glob("*.safetensors")]
        key = (str(folder), max(weights, default=0))
        with self.lock:
            if self.key != key:
                self.engine, self.key = None, None
                self.engine, self.key = load_engine(str(folder)), key
            return self.engine


def chat_stream(engine, messages: list[dict[str, str]], temperature: float, max_new_tokens: int) -> Iterator[str]:
    options = SamplingOptions(temperature=temperature, max_new_tokens=max_new_tokens, seed=0)
    generation = engine.generate(messages, options)
    yield from generation


def run_record(folder: Path) -> dict[str, Any]:
    record = read_run_record(folder)
    if record is None:
        raise ConfigError(f"{folder}: no readable {RUN_RECORD}; eval and export need a folder a tunelab run wrote")
    return record


def _model_options(folder: Path, record: dict[str, Any]) -> list[str]:
    if (folder / "adapter_config.json").is_file():
        return [f"model_name_or_path={record['model_name_or_path']}", f"adapter_name_or_path={folder}"]
    return [f"model_name_or_path={folder}"]


def _listed(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def eval_args(folder: Path, max_samples: int, eval_dataset: str = "") -> tuple[list[str], Path]:
    """`tunelab eval` for a run folder: its model (or adapter), template and eval set (or `eval_dataset`, names
    of the run's registry); predictions in folder/webui_eval."""
    record = run_record(folder)
    out = folder / "webui_eval"
    args = ["eval", *_model_options(folder, record), "stage=sft", f"output_dir={out}", f"max_samples={max_samples}"]
    for key in ("template", "dataset", "dataset_dir", "cutoff_len", "max_new_tokens"):
        if record.get(key) is not None:
            args.append(f"{key}={_listed(record[key])}")
    if eval_dataset.strip():
        args.append(f"eval_dataset={eval_dataset.strip()}")
    elif record.get("eval_dataset"):
        args.append(f"eval_dataset={_listed(record['eval_dataset'])}")
    elif record.get("val_size") and record.get("dataset"):
        args.append(f"val_size={record['val_size']}")
    else:
        raise ConfigError(f"{folder}: the run had no eval set (eval_dataset or val_size); name one beside the eval button")
    if record.get("template_kwargs"):
        args.append(f"template_kwargs={json.dumps(record['template_kwargs'])}")
    return args, out


def export_args(folder: Path) -> tuple[list[str], Path]:
    """`tunelab export` for a run folder: the adapter merged into its base (a full model: saved again), in
    <folder>-merged."""
    record = run_record(folder)
    out = folder.with_name(folder.name + "-merged")
    args = ["export", *_model_options(folder, record), f"export_dir={out}", "overwrite_output_dir=true"]
    if record.get("template"):
        args.append(f"template={record['template']}")
    return args, out


def predictions(out: Path, limit: int = 50) -> dict[str, Any]:
    results = {}
    try:
        results = json.loads((out / PREDICT_RESULTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    rows = []
    try:
        with (out / PREDICTIONS).open(encoding="utf-8") as handle:
            for line in handle:
                if len(rows) >= limit:
                    break
                rows.append(json.loads(line))
    except (OSError, ValueError):
        pass
    return {"metrics": results, "rows": rows}
