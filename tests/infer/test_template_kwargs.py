"""Template variables at inference: a trained folder's recorded template_kwargs reach chat / api prompts, eval
prompts and an export; an explicit value wins; a variable the template does not read is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.preflight import load_config
from tunelab.data.templates import get_template
from tunelab.data.templates.builtin import builtin_source
from tunelab.errors import TemplateError
from tunelab.infer.engine import load_engine
from tunelab.infer.generate import generate_predictions
from tunelab.infer.trained import inference_template_kwargs, recorded_template_kwargs
from tunelab.export.merge import export_model

EMPTY_THINK = "<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def trained_folder(tmp_path: Path, template_kwargs: dict | None) -> Path:
    """The tiny model saved as a tunelab run saves one: qwen3 as its chat template, the resolved config beside it."""
    folder = tmp_path / "run"
    shutil.copytree(TINY_MODEL_DIR, folder)
    (folder / "chat_template.jinja").write_text(builtin_source("qwen3"), encoding="utf-8")
    (folder / "tunelab_config.yaml").write_text(yaml.safe_dump({"template": "qwen3", "template_kwargs": template_kwargs}))
    return folder


def prompt_text(engine) -> str:
    return engine.tokenizer.decode(engine.prompt_ids(QUESTION))


def test_chat_engine_renders_with_the_folders_recorded_template_kwargs(tmp_path):
    folder = trained_folder(tmp_path, {"enable_thinking": False})
    engine = load_engine(str(folder))
    assert (engine.template.name, engine.template_kwargs) == ("qwen3", {"enable_thinking": False})
    assert prompt_text(engine).endswith("<|im_start|>assistant\n" + EMPTY_THINK)  # served as it trained: no thinking
    # an explicit value (--template-kwargs) wins, even an empty one
    assert prompt_text(load_engine(str(folder), template_kwargs={})).endswith("<|im_start|>assistant\n")
    # another template named here does not inherit the variables recorded for the folder's own
    assert load_engine(str(folder), template="chatml").template_kwargs == {}
    with pytest.raises(TemplateError) as info:
        load_engine(str(folder), template_kwargs={"thinking": False})
    assert str(info.value) == "template_kwargs: template 'qwen3' does not read 'thinking'; it reads enable_thinking"


def test_recorded_and_configured_template_kwargs(tmp_path):
    folder = trained_folder(tmp_path, {"enable_thinking": False})
    template = get_template("qwen3")
    assert recorded_template_kwargs(folder) == {"enable_thinking": False}
    assert recorded_template_kwargs(tmp_path) is None  # not a tunelab run
    assert inference_template_kwargs(None, folder, template) == {"enable_thinking": False}
    assert inference_template_kwargs({"enable_thinking": True}, folder, template) == {"enable_thinking": True}
    assert inference_template_kwargs(None, tmp_path, template) == {}


def test_generation_prompts_use_template_vars():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    rows = [{"system": "", "tools": "", "messages": [*QUESTION, {"role": "assistant", "content": "4"}]}]
    template = get_template("qwen3", tokenizer)
    (plain,) = generate_predictions(model, tokenizer, template, rows, max_new_tokens=1)
    (no_thinking,) = generate_predictions(model, tokenizer, template, rows, max_new_tokens=1,
                                          template_vars={"enable_thinking": False})
    assert (plain.prompt + EMPTY_THINK, plain.reference) == (no_thinking.prompt, "4")


def test_export_records_the_template_kwargs_for_chat(tmp_path):
    folder = trained_folder(tmp_path, {"enable_thinking": False})
    out = tmp_path / "exported"
    config = load_config(None, [f"model_name_or_path={folder}", f"export_dir={out}"], purpose="export")
    export_model(config)
    assert yaml.safe_load((out / "tunelab_config.yaml").read_text())["template_kwargs"] == {"enable_thinking": False}
    engine = load_engine(str(out))
    assert (engine.template.name, engine.template_kwargs) == ("qwen3", {"enable_thinking": False})
