"""The versions of tunelab and the libraries it runs on (`tunelab env`, a run's run_info.json), read from the
installed packages' metadata: nothing is imported, so `tunelab env` starts as fast as the interpreter."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

PACKAGES = ("tunelab", "torch", "transformers", "peft", "datasets", "accelerate", "tokenizers")


def versions() -> dict[str, str]:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    for package in PACKAGES:
        try:
            info[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return info
