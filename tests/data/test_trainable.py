"""A row trains what it says, or it is a row fault naming it (data/trainable.py), with the built-in templates.

The same faults as test_real_tokenizers.py, on byte-level tokenizers that hold each family's special tokens, so
they run in every clone: a template refusal, a call or call-turn text the template would drop, reasoning with no
place or after a prompt the model is never given. Each is a (reason, one-line message), never a silent drop and
never a run stopped by an error that names no row; through the pipeline it is skipped and counted like every other
row fault.
"""

from __future__ import annotations

import json
from typing import Any

import datasets
import pytest

from tests.data.real_conversations import CONVERSATIONS
from tests.data.test_template_spans import family_tokenizer
from tunelab.config.args import DataArguments
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import message_conventions, template_messages, to_canonical
from tunelab.data.pipeline import build_datasets
from tunelab.data.registry import DatasetSpec
from tunelab.data.templates import get_template
from tunelab.data.trainable import TrainableRow
from tunelab.errors import DataError

THINKING_OFF = {"enable_thinking": False}


def encoder(name: str, mask_history: bool = False, **template_vars: Any) -> SupervisedEncoder:
    tokenizer = family_tokenizer(name)
    return SupervisedEncoder(tokenizer=tokenizer, template=get_template(name, tokenizer), cutoff_len=4096,
                             mask_history=mask_history, template_vars=template_vars)


def canonical(row: dict[str, Any]) -> dict[str, Any]:
    source = {"messages": row["messages"], "tools": json.dumps(row["tools"]) if row.get("tools") else None,
              **{key: row[key] for key in ("chosen", "rejected") if key in row}}
    spec = DatasetSpec(name="d", formatting="openai", ranking="chosen" in row)
    converted, stats = to_canonical(datasets.Dataset.from_list([source]), spec)
    assert stats.total_dropped == 0
    return converted[0]


@pytest.mark.parametrize(("name", "conversation", "template_vars", "reason"), [
    ("llama3", "tool_single", {}, "tool_calls_not_rendered"),
    ("llama3_1", "tool_single", {}, None),
    ("llama3_1", "tool_parallel", {}, "template_refused"),
    ("llama3_1", "tool_call_with_text", {}, "content_not_rendered"),
    ("gemma3", "tool_single", {}, "template_refused"),
    ("gemma3", "chat", {}, None),
    ("deepseek_r1_distill", "tool_parallel", {}, None),
    ("deepseek_r1_distill", "tool_two_rounds", {}, "template_refused"),
    ("qwen3", "reasoning", {}, None),
    ("qwen3", "reasoning_inline", {}, None),
    ("qwen3", "tool_two_rounds", {}, None),
    ("qwen3", "reasoning", THINKING_OFF, "reasoning_prompt_mismatch"),
    ("qwen3", "reasoning_inline", THINKING_OFF, "reasoning_prompt_mismatch"),
    ("chatml", "reasoning", {}, "reasoning_not_rendered"),
    ("chatml", "reasoning_inline", {}, None),  # inline reasoning is content: ChatML trains it as text
    ("chatml", "tool_single", {}, "tool_calls_not_rendered"),
])
def test_rows_train_or_are_faults(name: str, conversation: str, template_vars: dict, reason: str | None) -> None:
    fault = TrainableRow(encoder(name, **template_vars))(canonical(CONVERSATIONS[conversation]))
    assert (fault[0] if fault else None) == reason


def test_the_messages_say_what_would_be_lost_and_the_fix() -> None:
    def message(name: str, conversation: str, **template_vars: Any) -> str:
        return TrainableRow(encoder(name, **template_vars))(canonical(CONVERSATIONS[conversation]))[1]

    assert message("llama3", "tool_single") == (
        "answer 1 calls 'get_weather', but chat template 'llama3' does not write that call into what the answer trains "
        "(it has no place for tool calls, so the turn would train as an empty answer); use a template that writes tool "
        "calls (the model's own, if it has them) or remove the tool turns"
    )
    assert message("llama3_1", "tool_parallel") == (
        "chat template 'llama3_1' refused the conversation: This model only supports single tool-calls at once!; "
        "change the messages or pick another template"
    )
    assert message("gemma3", "tool_single") == (
        "chat template 'gemma3' refused the conversation: Conversation roles must alternate "
        "user/assistant/user/assistant/...; change the messages or pick another template (it has no place for tool "
        "calls and results: remove the tool turns or use a template that writes them, the model's own if it has them)"
    )
    assert message("deepseek_r1_distill", "tool_two_rounds").startswith(
        "chat template 'deepseek_r1_distill' writes message 3 (an answer) after other text than the prompt the model "
        "is given to generate it (from character "
    )
    assert "enable_thinking" not in message("deepseek_r1_distill", "tool_two_rounds")  # not a thinking template
    assert message("qwen3", "reasoning", **THINKING_OFF) == message("qwen3", "reasoning_inline", **THINKING_OFF) == (
        "answer 1 has reasoning, but chat template 'qwen3' with enable_thinking=False opens that answer at inference "
        "with '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n', which its reasoning does not follow (it would "
        "train after a prompt the model is never given); remove the reasoning (reasoning_content or the <think> block) "
        "from that answer, or set the template variables that let the model reason (template_kwargs)"
    )


def test_a_llama3_call_turn_gets_empty_content_never_the_text_none() -> None:
    # Llama 3's template writes content None as "None" and has no place for calls: "" (and the row is a fault).
    template = get_template("llama3")
    assert not message_conventions(template).null_content
    messages = template_messages(canonical(CONVERSATIONS["tool_single"]), template)
    assert messages[1]["content"] == "" and "None" not in template.render(messages)
    assert message_conventions(get_template("deepseek_r1_distill")).null_content  # R1 writes the calls only for None


def test_calls_of_an_answer_that_does_not_train_must_still_be_in_the_conversation() -> None:
    fault = TrainableRow(encoder("llama3", mask_history=True))(canonical(CONVERSATIONS["tool_single"]))
    assert fault[0] == "tool_calls_not_rendered"
    assert "does not write that call into the conversation" in fault[1]


def test_ranking_rows_whose_prompt_the_template_refuses_are_faults() -> None:
    prompt = CONVERSATIONS["tool_single"]["messages"][:3]  # ends with the tool result
    row = {"messages": prompt, "tools": CONVERSATIONS["tool_single"]["tools"], "chosen": "20 °C.", "rejected": "Cold."}
    assert TrainableRow(encoder("gemma3", mask_history=True))(canonical(row))[0] == "template_refused"
    assert TrainableRow(encoder("qwen3", mask_history=True))(canonical(row)) is None


def test_a_plain_row_the_template_refuses_is_named(tmp_path) -> None:
    # Gemma-2 refuses system turns: one line naming the row (not a TemplateError from inside the encoder), or skipped.
    rows = [CONVERSATIONS["whitespace"], CONVERSATIONS["chat"]]  # the second has a system prompt
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "data.jsonl", "formatting": "openai"}}))
    tokenizer = family_tokenizer("gemma2")

    def build(**options: Any):
        args = DataArguments(dataset_dir=str(tmp_path), dataset=["r"], template="gemma2", cutoff_len=4096, **options)
        return build_datasets(args, tokenizer, get_template("gemma2", tokenizer), seed=0)

    line = (f"dataset 'r' row 1 ({tmp_path}/data.jsonl:2): chat template 'gemma2' refused the conversation: System role "
            "not supported; change the messages or pick another template")
    with pytest.raises(DataError) as info:
        build()
    assert str(info.value) == f"{line}; or set skip_bad_rows: true to skip such rows (counted per reason)"
    source = build(skip_bad_rows=True).report["sources"][0]
    assert (source["skipped_by_reason"], source["first_skipped"]) == ({"template_refused": 1}, {"template_refused": line})


def test_rows_read_again_for_verify_can_be_checked_as_training_checks_them(tmp_path) -> None:
    # `tunelab data verify` re-reads the rows (load_canonical_splits) and encodes them again: given the run's encoder
    # it leaves out what training skipped, instead of meeting the template's refusal while encoding.
    from tunelab.data.pipeline import load_canonical_splits  # noqa: PLC0415

    rows = [CONVERSATIONS["chat"], CONVERSATIONS["tool_single"]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "data.jsonl", "formatting": "openai"}}))
    args = DataArguments(dataset_dir=str(tmp_path), dataset=["r"], template="gemma3", cutoff_len=4096, skip_bad_rows=True)
    assert len(load_canonical_splits(args, 0, {})[0]) == 2
    report: dict[str, Any] = {}
    train, _ = load_canonical_splits(args, 0, report, encoder=encoder("gemma3"))
    assert len(train) == 1 and report["sources"][0]["skipped_by_reason"] == {"template_refused": 1}
