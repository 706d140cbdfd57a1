"""Whether the configured chat template can be had: a built-in by its name, or the model's own `chat_template`, and
the template variables (template_kwargs) it reads. Checked before any weights load (tunelab/preflight.py)."""

from __future__ import annotations

import difflib

from tunelab.config.args import DataArguments, FinetuningArguments, ModelArguments
from tunelab.config.stages import stage_row
from tunelab.config.template_names import LLAMAFACTORY_TEMPLATES, TEMPLATE_ALIASES
from tunelab.data.templates.builtin import BUILTIN_NAMES, builtin_source
from tunelab.data.templates.model_folder import tokenizer_chat_template
from tunelab.data.templates.variables import check_template_kwargs
from tunelab.errors import ConfigError, TemplateError


def check_template(model: ModelArguments, data: DataArguments, finetuning: FinetuningArguments) -> None:
    """The template names a built-in (or LlamaFactory alias) or the model folder has a chat_template, and
    template_kwargs names only variables it reads; ConfigError otherwise. Stage pt trains without one."""
    if stage_row(finetuning.stage).reads == "text":
        return
    name = data.template
    if name is None or name == "model":
        source = tokenizer_chat_template(model.model_name_or_path)
        if source is None:
            raise ConfigError(
                f"template: the tokenizer in {model.model_name_or_path} has no chat_template; "
                f"set template to one of {', '.join(BUILTIN_NAMES)}"
            )
        check_template_kwargs_of("model", source, data.template_kwargs)
        return
    if name not in BUILTIN_NAMES:
        if name in LLAMAFACTORY_TEMPLATES:
            raise ConfigError(
                f"template: '{name}' is LlamaFactory's, and no built-in renders exactly like it; use template: model "
                "(the model's own chat_template, what it is served with) or a built-in (tunelab template list)"
            )
        close = difflib.get_close_matches(name, (*BUILTIN_NAMES, *TEMPLATE_ALIASES), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"template: '{name}' does not exist; {hint}built-ins: {', '.join(BUILTIN_NAMES)}")
    check_template_kwargs_of(name, builtin_source(name), data.template_kwargs)


def check_template_kwargs_of(name: str, source: str, template_kwargs: dict | None) -> None:
    """template_kwargs names only variables the template reads (variables.py), as a ConfigError."""
    try:
        check_template_kwargs(name, source, template_kwargs)
    except TemplateError as exc:
        raise ConfigError(str(exc)) from None
