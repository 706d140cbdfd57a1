"""Writing a run config to a YAML file and loading it, as the config tests do: `write`, and `error_of` for the
one-line ConfigError a config must fail with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunelab.preflight import load_config
from tunelab.errors import ConfigError


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_of(tmp_path: Path, data: dict, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), overrides)
    return str(info.value)
