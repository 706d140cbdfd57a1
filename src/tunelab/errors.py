"""The exception families tunelab raises on purpose.

Every message is one line that names what is wrong (config key, file and line) and how to fix it.
The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class TunelabError(Exception):
    """Base class: an error the user can fix from the message alone."""


class ConfigError(TunelabError):
    """A bad configuration key, value or combination of values."""


class DataError(TunelabError):
    """A dataset that cannot be read or converted as configured."""


class TemplateError(TunelabError):
    """A chat template that cannot render or mask a conversation."""


class ModelError(TunelabError):
    """A model folder that cannot be loaded as configured."""


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
