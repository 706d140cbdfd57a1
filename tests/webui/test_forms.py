"""The form <-> options <-> YAML mapping, the field a check's message belongs to, and path confinement."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunelab.errors import ConfigError
from tunelab.webui import forms
from tunelab.webui.runs import error_line
from tunelab.webui.security import Access, Roots, check_listen

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def test_quickstart_yaml_round_trips_through_the_form():
    text = QUICKSTART.read_text(encoding="utf-8")
    form = forms.form_from_yaml(text)
    assert form["model_name_or_path"] == "tiny" and form["learning_rate"] == "0.002"
    assert yaml.safe_load(form[forms.OTHER]) == {"eval_generation": True, "eval_generation_samples": 200,
                                                 "max_new_tokens": 16}
    again = yaml.safe_load(forms.options_yaml(forms.options_from_form(form)))
    assert again == yaml.safe_load(text)


def test_empty_fields_are_keys_left_out_and_other_options_cannot_repeat_a_field():
    assert forms.options_from_form({"stage": "", "cutoff_len": " 64 ", forms.OTHER: ""}) == {"cutoff_len": "64"}
    with pytest.raises(ConfigError, match=r"^other options: cutoff_len has its own field; set it there$"):
        forms.options_from_form({"cutoff_len": "64", forms.OTHER: "cutoff_len: 32"})


@pytest.mark.parametrize("message, key", [
    ("cutoff_len must be at least 2, got -3", "cutoff_len"),
    ("learning_rate: expected float, got 'abc'", "learning_rate"),
    ("unknown key 'lerning_rate' on the command line; did you mean 'learning_rate'?", "lerning_rate"),
    ("eval_strategy needs an eval set: set eval_dataset or val_size", "val_size"),
    ("something about nothing", None),
])
def test_key_of_message(message, key):
    options = {"cutoff_len": "1", "learning_rate": "x", "lerning_rate": "1", "val_size": "0"}
    assert forms.key_of_message(message, options) == key


def test_roots_resolve_and_confine(tmp_path):
    inside, outside = tmp_path / "root", tmp_path / "other"
    inside.mkdir(), outside.mkdir()
    roots = Roots.of(inside)
    assert roots.resolve("saves/run") == inside / "saves" / "run"
    with pytest.raises(ConfigError, match=r"^output_dir: \.\./other is outside the folders this UI may use"):
        roots.resolve("../other", "output_dir")
    roots.check_options({"model_name_or_path": "tiny", "adapter_name_or_path": "Qwen/Qwen3-0.6B",
                         "resume_from_checkpoint": "true"})  # not paths of this machine
    assert Roots.of(inside, [str(outside)]).resolve(outside / "x") == outside / "x"


def test_listen_check():
    check_listen("127.0.0.1", Access())
    check_listen("::1", Access())
    check_listen("0.0.0.0", Access(token="t"))
    with pytest.raises(ConfigError, match=r"^--auth: expected user:password$"):
        check_listen("127.0.0.1", Access(user_password="ann"))
    with pytest.raises(ConfigError, match=r"^--host 10\.0\.0\.1: "):
        check_listen("10.0.0.1", Access())


def test_error_line_prefers_tunelabs_line_then_the_traceback_end():
    assert error_line("a\ntunelab: error: bad thing\nexit\n") == "tunelab: error: bad thing"
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom: here\n"
    assert error_line(traceback) == "RuntimeError: boom: here"
    assert error_line("") is None
