"""The Ollama Modelfile: FROM the GGUF, a Go TEMPLATE only where it reproduces the run's template, the template's
stop markers and default system prompt."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from transformers import AutoTokenizer

from tunelab.data.templates import builtin_source
from tunelab.export.modelfile import chatml, gemma, llama3, modelfile_text, write_modelfile
from tunelab.export.parity import PROBES


def _directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("FROM", "TEMPLATE", "PARAMETER", "SYSTEM"))]


def test_tiny_modelfile(tiny, tiny_gguf):
    path = write_modelfile(tiny_gguf("q8_0"), tiny.tokenizer, tiny.chat_template, None)
    text = path.read_text()
    assert path.name == "Modelfile" and path.parent == tiny_gguf("q8_0").parent
    assert _directives(text)[0] == "FROM ./tiny-q8_0.gguf"
    assert 'TEMPLATE """' + chatml().source + '"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and "SYSTEM" not in text


def test_default_system_prompt_and_generation_prefill(tiny):
    """Qwen2.5's template writes its own system prompt when there is none: Ollama's SYSTEM does the same. Qwen3 with
    thinking off pre-fills an empty think block after the generation prompt: the Go template too."""
    text = modelfile_text("q.gguf", tiny.tokenizer, builtin_source("qwen2_5"), None)
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud. You are a helpful assistant."""' in text
    assert "<|im_start|>{{ .Role }}" in text
    text = modelfile_text("q.gguf", tiny.tokenizer, builtin_source("qwen3"), {"enable_thinking": False})
    assert chatml("<think>\n\n</think>\n\n").source in text and "SYSTEM" not in text


def test_no_template_where_none_is_faithful(tiny):
    """Mistral's [INST] format has no Go template here, and the tiny tokenizer adds no BOS while Llama 3's template
    starts with one: both rely on the GGUF's embedded template, and say so."""
    for name in ("mistral_v0_3", "llama3"):
        text = modelfile_text("m.gguf", tiny.tokenizer, builtin_source(name), None)
        assert "TEMPLATE" not in "\n".join(_directives(text))
        assert "# No TEMPLATE: no Go template here reproduces this chat template exactly" in text
        assert "tokenizer.chat_template" in text
    assert 'PARAMETER stop "</s>"' in modelfile_text("m.gguf", tiny.tokenizer, builtin_source("mistral_v0_3"), None)


def test_a_model_without_template_sends_prompts_as_they_are(tiny):
    assert 'TEMPLATE """{{ .Prompt }}"""' in modelfile_text("p.gguf", tiny.tokenizer, None, None)


@pytest.mark.slow
@pytest.mark.parametrize(("item", "template", "family"), [
    ("llama3_1", "llama3", "llama3"), ("gemma3", "gemma3", "gemma"), ("gemma3", "model", "gemma"),
])
def test_real_tokenizers_get_their_family_template(item, template, family):
    """With the family's own tokenizer (which adds BOS, as the GGUF's flag then does) the Go template is faithful."""
    from tests.real_assets import real  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(real(item))
    source = tokenizer.chat_template if template == "model" else builtin_source(template)
    text = modelfile_text("m.gguf", tokenizer, source, None)
    assert f"# TEMPLATE: the {family} format" in text
    assert {"llama3": llama3, "gemma": gemma}[family]().source in text


GO_RENDER = """package main

import (
	"encoding/json"
	"os"
	"text/template"
)

func main() {
	var cases []struct {
		Template string              `json:"template"`
		Messages []map[string]string `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		panic(err)
	}
	var out []string
	for _, c := range cases {
		var text bytesWriter
		tmpl := template.Must(template.New("t").Parse(c.Template))
		if err := tmpl.Execute(&text, map[string]any{"Messages": c.Messages}); err != nil {
			panic(err)
		}
		out = append(out, string(text))
	}
	json.NewEncoder(os.Stdout).Encode(out)
}

type bytesWriter []byte

func (b *bytesWriter) Write(p []byte) (int, error) { *b = append(*b, p...); return len(p), nil }
"""


def test_go_templates_render_what_their_python_models_say(tmp_path):
    """Each Go template, run through Go's own text/template (as Ollama runs it), renders exactly what
    GoTemplate.render computes, on the probes with and without a system turn and ending on an answer."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain (apt-get install golang-go) to run text/template")
    (tmp_path / "render.go").write_text(GO_RENDER)
    conversations = [list(p) for p in PROBES]
    conversations += [[{"role": "system", "content": "Be brief."}, *p] for p in PROBES if p[0]["role"] != "system"]
    conversations += [[*PROBES[2], {"role": "assistant", "content": "42, done"}]]
    templates = [chatml(), chatml("<think>\n\n</think>\n\n"), llama3(), gemma()]
    cases = [(t, c) for t in templates for c in conversations]
    payload = [{"template": t.source, "messages": [{"Role": m["role"], "Content": m["content"]} for m in c]}
               for t, c in cases]
    env = {"GOCACHE": str(tmp_path / "cache"), "GOPATH": str(tmp_path / "gopath"), "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin", "GOFLAGS": "-mod=mod", "GO111MODULE": "off"}
    done = subprocess.run([go, "run", str(tmp_path / "render.go")], input=json.dumps(payload), capture_output=True,
                          text=True, env=env, timeout=300, check=True)
    rendered = json.loads(done.stdout)
    for (template, conversation), text in zip(cases, rendered):
        assert text == template.render(conversation), (template.name, conversation)
