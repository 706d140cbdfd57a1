"""Opening the images a dataset row refers to.

One function, `open_image`, turns any image reference a row may carry into an RGB `PIL.Image.Image`:
  - a str path (relative to the dataset's folder, or absolute; `file://` accepted),
  - a `data:image/...;base64,` URI,
  - a dict `{"bytes": b"...", "path": ...}` (the storage form of the `datasets` Image feature; bytes win,
    else the path is opened),
  - a `PIL.Image.Image`.
A reference that cannot be opened raises DataError in one line naming the dataset file, the row and the fix.
Every caller (encoding, `tunelab data`, chat / api) opens images here, so the messages are the same everywhere.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.errors import DataError


@dataclass(frozen=True)
class ImageSource:
    """Where an image reference comes from, for error messages: `file` (the dataset file or name), `row` index."""

    file: str = ""
    row: int | None = None

    def describe(self) -> str:
        parts = [self.file] if self.file else []
        if self.row is not None:
            parts.append(f"row {self.row}")
        return ", ".join(parts) or "image"


def _pil():
    try:
        from PIL import Image  # lazy: Pillow (0.6 s) only for runs with images
    except ImportError as exc:  # a declared dependency (matplotlib needs it too): only a broken install lacks it
        raise DataError("images need Pillow: pip install Pillow") from exc
    return Image


def part_image(part: dict) -> Any:
    """The image reference of an image content part, None when it holds none: {"type": "image", "image" | "path" |
    "url": REF} (processors' chat form) or {"type": "image_url", "image_url": {"url": REF} | REF} (OpenAI's).
    Training rows (data/formats.py) and inference requests (infer/images.py) both read parts through this."""
    if part.get("type") == "image_url":
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    return next((part[key] for key in ("image", "path", "url") if part.get(key) is not None), None)


def describe_ref(ref: Any) -> str:
    """A short, printable name for an image reference (never the whole base64 payload or bytes)."""
    if isinstance(ref, str):
        return ref[:40] + "..." if ref.startswith("data:") else ref
    if isinstance(ref, dict):
        if ref.get("path"):
            return str(ref["path"])
        return f"{len(ref.get('bytes') or b'')} bytes of image data"
    return type(ref).__name__


def _decode(data: bytes, what: str, where: ImageSource):
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not later in a worker
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # Pillow names the buffer's address ("cannot identify image file <_io.BytesIO object at 0x...>"): drop it.
        detail = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc).splitlines()[0] if str(exc) else "")
        raise DataError(
            f"{where.describe()}: image {what} is corrupt or not a supported image format "
            f"({type(exc).__name__}: {detail or 'unreadable'}): "
            "replace it with a PNG / JPEG / WebP / GIF / BMP file or drop the row"
        ) from None
    return image


def _data_uri(uri: str, where: ImageSource) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise DataError(
            f"{where.describe()}: image data URI '{uri[:40]}...' is not of the form "
            "'data:image/<type>;base64,<data>': encode the image as base64 with that prefix"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(
            f"{where.describe()}: image data URI '{uri[:40]}...' has invalid base64 data: re-encode the image"
        ) from None


def _resolve(path: str, base_dir: str | os.PathLike | None) -> Path:
    if path.startswith("file://"):
        path = path[len("file://"):]
    resolved = Path(os.path.expanduser(path))
    if not resolved.is_absolute() and base_dir is not None:
        resolved = Path(base_dir) / resolved
    return resolved


def _from_path(path: str, base_dir: str | os.PathLike | None, where: ImageSource):
    resolved = _resolve(path, base_dir)
    if not resolved.is_file():
        relative_to = f" (relative paths are read from {base_dir})" if base_dir is not None and not Path(path).is_absolute() else ""
        raise DataError(
            f"{where.describe()}: image file {resolved} does not exist{relative_to}: "
            "fix the path in the row or add the file"
        )
    try:
        data = resolved.read_bytes()
    except OSError as exc:
        raise DataError(f"{where.describe()}: image file {resolved} cannot be read ({exc.strerror}): fix its permissions") from None
    return _decode(data, str(resolved), where)


def open_image(ref: Any, base_dir: str | os.PathLike | None = None, where: ImageSource | None = None):
    """Open one image reference (see the module docstring) as an RGB PIL image; DataError if it cannot be."""
    where = where or ImageSource()
    Image = _pil()
    if isinstance(ref, Image.Image):
        image = ref
    elif isinstance(ref, str):
        if ref.startswith("data:"):
            image = _decode(_data_uri(ref, where), describe_ref(ref), where)
        elif ref.startswith(("http://", "https://")):
            raise DataError(
                f"{where.describe()}: image '{ref}' is a URL; tunelab reads local files only: download it and "
                "refer to the file's path (or a data: URI)"
            )
        else:
            image = _from_path(ref, base_dir, where)
    elif isinstance(ref, dict) and (ref.get("bytes") or ref.get("path")):
        if ref.get("bytes"):
            image = _decode(bytes(ref["bytes"]), describe_ref(ref), where)
        else:
            image = _from_path(str(ref["path"]), base_dir, where)
    elif isinstance(ref, (bytes, bytearray)):
        image = _decode(bytes(ref), f"{len(ref)} bytes of image data", where)
    else:
        raise DataError(
            f"{where.describe()}: image reference of type {type(ref).__name__} ({describe_ref(ref)!s:.40}) is not "
            "a path, a data: URI, {'bytes': ..., 'path': ...} or a PIL image: give one of those"
        )
    return image if image.mode == "RGB" else image.convert("RGB")


def open_images(
    refs: Sequence[Any] | None, base_dir: str | os.PathLike | None = None, where: ImageSource | None = None
) -> list:
    """Open a row's image list (None / empty → [])."""
    return [open_image(ref, base_dir, where) for ref in (refs or [])]


def as_storage(ref: Any, base_dir: str | os.PathLike | None = None, where: ImageSource | None = None) -> dict:
    """A reference checked (opened once) and turned into the storage form {"bytes", "path"} a canonical row keeps:
    files as their absolute path (read again when encoding), everything else as encoded bytes."""
    image = open_image(ref, base_dir, where)
    if isinstance(ref, str) and not ref.startswith("data:"):
        return {"bytes": None, "path": str(_resolve(ref, base_dir).resolve())}
    if isinstance(ref, dict) and not ref.get("bytes"):
        return {"bytes": None, "path": str(_resolve(str(ref["path"]), base_dir).resolve())}
    if isinstance(ref, dict):
        return {"bytes": bytes(ref["bytes"]), "path": None}
    if isinstance(ref, str):  # data URI
        return {"bytes": _data_uri(ref, where or ImageSource()), "path": None}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def fit_pixels(image, max_pixels: int | None, min_pixels: int | None):
    """The image scaled (aspect ratio kept) so that width x height lies in [min_pixels, max_pixels]
    (LlamaFactory's image_max_pixels / image_min_pixels); unchanged when it already does."""
    pixels = image.width * image.height
    factor = 1.0
    if max_pixels and pixels > max_pixels:
        factor = math.sqrt(max_pixels / pixels)
    elif min_pixels and pixels < min_pixels:
        factor = math.sqrt(min_pixels / pixels)
    if factor == 1.0:
        return image
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    return image.resize(size, resample=_pil().Resampling.BICUBIC)
