"""bitsandbytes' and torchao's optional-kernel notes and DeepSpeed's CPU-accelerator note stay off the terminal
(every command imports them through peft, transformers' quantizers and accelerate when they are installed), and
only those notes; light commands import no training stack at all."""

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


def _warning(logger: logging.Logger, message: str) -> logging.LogRecord:
    return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)


def test_torchao_kernel_notes_are_dropped_and_its_other_warnings_kept() -> None:
    torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install 'tunelab[qat]')")
    import torch.utils._pytree as pytree

    # Both notes come from these loggers; an upgrade that moves them fails here, not on a user's terminal.
    assert 'logger.warning(f"Failed to load {file}: {e}")' in inspect.getsource(torchao)
    assert torchao.logger.name == "torchao"
    assert "is an Enum subclass and is now natively supported" in inspect.getsource(pytree)
    assert pytree.log.name == "torch.utils._pytree"
    import torchao.kernel.intmm as intmm  # noqa: PLC0415

    assert "Detected no triton, on systems without Triton certain kernels will not work" in inspect.getsource(intmm)
    assert intmm.logger.name == "torchao.kernel.intmm"
    before = (list(torchao.logger.filters), list(pytree.log.filters), list(intmm.logger.filters))
    try:
        quiet_optional_kernel_notes()
        quiet_optional_kernel_notes()  # every command calls it; each filter is added once
        assert [type(f).__name__ for f in torchao.logger.filters].count("_DropMessage") == 1
        assert [type(f).__name__ for f in pytree.log.filters].count("_DropMessage") == 1
        so = "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load this library"
        assert not torchao.logger.filter(_warning(torchao.logger, so))
        assert torchao.logger.filter(_warning(torchao.logger, "Skipping import of cpp extensions"))
        enum_note = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"
        assert not pytree.log.filter(_warning(pytree.log, enum_note))
        assert pytree.log.filter(_warning(pytree.log, "some other pytree warning"))
        triton = "Warning: Detected no triton, on systems without Triton certain kernels will not work"
        assert not intmm.logger.filter(_warning(intmm.logger, triton))
        assert intmm.logger.filter(_warning(intmm.logger, "some other intmm warning"))
    finally:
        torchao.logger.filters[:], pytree.log.filters[:], intmm.logger.filters[:] = before


def test_deepspeed_cpu_accelerator_note_is_dropped_and_its_other_warnings_kept() -> None:
    # accelerate's unwrap_model imports deepspeed in every Trainer when it is installed; its import then warns
    # from real_accelerator.py through the "DeepSpeed" logger. An upgrade that moves the note fails here.
    real_accelerator = pytest.importorskip("deepspeed.accelerator.real_accelerator",
                                           reason="pip install 'tunelab[deepspeed]'")
    import deepspeed.utils.logging as ds_logging  # noqa: PLC0415

    note = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    assert f'accel_logger.warning(\n                    "{note}")' in inspect.getsource(real_accelerator)
    assert real_accelerator.accel_logger is ds_logging.logger and ds_logging.logger.name == "DeepSpeed"
    logger = ds_logging.logger
    before = list(logger.filters)
    try:
        quiet_optional_kernel_notes()
        quiet_optional_kernel_notes()
        assert [type(f).__name__ for f in logger.filters].count("_DropMessage") == 1
        assert not logger.filter(_warning(logger, note))
        assert logger.filter(_warning(logger, "some other DeepSpeed warning"))
    finally:
        logger.filters[:] = before


QUICK_DATA = ["examples/quickstart.yaml", "max_samples=64"]
LIGHT_COMMANDS = [
    ["template", "list"], ["template", "show", "chatml"], ["--help"], ["data", "--help"], ["env"],
    # `tunelab data` reads the whole config, training options included (config/training_values.py)
    ["data", "stats", *QUICK_DATA, "output_dir=OUT"], ["data", "verify", *QUICK_DATA], ["data", "coverage", *QUICK_DATA],
    ["data", "stats", "examples/pretrain.yaml", "max_samples=64", "output_dir=OUT"],
    ["data", "verify", "examples/dpo.yaml", "max_samples=64", "model_name_or_path=tiny"],
]
TRAINING_STACK = ("peft", "bitsandbytes", "transformers.trainer", "transformers.training_args")


@pytest.mark.slow  # a fresh interpreter runs the commands: not make test-fast's
def test_light_commands_import_no_training_stack(tmp_path) -> None:
    """One interpreter runs the commands in turn and lists the training modules loaded after each: sys.modules only
    grows, so the first command that imports one is the first line that names it (one start-up, not ten).
    train's --help lists every TrainingArguments option; building that text imports transformers' training
    arguments, and through them peft and bitsandbytes: only `train --help` pays for it."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    repo = Path(__file__).resolve().parents[1]
    commands = [[str(repo / a) if a.startswith("examples/") else a.replace("OUT", str(tmp_path / f"out{i}")) for a in argv]
                for i, argv in enumerate(LIGHT_COMMANDS)]
    code = (
        "import json, sys\nfrom tunelab.cli import main\n"
        f"for argv in {commands!r}:\n"
        "    try:\n        code = main(argv)\n    except SystemExit as exit:\n        code = exit.code\n"
        f"    loaded = sorted(m for m in {TRAINING_STACK!r} if m in sys.modules)\n"
        "    print('LOADED', json.dumps([' '.join(argv[:2]), code, loaded]), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True,
                            cwd=tmp_path)
    seen = [json.loads(line[len("LOADED "):]) for line in result.stderr.splitlines() if line.startswith("LOADED ")]
    assert seen == [[" ".join(argv[:2]), 0, []] for argv in commands], result.stderr[-3000:]
