"""The exception families tunelab raises on purpose.

Every message is one line that names what is wrong (config key, file and line) and how to fix it.
The CLI prints these without a traceback; anything else is a bug and keeps its traceback. `as_os_error` turns a
failed write that a library reported in its own words into the OSError it is, for the same one-line treatment.
"""

from __future__ import annotations

import errno
import os
import re
import resource


class TunelabError(Exception):
    """Base class: an error the user can fix from the message alone."""


class ConfigError(TunelabError):
    """A bad configuration key, value or combination of values. `key` names the option the message is about and
    `fix` what to do, where the check knows them (the web UI marks that field)."""

    def __init__(self, message: str, *, key: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.key, self.fix = key, fix


class DataError(TunelabError):
    """A dataset that cannot be read or converted as configured."""


class TemplateError(TunelabError):
    """A chat template that cannot render or mask a conversation."""


class ModelError(TunelabError):
    """A model folder that cannot be loaded as configured."""


class ExportError(TunelabError, ValueError):
    """A model, tokenizer or option that cannot be exported as asked (the message says what can be), or an export
    that reads back differently from the model as trained (export/parity.py's ParityError)."""


class InferenceError(TunelabError):
    """A chat or API request the loaded model cannot answer as given (e.g. a prompt longer than its context)."""


class ImageInputError(InferenceError):
    """A chat or API request's images cannot be used: unreadable, more or fewer than placeholders, a text-only model."""


class TrainingError(TunelabError):
    """Training stopped on a condition the user can fix (a non-finite loss or gradient norm)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, short enough for a one-line error."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# torch.save reports a failed write (a full disk, a file-size limit) without an errno: "[enforce fail at
# inline_container.cc:...] . unexpected pos N vs M" or "PytorchStreamWriter failed writing file ...".
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")
_NEARLY_FULL = 64 << 20  # bytes free below which a failed write is taken for a full disk


def as_os_error(exc: Exception, where: str) -> Exception:
    """An I/O failure that surfaced as another type as the OSError it is (so the CLI explains it in one line),
    or `exc` unchanged. safetensors' Rust errors carry "(os error N)"; torch.save's carry no errno, so a disk
    with (almost) no space left under `where` makes it ENOSPC, a file-size limit (ulimit -f) EFBIG."""
    if isinstance(exc, OSError):
        return exc
    match = re.search(r"os error (\d+)\)", str(exc))
    if match and int(match.group(1)) in errno.errorcode:
        code = int(match.group(1))
        return OSError(code, os.strerror(code), where)
    if not (isinstance(exc, RuntimeError) and any(text in str(exc) for text in _TORCH_WRITE_FAILED)):
        return exc
    try:
        stats = os.statvfs(where)
    except OSError:
        return exc
    if stats.f_bavail * stats.f_frsize < _NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), where)
    return exc
