"""The form <-> options <-> YAML mapping, the field a check's message belongs to, and path confinement."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest
import yaml

from tunelab.config.applicability import check_applicability, default_of
from tunelab.config.args import DataArguments, FinetuningArguments, GenerationArguments, ModelArguments, option_groups
from tunelab.config.training_options import TRAINING_DEFAULTS
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
    roots.check_options({"teacher_model_name_or_path": "tiny"})
    roots.check_options({"teacher_model_name_or_path": "Qwen/Qwen2.5-Coder-1.5B-Instruct"})
    with pytest.raises(ConfigError, match=r"^teacher_model_name_or_path: \.\./other is outside"):
        roots.check_options({"teacher_model_name_or_path": "../other"})  # a teacher on disk: inside the roots
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


# The form's fields are the options' own declarations (config/args.py, config/training_options.py and transformers'
# TrainingArguments, here imported as a run imports it): only the layout is the form's.

def _declared():
    """Every option by name: (dataclasses.Field, annotation, the default a run starts from)."""
    declared = {}
    for group in option_groups("train"):
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            if f.init and not f.name.startswith("_"):
                declared[f.name] = (f, hints[f.name], TRAINING_DEFAULTS.get(f.name, default_of(f)))
    return declared


def test_every_field_is_an_option_once_and_in_a_section():
    declared = _declared()
    assert [key for key in forms.FIELD_KEYS if key not in declared] == []
    assert len(set(forms.FIELD_KEYS)) == len(forms.FIELD_KEYS)
    assert [f.key for f in forms.form_fields()] == list(forms.FIELD_KEYS)
    assert {f.section for f in forms.form_fields()} == set(forms.SECTIONS)
    assert set(forms.HINTS) <= set(forms.FIELD_KEYS) and set(forms.CHOICES) <= set(forms.FIELD_KEYS)


def test_kind_choices_hint_and_help_are_what_the_option_declares():
    declared = _declared()
    for f in forms.form_fields():
        option, annotation, default = declared[f.key]
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        types_ = [t for t in typing.get_args(annotation) if t is not type(None)] if union else [annotation]
        if f.key in forms.CHOICES or f.key == "template":
            assert f.kind == "select" and f.choices[0] == "" and len(f.choices) > 2, f.key
        elif typing.get_origin(annotation) is typing.Literal:
            assert (f.kind, f.choices) == ("select", ("", *typing.get_args(annotation))), f.key
        elif annotation is bool:
            assert (f.kind, f.choices) == ("select", ("", "true", "false")), f.key
        else:
            number = all(t in (int, float) for t in types_)
            assert (f.kind, f.choices) == ("number" if number else "text", ()), f.key
        shown = forms.default_text(default)
        if f.key in forms.HINTS:  # an override says more than the default would
            assert f.hint == forms.HINTS[f.key] != shown, f.key
        else:
            assert f.hint == shown != "", f"{f.key}: a default of {default!r} needs a placeholder in forms.HINTS"
        first = " ".join(option.metadata["help"].split()).split(". ")[0].rstrip(".")
        assert first and f.help.startswith(first), f.key


def test_fields_spot_checks():
    fields = {f.key: f for f in forms.form_fields()}
    assert fields["stage"].choices == ("", "pt", "sft", "rm", "dpo", "kto", "grpo", "ppo", "kd")
    assert (fields["stage"].hint, fields["finetuning_type"].hint) == ("sft", "lora")
    assert fields["logging_steps"].hint == "10"  # tunelab's default, not transformers' 500
    assert (fields["num_train_epochs"].hint, fields["learning_rate"].hint, fields["val_size"].hint) == ("3", "5e-05", "0")
    assert (fields["lora_target"].kind, fields["lora_target"].hint) == ("text", "all")
    assert (fields["max_samples"].kind, fields["warmup_steps"].kind) == ("number", "number")
    assert fields["bf16"].help.startswith("Enable bfloat16") and "auto: bf16 where" in fields["bf16"].help
    assert fields["template"].choices[:2] == ("", "model")


def test_offered_schedules_are_transformers_schedules():
    from transformers.trainer_utils import SchedulerType  # noqa: PLC0415 - imports peft: only this test pays

    assert set(forms.CHOICES["lr_scheduler_type"]) - {""} <= {s.value for s in SchedulerType}
    assert _declared()["lr_scheduler_type"][2] == "linear" == {f.key: f for f in forms.form_fields()}[
        "lr_scheduler_type"].hint


def _changed(value):
    """A value other than `value`, of its kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return [*value, "x"]
    return 1 if value is None else f"{value}x"


def test_lora_fields_show_for_lora_and_the_default():
    shows = {f.key: f.shows_for for f in forms.form_fields() if f.shows_for}
    lora = {"finetuning_type": ("", "lora")}
    assert shows == {"lora_rank": lora, "lora_alpha": lora, "lora_target": lora}


def test_a_field_shows_exactly_where_its_option_acts():
    """For every value of the form's selects that decide where options act (stage, finetuning_type), a field shows
    (as static/webui.js decides from shows_for) exactly when the config check accepts its option set there."""
    fields = {f.key: f for f in forms.form_fields()}
    deciding = ("stage", "finetuning_type")
    groups_of = (ModelArguments, DataArguments, FinetuningArguments, GenerationArguments)
    owner = {f.name: group for group in groups_of for f in dataclasses.fields(group)}
    declared = _declared()
    checked = 0
    for key, field in fields.items():
        if key not in owner or key in deciding:
            continue
        for decider in deciding:
            for value in fields[decider].choices:
                groups = {group: group() for group in groups_of}  # (frozen: each change is a new value)
                if value:
                    groups[owner[decider]] = dataclasses.replace(groups[owner[decider]], **{decider: value})
                groups[owner[key]] = dataclasses.replace(groups[owner[key]], **{key: _changed(declared[key][2])})
                shows = all(value in allowed for k, allowed in field.shows_for.items() if k == decider)
                try:
                    check_applicability(list(groups.values()), deciding)
                    acts = True
                except ConfigError:
                    acts = False
                assert shows == acts, f"{key} under {decider}: {value!r}: shows {shows}, the check accepts {acts}"
                checked += 1
    assert checked > 50
