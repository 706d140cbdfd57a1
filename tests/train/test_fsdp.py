"""FSDP on CPU (gloo), 2 processes, through `tunelab train ... fsdp=true nproc_per_node=2`.

accelerate runs FSDP on GPUs only; on CPU the model is sharded by FSDP2 as it loads (transformers'
distributed_config; src/tunelab/model/sharding.py) and the Trainer trains it without a DDP wrapper. Each run is
compared with one process × the same global batch (SGD, as tests/train/test_ddp.py). Checkpoints on CPU hold the
gathered model only (save_only_model: transformers cannot checkpoint the optimizer of a model sharded at load), so
they resume with resume_weights_only, which SGD without momentum makes exact. LoRA under FSDP: the frozen base is
sharded, the adapters stay whole on every rank and their gradients are averaged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.precisions import PRECISIONS, precision_env
from tests.train.test_ddp import CONFIG
from tunelab.cli import main
from tunelab.run_folder import read_log

# FSDP2 reduce-scatters gradients where one process sums them whole: another summation order, which SGD at lr 0.5
# carries into later steps (measured: step 4's loss 1.7e-5 and grad norm 3.8e-5 off, final weights 3.5e-7; LoRA
# 1e-6 and 7e-9; docs/distributed.md). The tolerance of the ZeRO tests. bf16: autocast's rounding on top (-s
# prints the measured gaps).
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (2e-2, 1e-3)}  # loss and grad norm, weights
SHARDED = "fsdp: the model is sharded layer by layer across 2 processes as it loads"
FSDP = ("per_device_train_batch_size=4", "nproc_per_node=2", "fsdp=true")
LORA = ("finetuning_type=lora", "learning_rate=0.05")


def logged(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "loss" in r]


def max_difference(a: Path, b: Path) -> float:
    first, second = load_file(a), load_file(b)
    assert first.keys() <= second.keys() or second.keys() <= first.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first.keys() & second.keys())


def train(cfg: Path, cache: Path, *overrides: str) -> str:
    """`tunelab train` launched from this process, as the DeepSpeed tests do (a `tunelab` process of its own would
    import the training stack once more per launch); what torchrun's workers wrote to stderr."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as sink, pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNELAB_CACHE", str(cache))
        patch.setenv("OMP_NUM_THREADS", "1")
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)  # the workers inherit file descriptor 2
        try:
            code = main(["train", str(cfg), *overrides])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        stderr = sink.read()
    assert code == 0, stderr[-3000:]
    return stderr


@pytest.fixture(scope="module", params=PRECISIONS)
def runs(request, tmp_path_factory):
    """Full fine-tuning (model-only checkpoints at steps 2 and 4) FSDP over 2 processes × batch 4 in each precision,
    compared with test_ddp's shared reference; in fp32 also LoRA, FSDP over 2 processes × batch 4 and in one
    process × batch 8 (LoRA's sharding does not depend on the precision, and each launch costs two workers'
    imports: about 30 s of the 2-core suite)."""
    precision = request.param
    tmp = tmp_path_factory.mktemp(f"fsdp-{precision}")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    cache = tmp / "cache"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in precision_env(precision).items():
            patch.setenv(key, value)
        stderr = {"full": train(cfg, cache, f"output_dir={tmp / 'full'}", *FSDP, "save_only_model=true", "save_steps=2")}
        if precision == "fp32":
            stderr["lora"] = train(cfg, cache, f"output_dir={tmp / 'lora'}", *FSDP, *LORA)
            patch.setenv("TUNELAB_CACHE", str(cache))
            assert main(["train", str(cfg), f"output_dir={tmp / 'lora-one'}", "per_device_train_batch_size=8",
                         *LORA]) == 0
    return tmp, stderr, precision


@pytest.mark.slow
def test_fsdp_trains_like_one_process_with_the_same_global_batch(runs, one_process_reference):
    tmp, stderr, precision = runs
    (tolerance, weight_tolerance), reference = TOLERANCE[precision], one_process_reference(precision)
    assert SHARDED in stderr["full"]
    assert "DistributedDataParallel" not in stderr["full"]
    fsdp, one = logged(tmp / "full"), logged(reference)
    assert [r["step"] for r in fsdp] == [1, 2, 3, 4]
    assert [r["epoch"] for r in fsdp] == [0.125, 0.25, 0.375, 0.5]  # 8 of 64 samples per step
    print(f"\n{precision}: loss {max(abs(a['loss'] - b['loss']) for a, b in zip(fsdp, one)):.2e}, weights "
          f"{max_difference(tmp / 'full' / 'model.safetensors', reference / 'model.safetensors'):.2e} apart")
    for a, b in zip(fsdp, one):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=tolerance)
    # The final save gathers the shards: one plain model.safetensors, tensors of the model's full shapes.
    assert sorted(p.name for p in (tmp / "full").glob("*.safetensors")) == ["model.safetensors"]
    assert max_difference(tmp / "full" / "model.safetensors", reference / "model.safetensors") < weight_tolerance


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["fp32"], indirect=True)  # resuming is precision-blind: one launch less
def test_fsdp_checkpoint_resumes_to_the_uninterrupted_run(runs, tmp_path):
    """checkpoint-2 holds the gathered model (no optimizer: SGD without momentum has no state to lose); resumed with
    resume_weights_only, steps 3 and 4 repeat the uninterrupted run's losses and end at its weights."""
    tmp, _, precision = runs
    tolerance, weight_tolerance = TOLERANCE[precision]
    checkpoint = tmp / "full" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "optimizer.pt").exists()
    assert max_difference(checkpoint / "model.safetensors", tmp / "full" / "checkpoint-4" / "model.safetensors") > 0
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(checkpoint, out / "checkpoint-2")
    train(tmp / "cfg.yaml", tmp / "cache", f"output_dir={out}", *FSDP, "save_only_model=true", "save_steps=2",
          "resume_from_checkpoint=true", "resume_weights_only=true")
    resumed, uninterrupted = logged(out), logged(tmp / "full")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, uninterrupted[2:]):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
    assert max_difference(out / "model.safetensors", tmp / "full" / "model.safetensors") < weight_tolerance


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["fp32"], indirect=True)  # the fixture trains LoRA in fp32 only
def test_lora_under_fsdp_trains_like_one_process(runs):
    """The frozen base is sharded; the adapters, added after the sharding, stay whole on each rank (transformers
    broadcasts them from rank 0 and averages their gradients): the adapter equals one process's."""
    tmp, stderr, precision = runs
    tolerance, weight_tolerance = TOLERANCE[precision]
    assert SHARDED in stderr["lora"]
    fsdp, one = logged(tmp / "lora"), logged(tmp / "lora-one")
    assert [r["step"] for r in fsdp] == [1, 2, 3, 4]
    adapter = tmp / "lora" / "adapter_model.safetensors"
    print(f"\n{precision} LoRA: loss {max(abs(a['loss'] - b['loss']) for a, b in zip(fsdp, one)):.2e}, adapter "
          f"{max_difference(adapter, tmp / 'lora-one' / 'adapter_model.safetensors'):.2e} apart")
    for a, b in zip(fsdp, one):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
    assert one[-1]["loss"] < one[0]["loss"]  # the adapter trained
    assert not (tmp / "lora" / "model.safetensors").exists()
    assert max_difference(adapter, tmp / "lora-one" / "adapter_model.safetensors") < weight_tolerance
