"""Generation metrics during training (`generate_at_eval`): at each evaluation, greedy answers for held-out rows,
scored beside eval_loss.

For each eval set, the first `eval_generation_samples` canonical rows are prompted with the training template
and answered greedily in batches of `per_device_eval_batch_size`, at most `max_new_tokens` each, exactly as
`tunelab eval` does (infer/generate.py's generate_predictions, infer/predict.py's score): the numbers logged at a
step equal `tunelab eval` on that step's checkpoint with `max_samples: eval_generation_samples` (tested). They
are logged in the evaluation's own line as `eval[_<name>]_exact_match` (0-1), `_bleu` and `_rouge_l` (0-100),
so they reach trainer_log.jsonl, eval_generation.png, metric_for_best_model and early stopping.

Every process generates the same rows (they hold the same weights), so the numbers agree across ranks;
eval_runtime includes the generation.
"""

from __future__ import annotations

import logging
from typing import Any

from tunelab.infer.generate import generate_predictions
from tunelab.config.metric_names import GENERATION_METRIC_NAMES
from tunelab.infer.predict import score
from tunelab.train.callbacks import EvalMetricsCallback

logger = logging.getLogger(__name__)


class GenerationMetricsCallback(EvalMetricsCallback):
    """rows_by_prefix: the canonical rows to answer for each eval metric prefix ("eval" for a single eval set,
    "eval_<name>" for each of several)."""

    def __init__(self, rows_by_prefix: dict[str, Any], tokenizer, template, max_new_tokens: int, batch_size: int,
                 template_vars: dict[str, Any] | None = None):
        self.rows_by_prefix = rows_by_prefix
        self.tokenizer, self.template, self.template_vars = tokenizer, template, template_vars
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    @classmethod
    def from_options(cls, eval_rows: dict[str, Any], tokenizer, template, generation, data_args,
                     args) -> GenerationMetricsCallback:
        """The callback a run's options ask for: GenerationArguments, DataArguments (the template variables) and
        TrainingArguments (the batch size)."""
        limit = generation.eval_generation_samples
        rows = {name: r.select(range(min(limit, len(r)))) for name, r in eval_rows.items()}
        prefixes = {name: "eval" if len(rows) == 1 else f"eval_{name}" for name in rows}
        return cls(
            {prefixes[name]: r for name, r in rows.items()}, tokenizer, template,
            max_new_tokens=generation.max_new_tokens, batch_size=args.per_device_eval_batch_size,
            template_vars=data_args.template_kwargs,
        )

    def evaluation_metrics(self, model, metric_key_prefix: str) -> dict[str, float]:
        rows = self.rows_by_prefix.get(metric_key_prefix)
        if rows is None:  # an evaluation of something else (a stage's own before/after prefixes)
            return {}
        predictions = generate_predictions(
            model, self.tokenizer, self.template, rows, self.max_new_tokens, self.batch_size, self.template_vars
        )
        scores = score(predictions)
        return {f"{metric_key_prefix}_{key}": scores[key] for key in GENERATION_METRIC_NAMES}
