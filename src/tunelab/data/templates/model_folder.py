"""Reading the chat template that a local Hugging Face model folder ships, without loading its tokenizer.

Same precedence as transformers' ``from_pretrained``: a ``chat_template.jinja`` file wins, then
``additional_chat_templates/default.jinja``, then ``chat_template`` in ``tokenizer_config.json`` (a
string, or a list of ``{name, template}`` of which the ``default`` one counts). A GGUF file carries its template
in its metadata (``tokenizer.chat_template``), where transformers' GGUF tokenizer reads it too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tunelab.errors import TemplateError


def tokenizer_chat_template(model_dir: str | Path) -> str | None:
    """The model folder's (or GGUF file's) chat template source, or None if it ships none."""
    folder = Path(model_dir)
    if folder.suffix.lower() == ".gguf":
        return _gguf_chat_template(folder)
    for path in (folder / "chat_template.jinja", folder / "additional_chat_templates" / "default.jinja"):
        if path.is_file():
            return path.read_text(encoding="utf-8") or None
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TemplateError(f"{config_path} is not valid JSON ({exc}); repair or replace the file") from None
    return _from_config_value(config.get("chat_template") if isinstance(config, dict) else None)


def _gguf_chat_template(file: Path) -> str | None:
    # transformers' own metadata reader: it walks past the vocabulary instead of parsing it (milliseconds, not seconds)
    # lazy: the reader imports torch (2.8 s), which `tunelab template` skips; GGUF files only
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(file))
    except Exception as exc:  # noqa: BLE001  (a damaged file; model/gguf.py checked it was readable)
        raise TemplateError(f"{file}: cannot read its chat template ({exc})") from None
    template = metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


def _from_config_value(value: object) -> str | None:
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"] or None
    return None
