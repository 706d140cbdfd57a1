"""Images in a conversation at inference (`tunelab chat`, `tunelab api`): content parts → `<image>` + image list.

A message's content is a str or a list of parts:
    {"type": "text", "text": ...}
    {"type": "image", "image" | "path" | "url": REF}           (Hugging Face processors' form; chat's /image)
    {"type": "image_url", "image_url": {"url": REF} | REF}      (OpenAI's)
`split_images` gives the messages back with str content, each image part written as `<image>` (the placeholder
training data uses, data/formats.py), and the references in order; data/images.py opens them (a path, a data URI,
`{"bytes", "path"}`, a PIL image) and data/vision.py expands and encodes them as training did (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunelab.data.formats import IMAGE_PLACEHOLDER
from tunelab.data.images import part_image
from tunelab.errors import ImageInputError

def _image_ref(part: dict, where: str) -> Any:
    ref = part_image(part)
    if ref is None or ref == "":
        raise ImageInputError(f"{where}: an image part without its image; give image_url.url (a data URI or a path)")
    return ref


def split_images(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """(messages with str content, image references in the order their placeholders appear)."""
    out, refs = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(part.get("text") or "")
            elif kind in ("image", "image_url"):
                refs.append(_image_ref(part, f"messages.{i}.content.{j}"))
                text.append(IMAGE_PLACEHOLDER)
            else:
                raise ImageInputError(f"messages.{i}.content.{j}: unsupported content part type {kind!r}; "
                                     "use text, image or image_url")
        out.append({**message, "content": "".join(text)})
    return out, refs
