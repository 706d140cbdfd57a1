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


@pytest.mark.parametrize("argv", [["template", "list"], ["--help"], ["data", "--help"]])
def test_light_commands_import_no_training_stack(argv: list[str]) -> None:
    # train's --help lists every TrainingArguments option; building that text imports transformers' training
    # arguments, and through them peft and bitsandbytes: only `train --help` pays for it.
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = (
        "import sys\nfrom tunelab.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('peft', 'bitsandbytes', 'transformers.trainer', 'transformers.training_args') "
        "if m in sys.modules), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stderr.strip().splitlines()[-1] == "[]"
