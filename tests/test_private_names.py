"""Every private name of another library that src/tunelab uses, listed with why it is kept.

tunelab builds on transformers' public API; where it has no public way, it uses a library's private name, and each
one is listed here. An upgrade that removes a listed name fails `test_every_listed_name_still_exists`; a new use
that is not listed (or a listed one no longer used) fails `test_the_list_is_every_private_name_src_uses`.

The scan reads src/tunelab with `ast` and finds:
- private imports and module paths of other libraries (`from lib import _name`, `import lib._module`);
- `obj._name` and `_name=` keyword arguments where tunelab defines no `_name` of its own;
- in a class deriving from a library class, a private name it defines, overrides, reads or writes (`def _name`,
  `self._name`, `super()._name`) that the library class has: an override, or a library attribute, or a collision of
  one of our own names with one the library added.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import transformers

import tunelab

SRC = Path(tunelab.__file__).parent

# name → (where the library defines it, why tunelab uses it and where)
PRIVATE_NAMES = {
    "_reset_state": (
        "accelerate.state.AcceleratorState",
        ("train/launch.py empties accelerate's process-wide state before torchrun forks the workers from the "
         "launching process (planning the run filled it in for one CPU process); accelerate's own tests and "
         "notebook launcher rely on an empty state the same way"),
    ),
    "_load_from_checkpoint": (
        "transformers.Trainer",
        ("override in TunelabTrainer: the Trainer's only point of loading resumed weights; a model sharded at load "
         "(model/sharding.py) takes them through torch's FSDP2 state-dict API"),
    ),
    "_get_grad_norm": (
        "transformers.Trainer",
        ("override in TunelabTrainer: the only place the Trainer hands over the gradient norm it computed before "
         "clipping, reduced as each engine needs; the non-finite guard reads it (train/guards.py)"),
    ),
    "_prepare_inputs": (
        "transformers.Trainer",
        ("PreferenceTrainer.prediction_step moves an evaluation batch to the device as training does (DeepSpeed's "
         "float dtype included)"),
    ),
    "_encode_plus": (
        "transformers.PreTrainedTokenizerFast",
        ("data/encode.py takes its fast encoding path only while a tokenizer class keeps transformers' own "
         "_encode_plus (compared by identity, never called)"),
    ),
    "_attn_implementation": (
        "transformers.PretrainedConfig",
        ("the attention a loaded model runs, a property with no public getter: train/rl/shared_prefix.py hands a "
         "custom 4D mask only to sdpa and eager (data/collate.py and train/estimate.py read it through getattr)"),
    ),
    "_fingerprint": (
        "datasets.Dataset",
        "data/pretrain.py keys the cached pt windows on the documents' fingerprint",
    ),
    "_exit": (
        "os",
        ("documented, public despite its name: cli.py ends a torchrun worker without interpreter teardown, where a "
         "library thread still joinable at C++ teardown aborted ranks of finished runs"),
    ),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _resolve(dotted: str):
    """A module ("os") or a name in one ("transformers.Trainer")."""
    module, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attribute) if module else importlib.import_module(dotted)


def _library_has(owner, name: str) -> bool:
    """A class attribute or method of `owner`, or an instance attribute its own code sets or reads (`self.name`)."""
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    return any(re.search(rf"\bself\.{re.escape(name)}\b", _source(cls)) for cls in owner.__mro__ if cls is not object)


@cache
def _source(cls) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # built-in classes
        return ""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name tunelab defines: functions, classes, parameters, assigned variables and attributes."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
    return own


def _names_touched_by_class(node: ast.ClassDef) -> set[str]:
    """Methods a class defines, and attributes it reaches through `self.` or `super().`."""
    names = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for child in ast.walk(node):
        if not isinstance(child, ast.Attribute):
            continue
        target = child.value
        if (isinstance(target, ast.Name) and target.id == "self") or (
            isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super"
        ):
            names.add(child.attr)
    return names


def private_names_used() -> dict[str, set[str]]:
    """name → the files of src/tunelab that use it, for every private name of another library."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(SRC.rglob("*.py"))}
    own = _own_names(trees)
    found: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        where = str(path.relative_to(SRC.parent))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "tunelab":
                names = [alias.name for alias in node.names] + node.module.split(".")
            elif isinstance(node, ast.Import):
                names = [part for alias in node.names if not alias.name.startswith("tunelab")
                         for part in alias.name.split(".")]
            elif isinstance(node, ast.Attribute) and node.attr not in own:
                names = [node.attr]
            elif isinstance(node, ast.keyword) and node.arg and node.arg not in own:
                names = [node.arg]
            for name in filter(_is_private, names):
                found[name].add(where)
        module = None
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ClassDef) and node.bases):
                continue
            module = module or importlib.import_module(_module_name(path))
            cls = getattr(module, node.name, None)
            if not inspect.isclass(cls):  # a class defined inside a function
                continue
            library = [k for k in cls.__mro__[1:] if k is not object and not k.__module__.startswith("tunelab")]
            for name in filter(_is_private, _names_touched_by_class(node)):
                if any(_library_has(k, name) for k in library):
                    found[name].add(where)
    return dict(found)


def test_the_list_is_every_private_name_src_uses():
    used = private_names_used()
    unlisted = {name: sorted(files) for name, files in used.items() if name not in PRIVATE_NAMES}
    assert not unlisted, (
        f"private names of other libraries used but not listed in PRIVATE_NAMES: {unlisted}; use a public way, or "
        "list each with where the library defines it and why tunelab cannot do without it"
    )
    unused = sorted(set(PRIVATE_NAMES) - set(used))
    assert not unused, f"listed in PRIVATE_NAMES but no longer used by src/tunelab: {unused}; remove them"


def test_every_listed_name_still_exists():
    missing = [f"{owner}.{name}" for name, (owner, _why) in PRIVATE_NAMES.items()
               if not _library_has(_resolve(owner), name)]
    assert not missing, f"the installed libraries no longer have {missing}: see PRIVATE_NAMES for what uses each"


def test_set_initial_training_values_still_ends_with_max_steps():
    """train/checkpoints.py resume_point takes max_steps as the last value of this public method's tuple."""
    listed = re.findall(r"^\s*- `(\w+)`", transformers.Trainer.set_initial_training_values.__doc__, re.MULTILINE)
    assert listed[-1] == "max_steps", listed
