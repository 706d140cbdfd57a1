"""data/dedup.py and the dedup option: exact and near duplicates removed before encoding, counted in the report."""

from __future__ import annotations

import json
import re
import sys

import datasets
import pytest

from tunelab.config.args import DataArguments
from tunelab.preflight import load_config
from tunelab.data.dedup import content_text, deduplicate, shingles
from tunelab.data.formats import CANONICAL_FEATURES
from tunelab.config.metric_names import VAL_SPLIT_NAME
from tunelab.data.pipeline import build_datasets
from tunelab.data.templates import get_template
from tunelab.errors import ConfigError

LONG = (
    "The committee met on Tuesday to review the budget for the new library wing, and after a long "
    "discussion about heating costs it agreed to postpone the vote until the spring session."
)


def rows(*pairs: tuple[str, str]) -> datasets.Dataset:
    def message(role: str, content: str) -> dict:
        return {"role": role, "content": content, "tool_calls": "", "tool_call_id": ""}

    return datasets.Dataset.from_list(
        [{"messages": [message("user", q), message("assistant", a)], "system": "", "tools": "", "chosen": "",
          "rejected": ""} for q, a in pairs],
        features=CANONICAL_FEATURES,
    )


def test_shingles_and_content_text() -> None:
    assert shingles("Ab  CDEF") == {"ab cd", "b cde", " cdef"}
    assert shingles("hi") == {"hi"}
    assert content_text(rows(("q", "a"))[0]) == "q\na"
    reasoned = {**rows(("q", "a"))[0]}
    reasoned["messages"][1]["reasoning"] = "because"
    assert content_text(reasoned) == "q\nbecause\na"  # rows that differ in their reasoning differ


def test_exact_duplicates_across_sources_keep_the_first() -> None:
    first = rows(("a", "1"), ("b", "2"), ("a", "1"))
    second = rows(("b", "2"), ("c", "3"))
    kept, stats = deduplicate([first, second], "exact", content_text)
    assert [content_text(r) for r in kept[0]] == ["a\n1", "b\n2"]
    assert [content_text(r) for r in kept[1]] == ["c\n3"]
    assert (stats.rows, stats.exact, stats.near, stats.kept) == (5, 2, 0, 3)
    assert stats.summary() == "removed 2 exact, 0 near duplicates"


def test_near_duplicates_are_removed_at_the_threshold() -> None:
    data = rows(
        ("Summarise:", LONG),
        ("Summarise:", LONG.replace("Tuesday", "Thursday")),  # one word changed: near duplicate
        ("Summarise:", LONG),  # exact duplicate, counted as exact
        ("Summarise:", "A completely different text about mountain weather and hiking routes in the alps."),
    )
    kept, stats = deduplicate([data], "near", content_text, threshold=0.85)
    assert (stats.exact, stats.near, len(kept[0])) == (1, 1, 2)
    assert stats.as_dict() == {"mode": "near", "rows": 4, "exact": 1, "near": 1, "threshold": 0.85, "kept": 2}
    _, strict = deduplicate([data], "near", content_text, threshold=1.0)
    assert (strict.exact, strict.near) == (1, 0)


def test_pipeline_reports_dedup_and_splits_after_it(tmp_path, tiny_tokenizer) -> None:
    lines = [{"instruction": f"Say {i % 6}.", "output": str(i % 6)} for i in range(20)]  # 6 distinct rows
    (tmp_path / "dups.jsonl").write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"dups": {"file_name": "dups.jsonl", "formatting": "alpaca"}}), encoding="utf-8"
    )
    args = DataArguments(template="chatml", dataset=["dups"], dataset_dir=str(tmp_path), cutoff_len=64,
                         dedup="exact", val_size=2)
    bundle = build_datasets(args, tiny_tokenizer, get_template("chatml", tiny_tokenizer), seed=0)
    assert bundle.report["dedup"] == {"mode": "exact", "rows": 20, "exact": 14, "near": 0, "threshold": None, "kept": 6}
    assert (len(bundle.train), len(bundle.eval[VAL_SPLIT_NAME])) == (4, 2)
    train = {tuple(r) for r in bundle.train["input_ids"]}
    assert not train & {tuple(r) for r in bundle.eval[VAL_SPLIT_NAME]["input_ids"]}


def test_near_without_datasketch_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasketch", None)  # import datasketch now raises ImportError
    with pytest.raises(ConfigError, match=r"^dedup: near needs the datasketch package: pip install tunelab\[dedup\]$"):
        deduplicate([rows(("a", "1"))], "near", content_text)
    with pytest.raises(ConfigError, match=r"^dedup: near needs the datasketch package: pip install tunelab\[dedup\]$"):
        load_config(None, {"template": "chatml", "dataset": "demo_reverse", "output_dir": "x", "dedup": "near"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dedup_threshold": "0.9"}, "dedup_threshold only applies to dedup: near (got dedup: none): remove it"),
        ({"dedup": "near", "dedup_threshold": "1.5"}, "dedup_threshold must be in (0, 1], got 1.5"),
        ({"dedup": "exact", "stage": "pt", "dataset": "demo_corpus"},
         "dedup: stage pt does not deduplicate documents yet; remove dedup"),
    ],
)
def test_dedup_config_checks(overrides, message) -> None:
    base = {"template": "chatml", "dataset": "demo_reverse", "output_dir": "x"}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load_config(None, {**base, **overrides})
