"""Tool calling end to end: dataset rows → canonical tool turns → official renders → exact masks.

sharegpt ``function_call`` / ``observation`` turns and openai ``tool_calls`` / ``tool`` messages map onto one
canonical form; every tool-capable family then renders it byte-identically to its official template with
the same tools and messages, and trains the call turn (+ end-of-turn) and the final answer, never the
tool result.
"""

from __future__ import annotations

import json
from typing import Any

import datasets
import pytest

from tests.data.test_encode import supervised_runs
from tests.data.test_template_official import WEATHER_TOOL
from tests.official import official_render, special_tokens
from tests.data.test_template_spans import family_tokenizer
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import template_messages, to_canonical
from tunelab.data.registry import DatasetSpec
from tunelab.data.templates import Template, get_template
from tunelab.errors import DataError

QUESTION = "What's the weather in Paris?"
ANSWER = "It is 20 degrees in Paris."
RESULT = '{"temp": 20}'

SHAREGPT_ROW = {
    "conversations": [
        {"from": "human", "value": QUESTION},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": RESULT},
        {"from": "gpt", "value": ANSWER},
    ],
    "tools": json.dumps([WEATHER_TOOL]),
}
OPENAI_ROW = {
    "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call12345", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": "call12345", "content": RESULT},
        {"role": "assistant", "content": ANSWER},
    ],
    "tools": json.dumps([WEATHER_TOOL]),
}
# What the official templates are given: the tool conversation as a chat API would hold it.
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_AS_TEXT = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
OFFICIAL_MESSAGES = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": RESULT},
    {"role": "assistant", "content": ANSWER},
]


def canonical(rows: list[dict], formatting: str = "sharegpt") -> list[dict]:
    dataset, stats = to_canonical(datasets.Dataset.from_list(rows), DatasetSpec(name="d", formatting=formatting))
    assert stats.total_dropped == 0
    return dataset.to_list()


def msg(role: str, content: str | None, tool_calls: list | None = None, tool_call_id: str = "") -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": json.dumps(tool_calls) if tool_calls else "",
            "tool_call_id": tool_call_id, "reasoning": ""}


# --- formats ------------------------------------------------------------------------------------------


def test_sharegpt_function_call_and_observation() -> None:
    (row,) = canonical([SHAREGPT_ROW])
    assert row["messages"] == [
        msg("user", QUESTION), msg("assistant", None, [CALL]), msg("tool", RESULT), msg("assistant", ANSWER),
    ]
    assert json.loads(row["tools"]) == [WEATHER_TOOL]
    assert template_messages(row) == OFFICIAL_MESSAGES


def test_sharegpt_parallel_calls_and_string_arguments() -> None:
    calls = [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_weather", "arguments": {"city": "Rome"}},
    ]
    conversation = [
        {"from": "human", "value": "Paris and Rome?"},
        {"from": "function_call", "value": json.dumps(calls)},
        {"from": "observation", "value": '[{"temp": 20}, {"temp": 25}]'},
        {"from": "gpt", "value": "20 and 25."},
    ]
    (row,) = canonical([{"conversations": conversation}])
    rome = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    assert json.loads(row["messages"][1]["tool_calls"]) == [CALL_AS_TEXT, rome]  # JSON text stays as written
    assert row["tools"] == ""


def test_openai_tool_calls_and_parallel_tool_messages() -> None:
    rows = canonical([OPENAI_ROW], "openai")
    with_id = {**CALL_AS_TEXT, "id": "call12345"}
    assert rows[0]["messages"] == [
        msg("user", QUESTION), msg("assistant", None, [with_id]), msg("tool", RESULT, tool_call_id="call12345"),
        msg("assistant", ANSWER),
    ]
    parallel = {"messages": [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "20"},
        {"role": "tool", "tool_call_id": "b", "content": "25"},
        {"role": "assistant", "content": "20 and 25."},
    ]}
    (row,) = canonical([parallel], "openai")
    assert [(m["role"], m["content"], m["tool_call_id"]) for m in row["messages"]] == [
        ("user", "Paris and Rome?", ""), ("assistant", "Checking.", ""), ("tool", "20", "a"), ("tool", "25", "b"),
        ("assistant", "20 and 25.", ""),
    ]
    assert [m["tool_call_id"] for m in template_messages(row) if m["role"] == "tool"] == ["a", "b"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("get_weather(Paris)", r"the function call is not valid JSON \(Expecting value\); write it as "
                               r'\{"name": \.\.\., "arguments": \{\.\.\.\}\} or a list of those'),
        ('{"arguments": {}}', r'a function call needs a name; write it as \{"name": \.\.\., "arguments": \{\.\.\.\}\}'),
        ('{"name": "f", "arguments": "[1, 2]"}', "the arguments of function call 'f' must be a JSON object"),
    ],
)
def test_bad_function_calls_name_row_and_turn(value: str, message: str) -> None:
    conversation = [{"from": "human", "value": "q"}, {"from": "function_call", "value": value}]
    with pytest.raises(DataError, match=rf"^dataset 'd' row 0 turn 1: {message}; or set skip_bad_rows: true"):
        canonical([{"conversations": conversation}])


def test_tool_turns_keep_prompt_and_answer_alternation() -> None:
    conversation = [{"from": "human", "value": "q"}, {"from": "observation", "value": "20"}]
    with pytest.raises(DataError, match=r"turn 1 is tool, expected an assistant turn \(roles must alternate\); or set"):
        canonical([{"conversations": conversation}])


def test_a_conversation_may_end_with_a_call() -> None:
    (row,) = canonical([{"conversations": SHAREGPT_ROW["conversations"][:2]}])
    assert row["messages"][-1] == msg("assistant", None, [CALL])  # no content (None), yet not an empty answer


def test_tool_rows_and_plain_rows_share_one_schema() -> None:
    plain, _ = to_canonical(datasets.Dataset.from_list([{"instruction": "q", "output": "a"}]), DatasetSpec(name="p"))
    tools, _ = to_canonical(datasets.Dataset.from_list([SHAREGPT_ROW]), DatasetSpec(name="t", formatting="sharegpt"))
    assert plain.features == tools.features
    assert len(datasets.concatenate_datasets([plain, tools])) == 2


# --- rendering and masking ----------------------------------------------------------------------------

CALL_TEXT = {
    "qwen2_5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "qwen3": '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             "</tool_call><|im_end|>",
    "llama3_1": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
    "mistral_v0_3": ' [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}] </s>',
    "mistral_nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>',
}
ANSWER_TEXT = {
    "qwen2_5": ANSWER + "<|im_end|>",
    "qwen3": "<think>\n\n</think>\n\n" + ANSWER + "<|im_end|>",
    "llama3_1": ANSWER + "<|eot_id|>",
    "mistral_v0_3": " " + ANSWER + " </s>",
    "mistral_nemo": ANSWER + "</s>",
}


def encode(name: str, row: dict[str, Any]) -> tuple[Any, dict[str, list]]:
    tokenizer = family_tokenizer(name)
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template(name, tokenizer), cutoff_len=4096)
    return tokenizer, encoder({key: [value] for key, value in row.items()})


@pytest.mark.parametrize("source", ["sharegpt", "openai"])
@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1"])
def test_tool_conversation_renders_officially_and_trains_calls(name: str, source: str) -> None:
    (row,) = canonical([SHAREGPT_ROW]) if source == "sharegpt" else canonical([OPENAI_ROW], "openai")
    tokenizer, out = encode(name, row)
    text = official_render(name, OFFICIAL_MESSAGES, tools=[WEATHER_TOOL], **special_tokens(name))
    (ids,), (labels,) = out["input_ids"], out["labels"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # exactly the call and the answer train; the tool result (Llama-3.1 JSON-encodes even a string) is prompt
    assert supervised_runs(tokenizer, ids, labels) == [CALL_TEXT[name], ANSWER_TEXT[name]]


@pytest.mark.parametrize("source", ["sharegpt", "openai"])
def test_qwen3_tool_conversation_is_one_example_per_answer(source: str) -> None:
    # Qwen3 renders the call turn with an empty think block only while it is the last turn.
    (row,) = canonical([SHAREGPT_ROW]) if source == "sharegpt" else canonical([OPENAI_ROW], "openai")
    tokenizer, out = encode("qwen3", row)
    tokens = special_tokens("qwen3")
    texts = [official_render("qwen3", OFFICIAL_MESSAGES[:cut], tools=[WEATHER_TOOL], **tokens) for cut in (2, 4)]
    assert out["input_ids"] == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    runs = [supervised_runs(tokenizer, ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])]
    assert runs == [[CALL_TEXT["qwen3"]], [ANSWER_TEXT["qwen3"]]]


@pytest.mark.parametrize("name", ["mistral_v0_3", "mistral_nemo"])
def test_mistral_tool_ids_come_from_openai_rows(name: str) -> None:
    (row,) = canonical([OPENAI_ROW], "openai")
    tokenizer, out = encode(name, row)
    messages = [*OFFICIAL_MESSAGES]
    messages[1] = {**messages[1], "tool_calls": [{**CALL, "id": "call12345"}]}
    messages[2] = {**messages[2], "tool_call_id": "call12345"}
    text = official_render(name, messages, tools=[WEATHER_TOOL], **special_tokens(name))
    (ids,), (labels,) = out["input_ids"], out["labels"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert supervised_runs(tokenizer, ids, labels) == [CALL_TEXT[name], ANSWER_TEXT[name]]


# --- DeepSeek-R1: call turns need content None and arguments as JSON text ------------------------------

R1_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
R1_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n'
           "```<｜tool▁call▁end｜>")


@pytest.mark.parametrize("source", ["sharegpt", "openai"])
def test_deepseek_r1_call_turns_write_their_calls(source: str) -> None:
    (row,) = canonical([SHAREGPT_ROW]) if source == "sharegpt" else canonical([OPENAI_ROW], "openai")
    template = get_template("deepseek_r1_distill")
    messages = template_messages(row, template)
    assert messages[1]["content"] is None  # with "" the template writes no calls: the turn would train a bare eos
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    [(text, spans)] = template.training_examples(messages, **R1_TOKENS)
    assert [text[start:end] for start, end in spans] == [R1_CALL, ANSWER + R1_TOKENS["eos_token"]]
    assert template_messages(row, get_template("qwen2_5"))[1]["content"] == ""  # Qwen's templates take ""
    assert official_render("deepseek_r1_distill", messages, **R1_TOKENS) == text  # the official template agrees


def test_deepseek_r1_encoder_trains_the_calls(tiny_tokenizer) -> None:
    (row,) = canonical([OPENAI_ROW], "openai")
    encoder = SupervisedEncoder(tokenizer=tiny_tokenizer, template=get_template("deepseek_r1_distill"), cutoff_len=512)
    out = encoder({key: [value] for key, value in row.items()})
    runs = [supervised_runs(tiny_tokenizer, ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])]
    assert runs == [[R1_CALL, ANSWER + R1_TOKENS["eos_token"]]]


# --- arguments: null keys Arrow adds, and JSON text as written --------------------------------------------


def _weather_and_exchange_rows(exchange_arguments: Any) -> list[dict[str, Any]]:
    """Two openai rows whose calls have other argument keys: a parquet file types them as one struct of all keys."""
    def row(question: str, name: str, arguments: Any) -> dict[str, Any]:
        return {"messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
            {"role": "assistant", "content": "Done."},
        ]}

    return [row("Weather in Kyoto?", "get_weather", {"city": "Kyoto"}),
            row("5 EUR in JPY?", "convert", exchange_arguments)]


def _train_ids(tmp_path, caplog, name: str, rows: list[dict[str, Any]], suffix: str) -> list[list[int]]:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from tunelab.config.args import DataArguments  # noqa: PLC0415
    from tunelab.data.pipeline import build_datasets  # noqa: PLC0415

    path = tmp_path / f"{name}.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    info = tmp_path / "dataset_info.json"
    registry = json.loads(info.read_text()) if info.exists() else {}
    info.write_text(json.dumps({**registry, name: {"file_name": path.name, "formatting": "openai"}}))
    tokenizer = family_tokenizer("qwen2_5")
    args = DataArguments(template="qwen2_5", cutoff_len=512, dataset=[name], dataset_dir=str(tmp_path))
    caplog.clear()
    bundle = build_datasets(args, tokenizer, get_template("qwen2_5", tokenizer), seed=0)
    return [row["input_ids"] for row in bundle.train]


def test_parquet_and_json_lines_of_the_same_rows_train_the_same_ids(tmp_path, caplog) -> None:
    rows = _weather_and_exchange_rows({"amount": 5, "source": "EUR", "target": "JPY"})
    json_lines = _train_ids(tmp_path, caplog, "as_jsonl", rows, "jsonl")
    assert "null-valued" not in caplog.text
    parquet = _train_ids(tmp_path, caplog, "as_parquet", rows, "parquet")
    # The file holds {"city": "Kyoto", "amount": null, "source": null, "target": null}: 1 + 3 keys are Arrow's.
    assert "dataset as_parquet: dropped 4 null-valued keys from tool-call arguments given as objects" in caplog.text
    assert parquet == json_lines
    tokenizer = family_tokenizer("qwen2_5")
    assert '"arguments": {"city": "Kyoto"}}' in tokenizer.decode(parquet[0])


def test_a_null_written_as_json_text_trains(tmp_path, caplog) -> None:
    rows = _weather_and_exchange_rows('{"amount": 5, "source": null, "target": "JPY"}')
    first_call = rows[0]["messages"][1]["tool_calls"][0]["function"]
    first_call["arguments"] = json.dumps(first_call["arguments"])  # a parquet column holds text or objects, not both
    (_, exchange) = _train_ids(tmp_path, caplog, "as_text", rows, "parquet")
    written = family_tokenizer("qwen2_5").decode(exchange)
    assert '"arguments": {"amount": 5, "source": null, "target": "JPY"}}' in written
    assert "null-valued" not in caplog.text
