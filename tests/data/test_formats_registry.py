"""Registry → rows → canonical conversations: formats, column mapping, file types, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tests.data.test_encode import supervised_runs
from tests.official import official_render
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import ConversionStats, template_messages, to_canonical
from tunelab.data.pairwise import PairwiseEncoder
from tunelab.data.dataset_files import load_rows
from tunelab.data.registry import DatasetSpec, load_registry
from tunelab.data.templates import get_template
from tunelab.errors import ConfigError, DataError


def msg(role: str, content: str | None, reasoning: str = "") -> dict[str, str | None]:
    return {"role": role, "content": content, "tool_calls": "", "tool_call_id": "", "reasoning": reasoning}


def spec(tmp_path: Path, **kwargs) -> DatasetSpec:
    return DatasetSpec(name="d", root=str(tmp_path), **kwargs)


def canonical(rows: list[dict], skip_bad_rows: bool = False, **kwargs) -> tuple[list[dict], ConversionStats]:
    dataset, stats = to_canonical(datasets.Dataset.from_list(rows), DatasetSpec(name="d", **kwargs), skip_bad_rows=skip_bad_rows)
    return dataset.to_list(), stats


def test_alpaca_with_history_and_system():
    rows, stats = canonical(
        [{"instruction": "Add", "input": "2 3", "output": "5", "history": [["hi", "hello"]], "sys": "Be brief."}],
        columns={"history": "history", "system": "sys"},
    )
    assert stats == ConversionStats(rows=1)
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
    with pytest.raises(DataError, match=r"^dataset 'd' row 1: turn 1 is user, expected an assistant turn \(roles must alternate\); "
                                        r"or set skip_bad_rows: true to skip such rows \(counted per reason\)$"):
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


def test_empty_answers_are_kept_and_counted():
    rows, stats = canonical([
        {"instruction": "a", "input": "", "output": "x"},
        {"instruction": "b", "input": "", "output": "  "},
        {"instruction": "c", "input": "", "output": ""},
    ])
    assert (stats.total_dropped, stats.empty_answers) == (0, 2)
    assert [r["messages"][1]["content"] for r in rows] == ["x", "  ", ""]


def test_a_null_answer_is_missing_not_empty():
    with pytest.raises(DataError, match=r"^dataset 'd' row 1: the answer is missing \(null\); write \"\" for an empty answer; or set skip_bad_rows"):
        canonical([{"instruction": "a", "output": "x"}, {"instruction": "b", "output": None}])
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    with pytest.raises(DataError, match=r"^dataset 'd' row 0 turn 1: the answer is missing \(null\)"):
        canonical([{"messages": conversation}], formatting="openai")


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
    registry = load_registry(str(tmp_path))
    with pytest.raises(ConfigError, match=r"dataset 'x' has unsupported key\(s\) \['script_url'\]"):
        registry["x"]


def test_a_file_entry_has_only_the_train_split(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "x": {"file_name": "x.jsonl", "split": "test"}, "y": {"file_name": "y.jsonl", "split": "train"},
    }))
    registry = load_registry(str(tmp_path))
    assert registry["y"].split == "train"
    with pytest.raises(ConfigError) as info:
        registry["x"]
    assert str(info.value) == (
        f"{tmp_path}/dataset_info.json: dataset 'x': split 'test' applies to generator and hf_hub_url datasets; a "
        "file_name entry is read whole: remove split (or give that split its own file and entry)"
    )


def test_registry_checks_only_the_entries_a_run_uses(tmp_path):
    # One multimodal entry in the folder's dataset_info.json must not stop runs on the other datasets.
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "pictures": {"file_name": "p.jsonl", "formatting": "sharegpt", "columns": {"videos": "videos"}},
        "text": {"file_name": "t.jsonl"},
    }))
    registry = load_registry(str(tmp_path))
    assert sorted(registry) == sorted([*load_registry(), "pictures", "text"])
    assert registry["text"] == DatasetSpec(name="text", file_name="t.jsonl", formatting_given=False, root=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        registry["pictures"]
    assert str(info.value) == (
        f"{tmp_path}/dataset_info.json: dataset 'pictures' maps columns.videos, but tunelab trains text and image "
        "models and would ignore the videos: remove columns.videos (and the videos from the rows)"
    )


def test_builtin_registry_has_demo_sets():
    registry = load_registry()
    for name in ("demo_reverse", "demo_reverse_test", "demo_multiturn", "demo_preference"):
        assert name in registry
    assert registry["demo_preference"].ranking is True


# --- reasoning, tool-call content, system turns: what conversion keeps --------------------------------


def test_reasoning_fields_are_kept_and_counted():
    openai = {"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "reasoning": "r2"},
    ]}
    rows, stats = canonical([openai, {"messages": openai["messages"][:2]}], formatting="openai")
    assert rows[0]["messages"] == [msg("user", "q"), msg("assistant", "a", "r1"), msg("user", "q2"),
                                   msg("assistant", "b", "r2")]
    assert template_messages(rows[0])[1] == {"role": "assistant", "content": "a", "reasoning_content": "r1"}
    assert "reasoning_content" not in template_messages(rows[0])[0]
    assert stats.with_reasoning == 2

    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "reasoning": "r"}]}
    rows, stats = canonical([sharegpt, {"conversations": sharegpt["conversations"][:1] + [{"from": "gpt", "value": "a"}]}],
                            formatting="sharegpt")
    assert [r["messages"][1]["reasoning"] for r in rows] == ["r", ""] and stats.with_reasoning == 1

    rows, stats = canonical([{"instruction": "q", "output": "a", "thought": "r"}], columns={"reasoning": "thought"})
    assert rows[0]["messages"] == [msg("user", "q"), msg("assistant", "a", "r")] and stats.with_reasoning == 1


def test_reasoning_outside_an_answer_is_refused():
    turns = [{"role": "user", "content": "q", "reasoning_content": "r"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"^dataset 'd' row 0 turn 0: a user turn has reasoning; only answers carry it"):
        canonical([{"messages": turns}], formatting="openai")
    with pytest.raises(DataError, match=r"^dataset 'd': columns.reasoning applies to alpaca supervised rows"):
        canonical([{"conversations": []}], formatting="sharegpt", columns={"reasoning": "r"})
    pair = {"instruction": "q", "chosen": {"from": "gpt", "value": "a", "reasoning_content": "r"}, "rejected": "b"}
    with pytest.raises(DataError, match=r"^dataset 'd' row 0: the chosen answer has reasoning_content; ranking answers "
                                        r"are text only here: remove reasoning_content from chosen/rejected"):
        canonical([pair], ranking=True)


def test_call_turns_without_content_keep_none():
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    rows, stats = canonical([{"messages": turns}], formatting="openai")
    assert [m["content"] for m in rows[0]["messages"]] == ["q", None, "1", ""]
    assert stats.empty_answers == 0  # a call turn is an answer even without text
    assert [m["content"] for m in template_messages(rows[0])] == ["q", "", "1", ""]  # no template: "" everywhere


def test_an_explicitly_empty_system_turn_is_kept():
    turns = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows, _ = canonical([{"messages": turns}, {"messages": turns[1:]}], formatting="openai")
    assert rows[0]["system"] == "" and rows[0]["messages"][0] == msg("system", "")
    assert template_messages(rows[0]) == [{"role": "system", "content": ""}, *template_messages(rows[1])]
    # Qwen2.5 writes its default system prompt only when there is no system turn at all
    qwen = get_template("qwen2_5")
    assert qwen.render(template_messages(rows[0])).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nq")
    assert "You are Qwen" in qwen.render(template_messages(rows[1]))
    # an alpaca system column value "" means no system prompt (tabular data has no other way to say none)
    rows, _ = canonical([{"instruction": "q", "output": "a", "sys": ""}], columns={"system": "sys"})
    assert template_messages(rows[0])[0] == {"role": "user", "content": "q"}


# --- skip_bad_rows, ranking pairs -------------------------------------------------------------------------


def test_skip_bad_rows_leaves_out_structural_faults_counted_per_reason():
    def conversation(*roles: str) -> dict:
        return {"conversations": [{"from": role, "value": f"{role} text"} for role in roles]}

    rows, stats = canonical(
        [conversation("human", "gpt"), conversation("gpt", "human"), conversation("human", "gpt", "human"),
         conversation("human", "bot"), conversation("human", "gpt", "human"), conversation("human", "gpt")],
        skip_bad_rows=True, formatting="sharegpt",
    )
    assert len(rows) == 2
    assert stats.dropped == {"answer_first": 1, "ends_without_answer": 2, "unknown_role": 1}
    assert stats.first == {
        "answer_first": "dataset 'd' row 1: turn 0 is assistant, expected a user/tool turn (roles must alternate)",
        "ends_without_answer": "dataset 'd' row 2: the conversation must end with an assistant turn",
        "unknown_role": "dataset 'd' row 3 turn 1: role 'bot' is not one of human, gpt, observation, function_call, "
                        "system (set tags in dataset_info.json)",
    }


def test_ranking_pairs_with_identical_answers_are_dropped_and_empty_sides_kept():
    rows, stats = canonical(
        [{"instruction": "q1", "chosen": "good", "rejected": "bad"}, {"instruction": "q2", "chosen": "same", "rejected": "same"},
         {"instruction": "q3", "chosen": "", "rejected": "rambling"}, {"instruction": "q4", "chosen": "", "rejected": ""}],
        ranking=True,
    )
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("good", "bad"), ("", "rambling")]
    assert (stats.dropped, stats.empty_answers) == ({"identical_pair": 2}, 1)
    assert stats.first["identical_pair"] == "dataset 'd' row 1: chosen and rejected are the same answer"


# --- what kept rows train ---------------------------------------------------------------------------------


def test_an_empty_answer_trains_only_the_end_of_turn(tiny_tokenizer):
    rows, _ = canonical([{"instruction": "Say nothing", "output": ""}, {"instruction": "Say nothing", "output": "  "}])
    encoder = SupervisedEncoder(tokenizer=tiny_tokenizer, template=get_template("chatml"), cutoff_len=64)
    out = encoder({key: [row[key] for row in rows] for key in rows[0]})
    runs = [supervised_runs(tiny_tokenizer, ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])]
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert runs[0] == ["<|im_end|>"]
    assert [i for i, label in zip(out["input_ids"][0], out["labels"][0]) if label != -100] == [im_end]
    assert runs[1] == ["  <|im_end|>"]  # whitespace is an answer's text: trained as the template writes it


def test_a_pair_with_an_empty_side_trains_that_side_on_the_end_of_turn(tiny_tokenizer):
    rows, _ = canonical([{"instruction": "Say nothing", "chosen": "", "rejected": "Well, actually"}], ranking=True)
    encoder = SupervisedEncoder(tokenizer=tiny_tokenizer, template=get_template("chatml"), cutoff_len=64, mask_history=True)
    out = PairwiseEncoder(encoder)({key: [row[key] for row in rows] for key in rows[0]})
    chosen = supervised_runs(tiny_tokenizer, out["chosen_input_ids"][0], out["chosen_labels"][0])
    rejected = supervised_runs(tiny_tokenizer, out["rejected_input_ids"][0], out["rejected_labels"][0])
    assert (chosen, rejected) == (["<|im_end|>"], ["Well, actually<|im_end|>"])


def test_an_explicitly_empty_system_turn_encodes_as_the_official_render(tiny_tokenizer):
    turns = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows, _ = canonical([{"messages": turns}], formatting="openai")
    official = official_render("qwen2_5", turns)
    encoder = SupervisedEncoder(tokenizer=tiny_tokenizer, template=get_template("qwen2_5"), cutoff_len=128)
    out = encoder({key: [value] for key, value in rows[0].items()})
    assert out["input_ids"] == [tiny_tokenizer(official, add_special_tokens=False)["input_ids"]]
    assert "You are Qwen" not in official
