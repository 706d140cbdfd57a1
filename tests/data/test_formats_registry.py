"""Registry → rows → canonical conversations: formats, column mapping, file types, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tunelab.data.formats import to_canonical
from tunelab.data.registry import DatasetSpec, load_registry, load_rows
from tunelab.errors import ConfigError, DataError


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": "", "tool_call_id": ""}


def spec(tmp_path: Path, **kwargs) -> DatasetSpec:
    return DatasetSpec(name="d", root=str(tmp_path), **kwargs)


def canonical(rows: list[dict], **kwargs) -> tuple[list[dict], int]:
    dataset, dropped = to_canonical(datasets.Dataset.from_list(rows), DatasetSpec(name="d", **kwargs))
    return dataset.to_list(), dropped


def test_alpaca_with_history_and_system():
    rows, dropped = canonical(
        [{"instruction": "Add", "input": "2 3", "output": "5", "history": [["hi", "hello"]], "sys": "Be brief."}],
        columns={"history": "history", "system": "sys"},
    )
    assert dropped == 0
    assert rows == [{
        "messages": [msg("user", "hi"), msg("assistant", "hello"), msg("user", "Add\n2 3"), msg("assistant", "5")],
        "system": "Be brief.", "tools": "", "chosen": "", "rejected": "",
    }]


def test_sharegpt_roles_and_system_turn():
    rows, _ = canonical(
        [{"conversations": [
            {"from": "system", "value": "S"}, {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
        ]}],
        formatting="sharegpt",
    )
    assert rows[0]["system"] == "S"
    assert [(m["role"], m["content"]) for m in rows[0]["messages"]] == [
        ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
    ]


def test_openai_format():
    rows, _ = canonical(
        [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                       {"role": "assistant", "content": "a"}]}],
        formatting="openai",
    )
    assert rows[0]["system"] == "S" and rows[0]["messages"][-1] == msg("assistant", "a")


def test_wrong_role_order_names_row_and_turn():
    with pytest.raises(DataError, match=r"^dataset 'd' row 1: turn 1 is user, expected an assistant turn \(roles must alternate\)$"):
        canonical(
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
             {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]}],
            formatting="sharegpt",
        )


def test_unknown_role_and_missing_column():
    with pytest.raises(DataError, match=r"row 0 turn 0: role 'bot' is not one of human, gpt"):
        canonical([{"conversations": [{"from": "bot", "value": "q"}]}], formatting="sharegpt")
    with pytest.raises(DataError, match=r"^dataset 'd': column 'output' \(mapped as response\) is missing; the file has instruction — set columns.response in dataset_info.json$"):
        canonical([{"instruction": "q"}])


def test_empty_answers_are_dropped_and_counted():
    rows, dropped = canonical([
        {"instruction": "a", "input": "", "output": "x"},
        {"instruction": "b", "input": "", "output": "  "},
        {"instruction": "c", "input": "", "output": "y"},
    ])
    assert dropped == 1
    assert [r["messages"][0]["content"] for r in rows] == ["a", "c"]


def test_ranking_rows():
    rows, _ = canonical([{"instruction": "q", "input": "", "chosen": "good", "rejected": "bad"}], ranking=True)
    assert rows[0]["messages"] == [msg("user", "q")]
    assert (rows[0]["chosen"], rows[0]["rejected"]) == ("good", "bad")


@pytest.mark.parametrize("suffix", ["json", "jsonl", "csv", "parquet"])
def test_file_types(tmp_path, suffix):
    records = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    path = tmp_path / f"data.{suffix}"
    frame = datasets.Dataset.from_list(records)
    if suffix == "json":
        path.write_text(json.dumps(records))
    elif suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    elif suffix == "csv":
        frame.to_csv(str(path), index=False)
    else:
        frame.to_parquet(str(path))
    rows = load_rows(spec(tmp_path, file_name=path.name))
    assert rows["instruction"] == [f"q{i}" for i in range(5)]
    assert load_rows(spec(tmp_path, file_name=path.name, num_samples=7))["instruction"][5:] == ["q0", "q1"]


def test_folder_and_glob(tmp_path):
    (tmp_path / "parts").mkdir()
    for i in range(3):
        (tmp_path / "parts" / f"{i}.jsonl").write_text(json.dumps({"instruction": f"q{i}", "output": "a"}) + "\n")
    assert sorted(load_rows(spec(tmp_path, file_name="parts"))["instruction"]) == ["q0", "q1", "q2"]
    assert sorted(load_rows(spec(tmp_path, file_name="parts/[01].jsonl"))["instruction"]) == ["q0", "q1"]


def test_malformed_json_line_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n{"instruction": "d", "output": "e"}\n')
    with pytest.raises(DataError) as info:
        load_rows(spec(tmp_path, file_name="bad.jsonl"))
    assert str(info.value) == f"{path}:2: Expecting value; fix or remove that line"


def test_non_utf8_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 \(byte 0xe9\); re-encode the file as UTF-8$"):
        load_rows(spec(tmp_path, file_name="latin1.jsonl"))


def test_no_files(tmp_path):
    with pytest.raises(DataError, match=r"^dataset 'd': no data files at .*missing.jsonl$"):
        load_rows(spec(tmp_path, file_name="missing.jsonl"))


def test_registry_rejects_unknown_keys(tmp_path):
    # script_url: LlamaFactory's loading scripts are code; hub datasets: tests/data/test_hub_datasets.py
    (tmp_path / "dataset_info.json").write_text(json.dumps({"x": {"script_url": "x", "file_name": "x.json"}}))
    with pytest.raises(ConfigError, match=r"dataset 'x' has unsupported key\(s\) \['script_url'\]"):
        load_registry(str(tmp_path))


def test_builtin_registry_has_demo_sets():
    registry = load_registry()
    for name in ("demo_reverse", "demo_reverse_test", "demo_multiturn", "demo_preference"):
        assert name in registry
    assert registry["demo_preference"].ranking is True
