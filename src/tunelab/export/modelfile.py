"""The Ollama Modelfile written beside a GGUF: `ollama create NAME -f Modelfile` serves the export.

    FROM ./model-q8_0.gguf
    TEMPLATE \"\"\"...\"\"\"          only when a Go template renders the run's chat template faithfully
    PARAMETER stop "<|im_end|>"    one per end-of-turn marker of the template
    SYSTEM \"\"\"...\"\"\"            the template's default system prompt, if it has one

Ollama renders prompts with Go templates, not Jinja. For the common families (ChatML — Qwen, SmolLM, tunelab's
tiny model —, Llama 3 and Gemma) a Go template is written, but only after it is shown to reproduce the run's Jinja
template: on the probe conversations (parity.PROBES) the ids Ollama would feed the model (the Go render, Ollama's
SYSTEM inserted where the conversation has none, BOS added as the GGUF's add_bos flag says) must equal the ids
training used. `GoTemplate.render` is what each Go template renders, written out in Python; tests run the Go
sources through Go's own text/template where a Go toolchain exists. Any other template gets no TEMPLATE line, and
a comment saying that Ollama then goes by the chat template embedded in the GGUF.

Owns the Modelfile text only; the GGUF is gguf_writer.py's, the check of the model parity.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.data.templates import Template
from tunelab.errors import TemplateError
from tunelab.export.parity import PROBES

logger = logging.getLogger(__name__)

Message = dict[str, Any]

_SYSTEM_MARKER = "SYSTEMPROBE"


@dataclass(frozen=True)
class GoTemplate:
    """A Go template for Ollama and, in Python, exactly what it renders for a conversation (Ollama's .Messages),
    ending with the generation prompt when the last message is not the assistant's."""

    name: str
    source: str
    render: Callable[[list[Message]], str]


def _last_needs_answer(messages: list[Message]) -> bool:
    return bool(messages) and messages[-1]["role"] != "assistant"


def chatml(generation_suffix: str = "") -> GoTemplate:
    """<|im_start|>role\\ncontent<|im_end|>\\n per message; `generation_suffix` follows the generation prompt (Qwen3
    with thinking off pre-fills an empty think block there)."""
    source = (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 -}}\n"
        "<|im_start|>{{ .Role }}\n"
        "{{ .Content }}<|im_end|>\n"
        '{{ if and $last (ne .Role "assistant") }}<|im_start|>assistant\n'
        f"{generation_suffix}{{{{ end }}}}\n"
        "{{- end }}"
    )

    def render(messages: list[Message]) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + (f"<|im_start|>assistant\n{generation_suffix}" if _last_needs_answer(messages) else "")

    return GoTemplate("chatml", source, render)


def llama3() -> GoTemplate:
    """<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|> per message (BOS comes from the GGUF)."""
    source = (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 -}}\n"
        "<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>\n"
        '{{- if and $last (ne .Role "assistant") }}<|start_header_id|>assistant<|end_header_id|>\n\n'
        "{{ end }}\n"
        "{{- end }}"
    )

    def render(messages: list[Message]) -> str:
        text = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if _last_needs_answer(messages) else "")

    return GoTemplate("llama3", source, render)


def gemma() -> GoTemplate:
    """<start_of_turn>user|model\\ncontent<end_of_turn>\\n; a system message is folded into the first turn followed
    by a blank line, as Gemma 3's template does (BOS comes from the GGUF)."""
    source = (
        '{{- $system := "" }}\n'
        '{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = .Content }}{{ end }}{{ end }}\n'
        "{{- $first := true }}\n"
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
        '{{- if ne .Role "system" }}\n'
        '{{- if eq .Role "assistant" }}<start_of_turn>model\n'
        "{{ else }}<start_of_turn>{{ .Role }}\n"
        "{{ end }}\n"
        "{{- if $first }}{{ if $system }}{{ $system }}\n\n"
        "{{ end }}{{ $first = false }}{{ end }}\n"
        "{{- .Content }}<end_of_turn>\n"
        "{{ end }}\n"
        '{{- if and $last (ne .Role "assistant") }}<start_of_turn>model\n'
        "{{ end }}\n"
        "{{- end }}"
    )

    def render(messages: list[Message]) -> str:
        system = next((m["content"] for m in reversed(messages) if m["role"] == "system"), "")
        text, first = "", True
        for m in messages:
            if m["role"] == "system":
                continue
            role = "model" if m["role"] == "assistant" else m["role"]
            prefix = f"{system}\n\n" if first and system else ""
            first = False
            text += f"<start_of_turn>{role}\n{prefix}{m['content']}<end_of_turn>\n"
        return text + ("<start_of_turn>model\n" if _last_needs_answer(messages) else "")

    return GoTemplate("gemma", source, render)


def write_modelfile(
    gguf_path: str | Path,
    tokenizer: Any,
    chat_template: str | None,
    template_vars: Mapping[str, Any] | None,
    out_path: str | Path | None = None,
    stop_words: Sequence[str] | None = None,
) -> Path:
    """Write the Modelfile for `gguf_path` (default: `Modelfile` in the same folder) and return its path.

    `stop_words`: the template's end-of-turn markers when known (a built-in template's, e.g. Llama 3.1's
    <|eot_id|> and <|eom_id|>); otherwise derived from a probe render of `chat_template`.
    """
    gguf_path = Path(gguf_path)
    out = Path(out_path) if out_path is not None else gguf_path.with_name("Modelfile")
    text = modelfile_text(gguf_path.name, tokenizer, chat_template, template_vars, stop_words)
    out.write_text(text, encoding="utf-8")
    return out


def modelfile_text(
    gguf_name: str,
    tokenizer: Any,
    chat_template: str | None,
    template_vars: Mapping[str, Any] | None,
    stop_words: Sequence[str] | None = None,
) -> str:
    lines = [
        f"# Ollama Modelfile for {gguf_name}, written by tunelab export.",
        "#   ollama create my-model -f Modelfile && ollama run my-model",
        f"FROM ./{gguf_name}",
    ]
    if chat_template is None:
        lines.append("# No chat template: the model trained on plain text (stage pt); prompts go in as they are.")
        lines.append('TEMPLATE """{{ .Prompt }}"""')
        return "\n".join(lines) + "\n"
    variables = dict(template_vars or {})
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    template = Template.from_jinja("export", chat_template, stop_words, bos_token=bos, eos_token=eos)
    system = default_system_prompt(template, variables, bos, eos)
    go = faithful_go_template(template, tokenizer, variables, system)
    if go is not None:
        if '"""' in go.source:
            go = None
        else:
            lines.append(f"# TEMPLATE: the {go.name} format; checked to give the ids training used on the probe "
                         "conversations.")
            lines.append(f'TEMPLATE """{go.source}"""')
    if go is None:
        lines.append("# No TEMPLATE: no Go template here reproduces this chat template exactly, so Ollama goes by the")
        lines.append("# GGUF's embedded tokenizer.chat_template (the run's template, its variables set): it picks the")
        lines.append("# matching template of its own library, if any. Check with `ollama show --template my-model`.")
    for word in template.stop_words:
        if '"' not in word:
            lines.append(f'PARAMETER stop "{word}"')
    if system and '"""' not in system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n"


def default_system_prompt(template: Template, variables: dict[str, Any], bos: str, eos: str) -> str | None:
    """The system prompt the template writes when the conversation has none (Qwen2.5's, SmolLM2's), else None.

    Found by rendering a user turn with and without a marker system message: the template's default is whatever
    stands where the marker stood.
    """
    user = {"role": "user", "content": "Hi"}
    try:
        with_system = template.prompt([{"role": "system", "content": _SYSTEM_MARKER}, user],
                                      bos_token=bos, eos_token=eos, **variables)
        without = template.prompt([user], bos_token=bos, eos_token=eos, **variables)
    except TemplateError:
        return None
    if with_system.count(_SYSTEM_MARKER) != 1:
        return None
    head, tail = with_system.split(_SYSTEM_MARKER)
    if without.startswith(head) and without.endswith(tail) and len(without) > len(head) + len(tail):
        return without[len(head): len(without) - len(tail)]
    return None


def faithful_go_template(template: Template, tokenizer: Any, variables: dict[str, Any],
                         system: str | None) -> GoTemplate | None:
    """The first Go template whose ids, as Ollama would build them, equal the trained ids on every probe."""
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    rendered = []
    for messages in PROBES:
        try:
            rendered.append((messages, template.prompt(messages, bos_token=bos, eos_token=eos, **variables)))
        except TemplateError:
            continue  # a probe the template refuses (Gemma 2 and a system turn) says nothing here
    if not rendered:
        return None
    candidates = [chatml(_chatml_generation_suffix(rendered[0][1])), llama3(), gemma()]
    for candidate in candidates:
        trained = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in rendered]
        if all(_ollama_ids(candidate, messages, tokenizer, system) == ids
               for (messages, _), ids in zip(rendered, trained)):
            return candidate
    return None


def _ollama_ids(go: GoTemplate, messages: list[Message], tokenizer: Any, system: str | None) -> list[int]:
    """What Ollama feeds the model: SYSTEM inserted when the conversation has no system turn, the Go render, and the
    special tokens the GGUF's flags add (the same as the trained tokenizer adds: gguf_writer copies them)."""
    if system and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return tokenizer(go.render(list(messages)), add_special_tokens=True)["input_ids"]


def _chatml_generation_suffix(prompt: str) -> str:
    marker = "<|im_start|>assistant\n"
    at = prompt.rfind(marker)
    suffix = prompt[at + len(marker):] if at >= 0 else ""
    return suffix if "<|im_start|>" not in suffix and "{{" not in suffix else ""
