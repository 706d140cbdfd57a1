"""Which tokenizer, chat template and template variables run a trained folder: decided here, once, for `tunelab
eval` / do_predict, `tunelab chat` / `api` and `tunelab export`, from what the folder says about itself
(run_folder.TrainedFolder).

- tokenizer: the one an adapter folder saved beside it (a tunelab run saves the tokenizer it trained with, chat
  template included), else the model's;
- template: `saved_template` is the chat template saved with the tokenizer, as a built-in when it is one (its name
  and curated stop words) and as the tokenizer's own otherwise; eval and export use it for a folder a tunelab run
  wrote (the configured template otherwise), chat and api unless a template is named on the command line;
- variables: the configured ones when set (even {}), else those the run recorded in tunelab_config.yaml, else
  none; checked against the variables the template reads.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tunelab.config.args import ModelArguments
from tunelab.data.templates import TEMPLATE_NAMES, Template, check_template_kwargs, get_template
from tunelab.data.templates.builtin import builtin_source
from tunelab.data.templates.template import tokenizer_source
from tunelab.model.tokenizer import load_tokenizer
from tunelab.run_folder import TrainedFolder

logger = logging.getLogger(__name__)


def trained_folder(model_args: ModelArguments) -> TrainedFolder:
    """The folder that holds the trained weights: the adapter's, else the model's."""
    return TrainedFolder.of(model_args.model_name_or_path, model_args.adapter_name_or_path)


def load_inference_tokenizer(model_args: ModelArguments):
    """The tokenizer saved beside the adapter when there is one (it carries the trained chat template), else the
    model's."""
    folder = trained_folder(model_args).tokenizer_folder(model_args.model_name_or_path)
    return load_tokenizer(dataclasses.replace(model_args, model_name_or_path=str(folder)))


def saved_template(tokenizer) -> Template | None:
    """The chat template saved with the tokenizer: a built-in by its name when it is one, else the tokenizer's own;
    None when the tokenizer has no chat_template (a pretraining run, a base model)."""
    source = tokenizer_source(tokenizer)
    if source is None:
        return None
    builtin = next((name for name in TEMPLATE_NAMES if builtin_source(name) == source), None)
    return get_template(builtin, tokenizer) if builtin else Template.from_tokenizer(tokenizer)


def inference_template(template_name: str | None, tokenizer, folder: TrainedFolder | str | Path) -> Template:
    """The chat template a folder written by a tunelab run saved (the one it trained with), else the configured one."""
    folder = folder if isinstance(folder, TrainedFolder) else TrainedFolder(Path(folder))
    saved = saved_template(tokenizer) if folder.is_tunelab_run else None
    if saved is None:
        return get_template(template_name, tokenizer)
    if template_name not in (None, "model", saved.name):
        trained_with = f"'{saved.name}'" if saved.name in TEMPLATE_NAMES else "its own chat template"
        logger.warning(
            "template: %s trained with %s, not the configured '%s'; evaluating with the template it trained with",
            folder.path, trained_with, template_name,
        )
    return saved


def recorded_template_kwargs(folder: TrainedFolder | str | Path) -> dict[str, Any] | None:
    """The template_kwargs a tunelab run recorded in folder/tunelab_config.yaml; None without such a record."""
    return (folder if isinstance(folder, TrainedFolder) else TrainedFolder(Path(folder))).template_kwargs


def inference_template_kwargs(
    configured: dict[str, Any] | None, folder: TrainedFolder | str | Path, template: Template
) -> dict[str, Any]:
    """The template variables to render with: configured ones when set (even {}), else those the trained folder
    recorded, else none; checked against the variables `template` reads (TemplateError)."""
    kwargs = dict(configured) if configured is not None else (recorded_template_kwargs(folder) or {})
    check_template_kwargs(template.name, template.jinja, kwargs)
    return kwargs
