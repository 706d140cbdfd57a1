"""bf16 / fp16: auto (config/precision.py): the choice from the hardware facts, given as data; explicit values win;
the CPU probe is measured once and cached; the training log says the choice and why."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tunelab.model import device
from tunelab.preflight import load_config
from tunelab.config.loader import read_values
from tunelab.config.precision import (
    CpuProbe, DeviceFacts, Machine, PrecisionChoice, choose_precision, resolve_flags,
)

from .configs import write

XEON = "Intel(R) Xeon(R) Platinum 8370C"  # the developers' machine: AVX-512 but no bf16 instructions
SAPPHIRE = "Intel(R) Xeon(R) Platinum 8480+"


def test_gpus_by_compute_capability() -> None:
    assert choose_precision(DeviceFacts("cuda", "NVIDIA H100", (9, 0))) == PrecisionChoice(
        "bf16", "NVIDIA H100 (compute capability 9.0) runs bf16 natively")
    assert choose_precision(DeviceFacts("cuda", "NVIDIA A10G", (8, 6))).mode == "bf16"
    assert choose_precision(DeviceFacts("cuda", "Tesla T4", (7, 5))) == PrecisionChoice(
        "fp16", "Tesla T4 (compute capability 7.5) has no fast bf16; fp16 with loss scaling")
    assert choose_precision(DeviceFacts("cuda", "Tesla P100", (6, 0))).mode == "fp16"
    assert choose_precision(DeviceFacts("cuda", "Tesla K80", (3, 7))).mode == "fp32"


def test_cpus_need_the_flags_and_a_fast_probe() -> None:
    no_flags = DeviceFacts("cpu", XEON, cpu_flags=frozenset({"avx2", "avx512f", "avx512bw"}))
    assert choose_precision(no_flags) == PrecisionChoice(
        "fp32", f"{XEON} lacks avx512_bf16 / amx_bf16: no native bf16 matmul, it runs slower than fp32")
    flags = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    fast = DeviceFacts("cpu", SAPPHIRE, cpu_flags=flags, probe=CpuProbe(57.0, 262.0, 2))
    assert choose_precision(fast) == PrecisionChoice(
        "bf16", f"{SAPPHIRE} has amx_bf16, avx512_bf16; bf16 matmul 262 vs fp32 57 GFLOP/s on 2 threads")
    slow = DeviceFacts("cpu", SAPPHIRE, cpu_flags=flags, probe=CpuProbe(100.0, 110.0, 2))  # 1.1× < 1.2×
    assert choose_precision(slow) == PrecisionChoice(
        "fp32", f"{SAPPHIRE} has amx_bf16, avx512_bf16 but bf16 matmul 110 vs fp32 100 GFLOP/s on 2 threads "
        "(bf16 needs 1.2× fp32 to be chosen)")
    assert choose_precision(DeviceFacts("cpu", SAPPHIRE, cpu_flags=flags)).mode == "fp32"  # not measured
    assert choose_precision(DeviceFacts("other", "mps")).mode == "fp32"


@pytest.mark.parametrize(
    ("bf16", "fp16", "mode", "expected"),
    [
        (None, None, "bf16", (True, False)),
        (None, None, "fp16", (False, True)),
        (None, None, "fp32", (False, False)),
        (True, None, "fp32", (True, False)),  # explicit true wins over the hardware
        (None, True, "bf16", (False, True)),
        (False, None, "bf16", (False, False)),  # bf16: false on a bf16 GPU trains in fp32, not fp16
        (None, False, "fp16", (False, False)),
        (False, None, "fp16", (False, True)),
    ],
)
def test_explicit_values_win(bf16, fp16, mode, expected) -> None:
    assert resolve_flags(bf16, fp16, PrecisionChoice(mode, "")) == expected


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_the_probe_is_measured_once_and_cached(tmp_path) -> None:
    path = tmp_path / "probe.json"
    flags = frozenset({"avx512_bf16"})
    first = device.cached_cpu_probe("cpu A", flags, path)
    assert first.fp32_gflops > 0 and first.bf16_gflops > 0 and first.threads == torch.get_num_threads()
    # The second call reads the file: a value no measurement would give proves it was not measured again.
    record = json.loads(path.read_text())
    record["probe"]["bf16_gflops"] = 12345.0
    path.write_text(json.dumps(record))
    assert device.cached_cpu_probe("cpu A", flags, path).bf16_gflops == 12345.0
    # Another CPU (or torch version, or thread count) is another key: measured again and the cache rewritten.
    assert device.cached_cpu_probe("cpu B", flags, path).bf16_gflops != 12345.0
    assert json.loads(path.read_text())["key"] != record["key"]


def test_the_config_records_the_choice_and_explicit_values_win(tmp_path) -> None:
    base = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_sort", "output_dir": str(tmp_path / "o")}
    facts = device.device_facts(use_cpu=not torch.cuda.is_available())
    choice = choose_precision(facts)
    auto = load_config(write(tmp_path, base))
    assert auto.precision == f"{choice.mode} (auto): {choice.reason}"
    assert (auto.training.bf16, auto.training.fp16) == (choice.mode == "bf16", choice.mode == "fp16")
    assert load_config(write(tmp_path, {**base, "bf16": "auto", "fp16": "auto"})).precision == auto.precision
    forced = load_config(write(tmp_path, {**base, "bf16": True}))
    assert (forced.training.bf16, forced.training.fp16, forced.precision) == (True, False, None)
    off = load_config(write(tmp_path, {**base, "bf16": False, "fp16": False}))
    assert (off.training.bf16, off.training.fp16, off.precision) == (False, False, None)
    assert load_config(write(tmp_path, base), purpose="serve").precision is None


def test_the_launcher_decides_for_the_cpu_from_the_machine_it_is_given_not_from_the_environment(monkeypatch) -> None:
    """ACCELERATE_USE_CPU (the launching process sets it: train/launch.py) comes in as Machine.accelerate_use_cpu,
    read by model/device.py `machine`: config/ reads no environment."""
    def facts(use_cpu: bool) -> DeviceFacts:
        return DeviceFacts("cpu", XEON) if use_cpu else DeviceFacts("cuda", "NVIDIA H100", (9, 0))

    def precision(**machine) -> str | None:
        overrides = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_sort"}
        return read_values(None, overrides, "data", Machine(True, True, facts, **machine)).precision

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert precision().startswith("bf16 (auto)")  # the GPU's facts: the environment is not config/'s to read
    assert precision(accelerate_use_cpu=True).startswith("fp32 (auto)")
    assert device.machine().accelerate_use_cpu is True
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")
    assert device.machine().accelerate_use_cpu is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch: this machine trains on its GPU")
def test_the_training_log_says_the_choice_and_why(tmp_path, caplog) -> None:
    from tunelab.cli import main  # noqa: PLC0415

    facts = device.device_facts(use_cpu=True)
    choice = choose_precision(facts)
    with caplog.at_level(logging.INFO, logger="tunelab"):
        assert main(["train", "model_name_or_path=tiny", "template=chatml", "dataset=demo_sort", "max_samples=8",
                     "cutoff_len=32", "per_device_train_batch_size=8", "max_steps=1", "plot_loss=false",
                     "disable_tqdm=true", f"output_dir={tmp_path / 'out'}"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: ")]
    assert lines == [f"precision: {choice.mode} (auto): {choice.reason}"]


def test_the_switch_decides_as_on_the_other_cpu_kind() -> None:
    """TUNELAB_CPU_BF16 overrides the CPU's own facts (flags, probe) in both directions; GPUs are not affected."""
    no_flags = frozenset({"avx2", "avx512f"})
    assert choose_precision(DeviceFacts("cpu", XEON, cpu_flags=no_flags, assumed_bf16=True)) == PrecisionChoice(
        "bf16", f"TUNELAB_CPU_BF16=1 decides as on a CPU with fast native bf16 ({XEON} lacks avx512_bf16 / amx_bf16)")
    fast = DeviceFacts("cpu", SAPPHIRE, cpu_flags=frozenset({"avx512_bf16"}), probe=CpuProbe(57.0, 262.0, 2),
                       assumed_bf16=False)
    assert choose_precision(fast) == PrecisionChoice(
        "fp32", f"TUNELAB_CPU_BF16=0 decides as on a CPU without fast native bf16 ({SAPPHIRE} has avx512_bf16)")
    assert choose_precision(DeviceFacts("cuda", "Tesla T4", (7, 5), assumed_bf16=True)).mode == "fp16"


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("", None), (" 1 ", True)])
def test_the_switch_reads_one_or_zero(value, expected) -> None:
    assert device.assumed_cpu_bf16({"TUNELAB_CPU_BF16": value}) is expected
    assert device.assumed_cpu_bf16({}) is None


def test_a_wrong_switch_value_is_one_line() -> None:
    from tunelab.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError) as error:
        device.assumed_cpu_bf16({"TUNELAB_CPU_BF16": "yes"})
    assert str(error.value) == (
        "TUNELAB_CPU_BF16='yes': expected 1 (decide bf16 / fp16 auto as on a CPU with fast native bf16) or 0 (as on "
        "one without); or unset it to read this CPU's own facts")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch: this machine trains on its GPU")
@pytest.mark.parametrize("switch", ["0", "1"])
def test_under_the_switch_the_cpu_is_not_probed(tmp_path, monkeypatch, switch) -> None:
    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path))
    monkeypatch.setenv("TUNELAB_CPU_BF16", switch)
    facts = device.device_facts(use_cpu=True)
    assert (facts.kind, facts.probe, facts.assumed_bf16) == ("cpu", None, switch == "1")
    assert not (tmp_path / device.PROBE_FILE).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch: this machine trains on its GPU")
def test_bf16_auto_on_a_cpu_needs_use_cpu(tmp_path, monkeypatch) -> None:
    """transformers refuses bf16 on a CPU unless use_cpu is true: auto keeps fp32 when use_cpu: false is said."""
    monkeypatch.setenv("TUNELAB_CPU_BF16", "1")
    base = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_sort", "output_dir": str(tmp_path / "o")}
    on = load_config(write(tmp_path, base))
    assert (on.training.bf16, on.training.use_cpu) == (True, True)
    assert on.precision.startswith("bf16 (auto): TUNELAB_CPU_BF16=1 decides as on a CPU with fast native bf16 (")
    off = load_config(write(tmp_path, {**base, "use_cpu": False}))
    assert (off.training.bf16, off.training.fp16, off.training.use_cpu) == (False, False, False)
    assert off.precision.startswith("fp32 (auto): TUNELAB_CPU_BF16=1 decides as on a CPU with fast native bf16 (")
    assert off.precision.endswith("), but use_cpu is false (transformers trains bf16 on a CPU only with use_cpu: true)")
