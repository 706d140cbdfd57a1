"""Generation metrics on a mini set checked by hand (BLEU through sacrebleu, ROUGE-L through rouge-score)."""

from __future__ import annotations

import math

import pytest

from tunelab.infer.metrics import bleu_score, exact_match_score, generation_metrics, rouge_l_score

PREDICTIONS = ["the cat sat on the mat", "the cat", "a b c d"]
REFERENCES = ["the cat sat on the mat", "the cat sat", "e f g h"]


def test_exact_match_strips_outer_whitespace_only():
    assert exact_match_score(PREDICTIONS, REFERENCES) == pytest.approx(1 / 3)
    assert exact_match_score([" 4\n", "4 2"], ["4", "42"]) == 0.5
    assert exact_match_score([], []) == 0.0


def test_corpus_bleu_by_hand():
    # Clipped n-gram matches over the corpus: 1-grams 8/12, 2-grams 6/9, 3-grams 4/6, 4-grams 3/4.
    # Hypothesis length 12 < reference length 13: brevity penalty exp(1 - 13/12).
    expected = 100 * math.exp(1 - 13 / 12) * (8 / 12 * 6 / 9 * 4 / 6 * 3 / 4) ** 0.25
    assert bleu_score(PREDICTIONS, REFERENCES) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(63.1692, abs=1e-4)
    assert bleu_score(["x y z w"], ["x y z w"]) == pytest.approx(100.0)


def test_rouge_l_by_hand():
    # F-measures: 1 (identical); LCS 2 of 2 predicted / 3 reference words: 2 * 1 * 2/3 / (1 + 2/3) = 0.8; 0.
    assert rouge_l_score(PREDICTIONS, REFERENCES) == pytest.approx(100 * (1 + 0.8 + 0) / 3, rel=1e-12)
    # The default tokenizer lowercases and keeps ASCII letters and digits; whitespace keeps every word.
    assert rouge_l_score(["The CAT!"], ["the cat"]) == pytest.approx(100.0)
    assert rouge_l_score(["猫 が"], ["猫 が"]) == 0.0
    assert rouge_l_score(["猫 が"], ["猫 が"], tokenizer="whitespace") == pytest.approx(100.0)


def test_generation_metrics_names_and_scales():
    metrics = generation_metrics(PREDICTIONS, REFERENCES)
    assert set(metrics) == {"exact_match", "bleu", "rouge_l", "samples"}
    assert metrics["samples"] == 3 and metrics["rouge_l"] == pytest.approx(60.0)
