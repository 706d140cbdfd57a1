"""Batch prediction: greedy answers for an eval set, written out and scored (`tunelab eval`, `do_predict`).

    eval rows (eval_dataset, or the val split of the training data, exactly as training split it)
    → prompts rendered with the training template → batched greedy generation that stops at the
    template's end-of-turn (infer/generate.py) → predictions.jsonl + predict_results.json in output_dir.

predictions.jsonl has one object per answer: dataset, prompt, reference, prediction.
predict_results.json has `predict_exact_match` (0-1), `predict_bleu`, `predict_rouge_l` (0-100) and
`predict_samples` (see infer/metrics.py); with several eval sets each gets its own
`predict_{name}_...` keys.

Which template: a folder written by tunelab (it holds tunelab_config.yaml: a training run's output,
model or adapter) is evaluated with the chat template it saved — the one it trained with — and the
template variables it recorded (template_kwargs), unless the config sets template_kwargs itself. Any
other folder uses the config's `template` and `template_kwargs`, as training would. An adapter's folder
also provides the tokenizer when it saved one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from tunelab.config.args import ModelArguments, RunConfig
from tunelab.config.loader import RUN_RECORD, read_run_record
from tunelab.data.templates import TEMPLATE_NAMES, Template, check_template_kwargs, get_template
from tunelab.data.templates.builtin import builtin_source
from tunelab.data.templates.template import tokenizer_source
from tunelab.infer.generate import Prediction, generate_predictions
from tunelab.infer.metrics import generation_metrics

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "predictions.jsonl"
RESULTS_FILE = "predict_results.json"


def trained_folder(model_args: ModelArguments) -> Path:
    """The folder that holds the trained weights: the adapter's, else the model's."""
    return Path(model_args.adapter_name_or_path or model_args.model_name_or_path)


def load_inference_tokenizer(model_args: ModelArguments):
    """The tokenizer saved beside the adapter when there is one (it carries the trained chat template), else the model's."""
    from tunelab.model.tokenizer import load_tokenizer  # noqa: PLC0415

    adapter = model_args.adapter_name_or_path
    if adapter and (Path(adapter) / "tokenizer_config.json").is_file():
        model_args = dataclasses.replace(model_args, model_name_or_path=adapter)
    return load_tokenizer(model_args)


def inference_template(template_name: str | None, tokenizer, folder: Path) -> Template:
    """The chat template a trained folder saved (a tunelab run), else the configured one (see module doc)."""
    saved = tokenizer_source(tokenizer)
    if saved is None or not (folder / RUN_RECORD).is_file():
        return get_template(template_name, tokenizer)
    builtin = next((name for name in TEMPLATE_NAMES if builtin_source(name) == saved), None)
    template = get_template(builtin, tokenizer) if builtin else Template.from_tokenizer(tokenizer)
    if template_name not in (None, "model", template.name):
        logger.warning(
            "template: %s trained with %s, not the configured '%s'; evaluating with the template it trained with",
            folder, f"'{builtin}'" if builtin else "its own chat template", template_name,
        )
    return template


def recorded_template_kwargs(folder: Path) -> dict[str, Any] | None:
    """The template_kwargs a tunelab run recorded in folder/tunelab_config.yaml; None without such a record."""
    recorded = read_run_record(folder)  # None: the chat template saved beside it still applies, its variables unknown
    value = recorded.get("template_kwargs") if recorded is not None else None
    return value if isinstance(value, dict) else None


def inference_template_kwargs(configured: dict[str, Any] | None, folder: Path, template: Template) -> dict[str, Any]:
    """The template variables to render with: configured ones when set (even {}), else those the trained folder
    recorded, else none; checked against the variables `template` reads (TemplateError)."""
    kwargs = dict(configured) if configured is not None else (recorded_template_kwargs(folder) or {})
    check_template_kwargs(template.name, template.jinja, kwargs)
    return kwargs


def eval_rows(config: RunConfig) -> dict:
    """Canonical rows of every eval set by name: the val split (as training made it) and each eval_dataset."""
    from tunelab.data.pipeline import load_canonical_splits  # noqa: PLC0415

    from tunelab.model.vision import is_vision_model_folder  # noqa: PLC0415

    images = is_vision_model_folder(config.model.model_name_or_path)  # rows may carry images for such a model
    _, rows = load_canonical_splits(config.data, config.training.seed, report={}, images=images)
    return rows


def predict(model, tokenizer, template: Template, rows_by_name: dict, output_dir: str | Path,
            max_new_tokens: int, batch_size: int, template_vars: dict[str, Any] | None = None,
            vision: tuple[Any, Any] | None = None) -> dict[str, float]:
    """Generate for every eval set, write predictions.jsonl and predict_results.json; returns the metrics.
    `vision`: a vision-language model's (processor, image settings), for rows with images."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    with (out / PREDICTIONS_FILE).open("w", encoding="utf-8") as handle:
        for name, rows in rows_by_name.items():
            predictions = generate_predictions(
                model, tokenizer, template, rows, max_new_tokens, batch_size, template_vars, vision
            )
            for p in predictions:
                record = {"dataset": name, "prompt": p.prompt, "reference": p.reference, "prediction": p.prediction}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            prefix = "predict" if len(rows_by_name) == 1 else f"predict_{name}"
            metrics.update({f"{prefix}_{k}": v for k, v in score(predictions).items()})
    (out / RESULTS_FILE).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return metrics


def score(predictions: list[Prediction]) -> dict[str, float]:
    return generation_metrics([p.prediction for p in predictions], [p.reference for p in predictions])


def run_predict(config: RunConfig) -> dict[str, float]:
    """`tunelab eval`: load the (trained) model, generate for the eval sets, write and return the metrics."""
    from tunelab.data.vision import vision_inputs  # noqa: PLC0415
    from tunelab.model.load import load_model  # noqa: PLC0415
    from tunelab.model.tokenizer import load_processor  # noqa: PLC0415

    tokenizer = load_inference_tokenizer(config.model)
    template = inference_template(config.data.template, tokenizer, trained_folder(config.model))
    template_vars = inference_template_kwargs(config.data.template_kwargs, trained_folder(config.model), template)
    rows = eval_rows(config)
    model = load_model(config.model, config.finetuning, config.training, tokenizer, is_trainable=False)
    if config.model.quantization_bit is None:  # bitsandbytes places quantized weights itself
        model.to(config.training.device)
    metrics = predict(
        model, tokenizer, template, rows, config.training.output_dir,
        max_new_tokens=config.generation.max_new_tokens, batch_size=config.training.per_device_eval_batch_size,
        template_vars=template_vars, vision=vision_inputs(load_processor(config.model), config.model),
    )
    logger.info("predictions: %s", Path(config.training.output_dir) / PREDICTIONS_FILE)
    return metrics
