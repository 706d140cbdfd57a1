"""examples/quickstart_vision.yaml as the docs run it: the tiny LLaVA learns to answer questions about pictures."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import yaml

from tunelab.cli import main
from tunelab.data import synthetic

REPO_ROOT = Path(__file__).resolve().parents[2]
DATASET_INFO = REPO_ROOT / "src" / "tunelab" / "data" / "dataset_info.json"


def no_look_exact_match(train: list[dict], test: list[dict]) -> float:
    """Exact match of answering each test question with its most common train answer, the picture unseen."""
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in train:
        answers[row["instruction"]][row["output"]] += 1
    # An unseen question has no prior: counted as a miss (none occurs in the quickstart's data).
    hits = [bool(answers[r["instruction"]]) and answers[r["instruction"]].most_common(1)[0][0] == r["output"]
            for r in test]
    return sum(hits) / len(hits)


def rows_of(name: str, limit: int) -> list[dict]:
    spec = json.loads(DATASET_INFO.read_text())[name]
    rows = synthetic.generate(spec["generator"], spec["split"], spec["num_samples"], seed=spec.get("seed", 0))
    return rows[:limit]


def test_no_look_baseline_reads_the_most_common_answer_per_question() -> None:
    train = [{"instruction": "q1", "output": "a"}, {"instruction": "q1", "output": "a"},
             {"instruction": "q1", "output": "b"}, {"instruction": "q2", "output": "c"}]
    test = [{"instruction": "q1", "output": "a"}, {"instruction": "q1", "output": "b"},
            {"instruction": "q2", "output": "c"}, {"instruction": "q3", "output": "c"}]
    assert no_look_exact_match(train, test) == 0.5


@pytest.mark.slow
def test_vision_quickstart_shows_learning_beyond_the_answer_prior(tmp_path, capsys):
    """Held-out exact match (pictures never trained on) rises by at least 30 points, printed before and after, and
    ends at least 20 points above answering each question with its most common train answer without the picture."""
    config = yaml.safe_load((REPO_ROOT / "examples" / "quickstart_vision.yaml").read_text())
    assert config["model_name_or_path"] == "tiny-vision" and config["dataset"] == "demo_shapes"
    path = tmp_path / "quickstart_vision.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(tmp_path / "out"), "disable_tqdm": True}))
    assert main(["train", str(path)]) == 0
    metrics = json.loads((tmp_path / "out" / "all_results.json").read_text())
    before, after = metrics["exact_match_before"], metrics["exact_match_after"]
    assert f"exact match (held-out): before {100 * before:.1f}% → after {100 * after:.1f}%" in capsys.readouterr().out

    train = rows_of(config["dataset"], config["max_samples"])
    test = rows_of(config["eval_dataset"], config["eval_generation_samples"])
    no_look = no_look_exact_match(train, test)
    print(f"held-out exact match: before {100 * before:.1f}%, after {100 * after:.1f}%, "
          f"no-look (most common train answer per question) {100 * no_look:.1f}%")
    assert after - before >= 0.30
    assert after - no_look >= 0.20
