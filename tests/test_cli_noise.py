"""bitsandbytes' optional-kernel note stays off the terminal (it is imported by every command through peft)."""

from __future__ import annotations

import inspect
import logging

import pytest

from tunelab.cli import quiet_optional_kernel_notes


def test_the_note_comes_from_the_logger_tunelab_quiets() -> None:
    ops = pytest.importorskip("bitsandbytes.backends.cpu.ops")
    # The note is logged by this module's own logger; an upgrade that moves it fails here, not on a user's terminal.
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in inspect.getsource(ops)
    assert ops.logger.name == "bitsandbytes.backends.cpu.ops"
    before = ops.logger.level
    try:
        quiet_optional_kernel_notes()
        assert not ops.logger.isEnabledFor(logging.WARNING)
        assert ops.logger.isEnabledFor(logging.ERROR)
    finally:
        ops.logger.setLevel(before)
