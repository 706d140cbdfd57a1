"""Importing the user's own code that a config names: the one opt-in rule for reward functions and callbacks.

A config names an object as `path/to/file.py:name` (the file is looked up relative to the working directory,
then to the config file's folder) or `package.module:name` (imported from the Python path). Nothing is
imported unless a config names it, and only the named module runs. Every failure is a ConfigError that starts
with the config key, so the CLI prints it as one line.

This module owns finding and importing; the callers (train/rl/rewards.py, train/callbacks.py) decide what
the named object must be.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tunelab.errors import ConfigError


def is_user_spec(spec: str) -> bool:
    """True when `spec` has the `where:name` shape of user code."""
    return ":" in spec


def split_user_spec(spec: str) -> tuple[str, str]:
    """(`path/to/file.py` or `package.module`, `name`) of `where:name`."""
    where, name = spec.rsplit(":", 1)
    return where, name


def import_user_module(where: str, key: str, base_dir: str | Path | None = None, fix_name: str = "name") -> ModuleType:
    """The module `where` names: a `.py` file (working directory, then base_dir) or an importable module."""
    if where.endswith(".py"):
        return _module_from_file(where, key, base_dir)
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise ConfigError(
            f"{key}: cannot import module '{where}' ({exc}); check the name or use path/to/file.py:{fix_name}"
        ) from None


def _module_from_file(where: str, key: str, base_dir: str | Path | None) -> ModuleType:
    candidates = [Path(where)]
    if base_dir is not None and not Path(where).is_absolute():
        candidates.append(Path(base_dir) / where)
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        tried = " or ".join(str(p) for p in candidates)
        raise ConfigError(f"{key}: file {tried} does not exist; give a path relative to the working directory or the config file")
    path = path.resolve()
    module_name = f"tunelab_user_code_{abs(hash(str(path)))}"
    if module_name in sys.modules:  # imported once per process, whichever key named it first
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it, so classes defined there pickle and find their module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001  (the user's file failed to run: say where)
        del sys.modules[module_name]
        raise ConfigError(f"{key}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module

