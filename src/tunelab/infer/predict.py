"""Batch prediction: greedy answers for an eval set, written out and scored (`tunelab eval`, `do_predict`).

    eval rows (eval_dataset, or the val split of the training data, exactly as training split it)
    → prompts rendered with the training template → batched greedy generation that stops at the
    template's end-of-turn (infer/generate.py) → predictions.jsonl + predict_results.json in output_dir.

predictions.jsonl has one object per answer: dataset, prompt, reference, prediction.
predict_results.json has `predict_exact_match` (0-1), `predict_bleu`, `predict_rouge_l` (0-100) and
`predict_samples` (see infer/metrics.py); with several eval sets each gets its own
`predict_{name}_...` keys.

Which tokenizer, template and template variables: infer/trained.py (a folder a tunelab run wrote is evaluated
with the chat template it saved and the variables it recorded; any other folder with the config's, as training
would render).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tunelab.config.args import DataArguments, ModelArguments, RunConfig
from tunelab.data.pipeline import load_canonical_splits
from tunelab.data.templates import Template
from tunelab.data.vision import vision_inputs
from tunelab.infer.generate import Prediction, generate_predictions
from tunelab.infer.metrics import generation_metrics
from tunelab.infer.trained import (
    inference_template,
    inference_template_kwargs,
    load_inference_tokenizer,
    trained_folder,
)
from tunelab.model.tokenizer import load_processor
from tunelab.model.vision import is_vision_model_folder
from tunelab.run_folder import PREDICT_RESULTS, PREDICTIONS

logger = logging.getLogger(__name__)


def eval_rows(model_args: ModelArguments, data_args: DataArguments, seed: int) -> dict:
    """Canonical rows of every eval set by name: the val split (as training made it with `seed`) and each
    eval_dataset."""
    images = is_vision_model_folder(model_args.model_name_or_path)  # rows may carry images for such a model
    _, rows = load_canonical_splits(data_args, seed, report={}, images=images)
    return rows


def predict(model, tokenizer, template: Template, rows_by_name: dict, output_dir: str | Path,
            max_new_tokens: int, batch_size: int, template_vars: dict[str, Any] | None = None,
            vision: tuple[Any, Any] | None = None) -> dict[str, float]:
    """Generate for every eval set, write predictions.jsonl and predict_results.json; returns the metrics.
    `vision`: a vision-language model's (processor, image settings), for rows with images."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    with (out / PREDICTIONS).open("w", encoding="utf-8") as handle:
        for name, rows in rows_by_name.items():
            predictions = generate_predictions(
                model, tokenizer, template, rows, max_new_tokens, batch_size, template_vars, vision
            )
            for p in predictions:
                record = {"dataset": name, "prompt": p.prompt, "reference": p.reference, "prediction": p.prediction}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            prefix = "predict" if len(rows_by_name) == 1 else f"predict_{name}"
            metrics.update({f"{prefix}_{k}": v for k, v in score(predictions).items()})
    (out / PREDICT_RESULTS).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return metrics


def score(predictions: list[Prediction]) -> dict[str, float]:
    return generation_metrics([p.prediction for p in predictions], [p.reference for p in predictions])


def run_predict(config: RunConfig) -> dict[str, float]:
    """`tunelab eval`: load the (trained) model, generate for the eval sets, write and return the metrics."""
    # peft: the stage modules import this one, and tunelab data reads their recipes without the training stack.
    # lazy: model/load imports peft (7.8 s); stage sft imports this module for `tunelab data`
    from tunelab.model.load import load_model

    tokenizer = load_inference_tokenizer(config.model)
    template = inference_template(config.data.template, tokenizer, trained_folder(config.model))
    template_vars = inference_template_kwargs(config.data.template_kwargs, trained_folder(config.model), template)
    rows = eval_rows(config.model, config.data, config.training.seed)
    model = load_model(config.model, config.finetuning, config.training, tokenizer, is_trainable=False)
    if config.model.quantization_bit is None:  # bitsandbytes places quantized weights itself
        model.to(config.training.device)
    metrics = predict(
        model, tokenizer, template, rows, config.training.output_dir,
        max_new_tokens=config.generation.max_new_tokens, batch_size=config.training.per_device_eval_batch_size,
        template_vars=template_vars, vision=vision_inputs(load_processor(config.model), config.model),
    )
    logger.info("predictions: %s", Path(config.training.output_dir) / PREDICTIONS)
    return metrics
