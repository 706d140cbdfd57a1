"""Public API of tunelab.data.templates: names, get_template (and its mismatch warning), tokenizer_chat_template,
stop words, prompts, errors."""

from __future__ import annotations

import json
import logging
from dataclasses import FrozenInstanceError
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES
from tests.official import needs_official
from tunelab.data.templates import TEMPLATE_NAMES, Template, get_template, tokenizer_chat_template
from tunelab.data.templates.builtin import builtin_source
from tunelab.data.templates.engine import compile_template
from tunelab.errors import TemplateError

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QA = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}]


def tokenizer(chat_template: object = None, bos: str | None = "<s>", eos: str | None = "</s>") -> SimpleNamespace:
    return SimpleNamespace(chat_template=chat_template, bos_token=bos, eos_token=eos)


# --- names and lookup ---------------------------------------------------------------------------------


def test_template_names() -> None:
    assert list(TEMPLATE_NAMES) == sorted(TEMPLATE_NAMES)
    assert {"default", "chatml", "qwen2_5", "llama3", "llama2"} <= set(TEMPLATE_NAMES)
    package = resources.files("tunelab.data.templates")
    shipped = {p.name.removesuffix(".jinja") for p in package.iterdir() if p.name.endswith(".jinja")}
    assert shipped == set(TEMPLATE_NAMES)


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_get_builtin(name: str) -> None:
    template = get_template(name)
    assert template.name == name
    assert template.jinja == resources.files("tunelab.data.templates").joinpath(f"{name}.jinja").read_text("utf-8")
    assert get_template(name) == template  # cached and comparable


def test_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(TemplateError) as err:
        get_template("chatm")
    assert str(err.value) == (
        "template: 'chatm' does not exist; did you mean 'chatml'? built-ins: chatml, deepseek_r1_distill, "
        "deepseek_v2, default, gemma2, gemma3, glm4, internlm2, llama2, llama3, llama3_1, mistral_nemo, "
        "mistral_v0_3, phi3_5, qwen2_5, qwen3, yi"
    )


def test_unknown_name_without_a_close_match() -> None:
    with pytest.raises(TemplateError) as err:
        get_template("zzz")
    assert str(err.value) == f"template: 'zzz' does not exist; built-ins: {', '.join(TEMPLATE_NAMES)}"


@pytest.mark.parametrize("name", [None, "model"])
def test_model_template_comes_from_the_tokenizer(name: str | None) -> None:
    template = get_template(name, tokenizer(CHATML, eos="<|im_end|>"))
    assert (template.name, template.jinja, template.stop_words) == ("model", CHATML, ("<|im_end|>",))
    text, spans = template.render_with_spans(QA)
    assert [text[s:e] for s, e in spans] == ["2+2 equals 4.<|im_end|>"]


def test_model_template_named_default_in_a_dict() -> None:
    template = get_template(None, tokenizer({"default": CHATML, "tool_use": "{{ messages }}"}))
    assert template.jinja == CHATML


def test_model_template_missing() -> None:
    with pytest.raises(TemplateError) as err:
        get_template("model", tokenizer(None))
    names = ", ".join(TEMPLATE_NAMES)
    assert str(err.value) == f"template: the tokenizer has no chat_template; set template to one of {names}"
    with pytest.raises(TemplateError, match="no tokenizer was given"):
        get_template(None)


# --- tokenizer_chat_template --------------------------------------------------------------------------


def test_reads_tokenizer_config_string(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    assert tokenizer_chat_template(tmp_path) == CHATML
    assert tokenizer_chat_template(str(tmp_path)) == CHATML


def test_reads_tokenizer_config_list(tmp_path: Path) -> None:
    entries = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entries}))
    assert tokenizer_chat_template(tmp_path) == CHATML


def test_reads_chat_template_jinja(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    assert tokenizer_chat_template(tmp_path) == CHATML


def test_jinja_file_wins_over_config_like_transformers(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    (tmp_path / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    assert tokenizer_chat_template(tmp_path) == CHATML


def test_no_template(tmp_path: Path) -> None:
    assert tokenizer_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert tokenizer_chat_template(tmp_path) is None
    only_tool_use = [{"name": "tool_use", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": only_tool_use}))
    assert tokenizer_chat_template(tmp_path) is None


def test_broken_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TemplateError, match=r"tokenizer_config\.json is not valid JSON"):
        tokenizer_chat_template(tmp_path)


def test_shipped_tiny_model_template_is_none_or_the_chatml_builtin() -> None:
    # Either way `template: chatml` on the tiny model trains exactly the tokenizer's own format (no warning).
    assets = Path(__file__).resolve().parents[2] / "src" / "tunelab" / "assets" / "tiny-llama"
    if assets.is_dir():
        assert tokenizer_chat_template(assets) in (None, get_template("chatml").jinja)


# --- stop words ---------------------------------------------------------------------------------------

STOP_WORDS = {
    "chatml": ("<|im_end|>",),
    "qwen2_5": ("<|im_end|>",),
    "qwen3": ("<|im_end|>",),
    "yi": ("<|im_end|>",),
    "internlm2": ("<|im_end|>",),
    "llama3": ("<|eot_id|>",),
    "llama3_1": ("<|eot_id|>", "<|eom_id|>"),
    "gemma2": ("<end_of_turn>",),
    "gemma3": ("<end_of_turn>",),
    "phi3_5": ("<|end|>",),
    "deepseek_r1_distill": ("<｜end▁of▁sentence｜>",),
    "glm4": ("<|user|>", "<|observation|>"),
    # these end a turn with the tokenizer's eos, so they need the tokenizer to know it
    "default": (),
    "llama2": (),
    "mistral_v0_3": (),
    "mistral_nemo": (),
    "deepseek_v2": (),
}


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_stop_words_without_tokenizer(name: str) -> None:
    assert get_template(name).stop_words == STOP_WORDS[name]


@pytest.mark.parametrize("name", ["default", "llama2", "mistral_v0_3", "mistral_nemo", "deepseek_v2"])
def test_stop_words_from_the_tokenizer_eos(name: str) -> None:
    assert get_template(name, tokenizer(bos="<BOS>", eos="<EOS>")).stop_words == ("<EOS>",)


def test_stop_words_ignore_end_of_conversation_eos() -> None:
    # phi3_5 appends eos only after the last turn; the end-of-turn is <|end|>.
    assert get_template("phi3_5", tokenizer(eos="<|endoftext|>")).stop_words == ("<|end|>",)


def test_explicit_stop_words_win() -> None:
    assert Template.from_jinja("x", CHATML, stop_words=["<stop>"]).stop_words == ("<stop>",)
    assert Template.from_jinja("x", CHATML).stop_words == ("<|im_end|>",)


# --- render, prompt and errors ------------------------------------------------------------------------


def test_prompt_adds_the_generation_prompt() -> None:
    template = get_template("llama3")
    prompt = template.prompt(QA[:1], bos_token="<|begin_of_text|>")
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert prompt == template.render(QA[:1], add_generation_prompt=True, bos_token="<|begin_of_text|>")


def test_prompt_must_end_with_user_or_tool() -> None:
    with pytest.raises(TemplateError) as err:
        get_template("chatml").prompt(QA)
    assert str(err.value) == (
        "chat template 'chatml': a prompt must end with a user or tool message, got assistant; "
        "drop the trailing messages the model should generate"
    )
    with pytest.raises(TemplateError, match="got nothing"):
        get_template("chatml").prompt([])


def test_extra_variables_reach_the_template() -> None:
    text = get_template("llama3_1").render(QA, date_string="01 Jan 2030")
    assert "Today Date: 01 Jan 2030\n\n" in text
    thinking_off = get_template("qwen3").prompt(QA[:1], enable_thinking=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tojson_and_strftime_now_like_transformers() -> None:
    template = Template("t", "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}")
    assert template.render([], x={"k": "é<"}) == '{"k": "é<"}|{\n  "k": "é<"\n}|4'


def test_default_template_format() -> None:
    messages = [{"role": "system", "content": "Be nice."}, *QA, {"role": "user", "content": "Thanks"}]
    assert get_template("default").prompt(messages, bos_token="<s>", eos_token="</s>") == (
        "<s>System: Be nice.\nHuman: What is 2+2?\nAssistant: 2+2 equals 4.</s>\nHuman: Thanks\nAssistant:"
    )


def test_raise_exception_message_is_kept() -> None:
    with pytest.raises(TemplateError) as err:
        get_template("gemma2").render([{"role": "system", "content": "s"}, *QA])
    assert str(err.value) == (
        "chat template 'gemma2' refused the conversation: System role not supported; "
        "change the messages or pick another template"
    )


def test_syntax_and_render_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match=r"^chat template 'bad' is not valid Jinja \(line 1: "):
        Template.from_jinja("bad", "{% for %}")
    with pytest.raises(TemplateError, match=r"^chat template 'llama2' failed to render \(UndefinedError: "):
        get_template("llama2").render([])
    with pytest.raises(TemplateError, match="failed to render"):
        get_template("chatml").render([{"role": "user"}])


def test_template_is_frozen_and_compiled_once() -> None:
    template = get_template("chatml")
    with pytest.raises(FrozenInstanceError):
        template.name = "other"  # type: ignore[misc]
    compile_template(template.jinja)
    hits = compile_template.cache_info().hits
    template.render(QA)
    template.render(QA)
    assert compile_template.cache_info().hits >= hits + 2


# --- a built-in that differs from the tokenizer's own template ---------------------------------------

MISMATCH_LOGGER = "tunelab.data.templates"


def test_builtin_unlike_the_tokenizer_template_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        template = get_template("llama3", tokenizer(CHATML, bos="<s>", eos="<|im_end|>"))
    assert template.name == "llama3"  # a warning, not a refusal: switching formats may be intended
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [(
        MISMATCH_LOGGER, logging.WARNING,
        "template 'llama3' renders differently from the tokenizer's own chat_template from character 1: "
        "built-in 's><|start_header_id|>sys', tokenizer '|im_start|>system\\nYou ar'; the model learned its own "
        "format, so set template: model unless you mean to switch formats",
    )]


@pytest.mark.parametrize(
    ("name", "chat_template"),
    [("chatml", CHATML), ("llama3", None), ("chatml", {"default": CHATML})],
    ids=["same", "tokenizer-has-none", "dict"],
)
def test_no_warning_when_they_agree(caplog: pytest.LogCaptureFixture, name: str, chat_template: object) -> None:
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        get_template(name, tokenizer(chat_template, bos="<s>", eos="<|im_end|>"))
    assert caplog.records == []


def test_chatml_on_a_qwen2_5_tokenizer_warns(caplog: pytest.LogCaptureFixture) -> None:
    # They agree when a system turn is given; without one Qwen2.5 writes its default system prompt.
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        get_template("chatml", tokenizer(builtin_source("qwen2_5"), bos="<s>", eos="<|im_end|>"))
    assert [r.getMessage() for r in caplog.records] == [
        "template 'chatml' renders differently from the tokenizer's own chat_template from character 12: built-in "
        "'user\\nWhat is 2+2?<|im_en', tokenizer 'system\\nYou are Qwen, cre'; the model learned its own format, so "
        "set template: model unless you mean to switch formats"
    ]


@needs_official
def test_official_template_matches_its_builtin_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    own = (CHAT_TEMPLATE_FIXTURES / "llama3_1.jinja").read_text(encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        get_template("llama3_1", tokenizer(own, bos="<|begin_of_text|>", eos="<|eot_id|>"))
    assert caplog.records == []


def test_system_refusing_builtin_is_compared_without_system(caplog: pytest.LogCaptureFixture) -> None:
    # gemma2 refuses the system probe, so the comparison falls back to the probe without one.
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        get_template("gemma2", tokenizer(CHATML, bos="<bos>", eos="<eos>"))
    assert [r.getMessage() for r in caplog.records] == [
        "template 'gemma2' renders differently from the tokenizer's own chat_template from character 1: "
        "built-in 'bos><start_of_turn>user\\n', tokenizer '|im_start|>user\\nWhat is '; the model learned its own "
        "format, so set template: model unless you mean to switch formats"
    ]


def test_a_builtin_whose_generation_prompt_differs_warns(caplog: pytest.LogCaptureFixture) -> None:
    # DeepSeek-V3's own template renders finished turns as R1-Distill does but prompts "<｜Assistant｜>" alone; the
    # model would be trained on R1's format and asked, at inference, to open a think block it never learned.
    r1 = builtin_source("deepseek_r1_distill")
    without_think = r1.replace("{{- '<｜Assistant｜><think>\\n' }}", "{{- '<｜Assistant｜>' }}")
    assert without_think != r1
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER):
        get_template("deepseek_r1_distill", tokenizer(without_think, bos="<s>", eos="</s>"))
    assert [r.getMessage() for r in caplog.records] == [
        "template 'deepseek_r1_distill' renders the generation prompt differently from the tokenizer's own "
        "chat_template from character 125: built-in '<think>\\n', tokenizer ''; the model learned its own format, so set "
        "template: model unless you mean to switch formats"
    ]
