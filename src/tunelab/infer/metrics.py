"""Scores of generated answers against references: exact match, BLEU, ROUGE-L.

The n-gram metrics come from the libraries the field reports with, so numbers compare with papers:
- BLEU: sacrebleu's corpus BLEU (0-100) with its default 13a tokenizer, one reference per answer.
- ROUGE-L: Google's `rouge-score` F-measure, averaged over answers and scaled to 0-100. Its default
  tokenizer lowercases and keeps only ASCII letters and digits, so text in other scripts scores 0;
  `rouge_l_tokenizer="whitespace"` splits on whitespace instead (what a caller picks for such data).
- exact match: the share (0-1) of answers equal to their reference after stripping outer whitespace,
  the same test as `tunelab.infer.generate.Prediction.exact_match`.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

from tunelab.errors import ConfigError


def exact_match_score(predictions: Sequence[str], references: Sequence[str]) -> float:
    if not predictions:
        return 0.0
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)) / len(predictions)


def bleu_score(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu defaults: 4-grams, 13a tokenisation, exponential brevity penalty), 0-100."""
    import sacrebleu  # lazy: the eval extra, which may be missing

    if not predictions:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


class _WhitespaceTokenizer:
    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rouge_l_score(predictions: Sequence[str], references: Sequence[str], tokenizer: str = "default") -> float:
    """Mean ROUGE-L F-measure over answers, 0-100 (rouge-score; no stemming)."""
    from rouge_score import rouge_scorer  # lazy: the eval extra, which may be missing

    logging.getLogger("absl").setLevel(logging.WARNING)  # rouge-score logs "Using default tokenizer" per scorer
    if not predictions:
        return 0.0
    scorer = rouge_scorer.RougeScorer(
        ["rougeL"], use_stemmer=False, tokenizer=_WhitespaceTokenizer() if tokenizer == "whitespace" else None
    )
    scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)]
    return 100.0 * sum(scores) / len(scores)


def generation_metrics(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """{exact_match (0-1), bleu (0-100), rouge_l (0-100), samples}."""
    return {
        "exact_match": exact_match_score(predictions, references),
        "bleu": bleu_score(predictions, references),
        "rouge_l": rouge_l_score(predictions, references),
        "samples": len(predictions),
    }


def check_scoring_packages(what: str) -> None:
    """BLEU and ROUGE-L need sacrebleu and rouge-score (the `eval` extra): checked now, not after hours of training."""
    missing = [name for name, module in (("sacrebleu", "sacrebleu"), ("rouge-score", "rouge_score"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"{what} scores BLEU and ROUGE-L with {' and '.join(missing)}: pip install {' '.join(missing)}")
