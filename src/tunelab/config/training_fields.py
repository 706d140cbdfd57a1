"""transformers.TrainingArguments' options — names, types, defaults, metadata — read from its source file.

Importing `transformers.training_args` imports `transformers.trainer_utils`, which imports peft whenever it is
installed, and peft imports bitsandbytes: seconds, and a kernels note on some CPUs. The commands that only read a
run's data (`tunelab data ...`, the web UI's preview) must know which keys are training options and what they
hold, but never build the Trainer's arguments. This reads the dataclass's fields from transformers' own file
with `ast` (nothing of it runs), so the options keep one definition, transformers'; tests/config/
test_training_fields.py holds the result equal to `dataclasses.fields` of the imported class.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib.util
import typing
from dataclasses import MISSING, dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class OptionField:
    """One option of a group: what the config loader needs to type a value and to name its owner."""

    name: str
    annotation: Any  # a type (or union) to convert YAML / command-line values to
    default: Any
    metadata: MappingProxyType


class _TypeNames(dict):
    """Names an annotation may use. transformers' own classes (IntervalStrategy, DebugOption...) read as
    `object`: the loader keeps such values as given (as it does for any type it does not convert)."""

    def __missing__(self, name: str) -> type:
        return object


_TYPES = {name: getattr(builtins, name) for name in ("bool", "int", "float", "str", "dict", "list", "tuple")}
_TYPES.update({name: getattr(typing, name) for name in ("Any", "Literal", "Optional", "Union", "Callable")})


def _annotation(node: ast.expr) -> Any:
    return eval(compile(ast.Expression(node), "<annotation>", "eval"), {"__builtins__": {}}, _TypeNames(_TYPES))  # noqa: S307 - a type expression of transformers' source, evaluated over type names only


def _literal(node: ast.expr | None, default: Any = None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else default
    except ValueError:  # a computed value (optim's default depends on the torch version)
        return default


def dataclass_options(cls: type) -> dict[str, OptionField]:
    """The init fields of an option dataclass (ours, or the imported TrainingArguments) as OptionFields."""
    hints = typing.get_type_hints(cls)
    return {f.name: OptionField(f.name, hints[f.name], f.default, MappingProxyType(dict(f.metadata)))
            for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


METADATA = ("help", "const")  # what tunelab reads of an option's metadata (const: a text option that is a switch)


def _literal_items(node: ast.expr | None) -> dict[str, Any]:
    """The METADATA entries of a `metadata={...}` dict."""
    if not isinstance(node, ast.Dict):
        return {}
    keys = [_literal(key) for key in node.keys]
    return {key: _literal(value) for key, value in zip(keys, node.values) if key in METADATA}


def _field(node: ast.AnnAssign) -> OptionField | None:
    """The option a class-body line declares; None for a field the constructor does not take (init=False)."""
    name, value = node.target.id, node.value
    default, metadata = (MISSING, {})
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        keywords = {k.arg: k.value for k in value.keywords}
        if _literal(keywords.get("init"), True) is False:
            return None
        if "default" in keywords:
            default = _literal(keywords["default"])
        elif "default_factory" in keywords:  # list, dict
            factory = getattr(keywords["default_factory"], "id", None)
            default = {"list": [], "dict": {}}.get(factory)
        metadata = _literal_items(keywords.get("metadata"))
    elif value is not None:
        default = _literal(value)
    return OptionField(name, _annotation(node.annotation), default, MappingProxyType(metadata))


@functools.cache
def transformers_training_fields() -> dict[str, OptionField]:
    """Every init field of transformers.TrainingArguments, in its order, without importing it."""
    spec = importlib.util.find_spec("transformers.training_args")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read(), spec.origin)  # noqa: SIM115 - read once, cached
    (cls,) = (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments")
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if annotation.startswith("ClassVar") or node.target.id.startswith("_"):
                continue
            option = _field(node)
            if option is not None:
                fields[option.name] = option
    return fields
