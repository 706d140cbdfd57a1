"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (gloo), 2 processes, through `tunelab train ... deepspeed=<json>`.

The examples' JSON files run unchanged ("auto" values filled in by transformers). Each run is compared with one
process × the same global batch (SGD, as tests/train/test_ddp.py); ZeRO-3's final save gathers the shards
into one plain model.safetensors (stage3_gather_16bit_weights_on_model_save), and its step-2 checkpoint resumes
to exactly the uninterrupted run. On CPU DeepSpeed JIT-compiles its shared-memory op once (a C++ compiler;
the suite keeps it in the venv's torch_extensions folder (tests/conftest.py), where `make setup` has built it
(scripts/build_deepspeed_ops.py); without that, minutes in the first test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.precisions import PRECISIONS, precision_env
from tests.train.test_ddp import CONFIG
from tunelab.cli import main
from tunelab.run_folder import read_log

pytest.importorskip("deepspeed", reason="pip install 'tunelab[deepspeed]'")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "deepspeed"
# ZeRO reduces gradients in flat buckets, summed in another order than DDP's: float rounding, which SGD at lr 0.5
# carries into later losses (measured: step 4 differs by 3.4e-5, final weights by 7e-7; docs/distributed.md). bf16:
# autocast's rounding on top, and DeepSpeed saves its bf16 copy of the weights (its fp32 masters stay in the
# optimizer), against one process's float32 masters (measured with ZeRO-2: loss 2.3e-3, weights 3.0e-3; -s prints
# them).
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (2e-2, 1e-2)}  # loss, weights


def logged(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "loss" in r]


def max_weight_difference(a: Path, b: Path) -> float:
    first = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
    second = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


# Each stage in one precision, each precision with one stage: ZeRO-3 in fp32 (its checkpoint also feeds the resume
# and export tests), ZeRO-2 in bf16. What tunelab does for either (the JSON's "auto" values filled from the config,
# bf16 weights saved from DeepSpeed's bf16 copy) does not depend on the pair, and each launch costs two workers'
# imports (about 35 s of the 2-core suite).
STAGES = {"fp32": ("z3",), "bf16": ("z2",)}


@pytest.fixture(scope="module", params=PRECISIONS)
def runs(request, tmp_path_factory):
    """ZeRO-2 and ZeRO-3 with 2 processes × batch 4 (ZeRO-3 checkpoints at step 2), in the precisions of STAGES;
    each is compared with the one-process × batch 8 reference that test_multinode shares (tests/train/conftest.py)."""
    precision = request.param
    tmp = tmp_path_factory.mktemp(f"deepspeed-{precision}")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNELAB_CACHE", str(tmp / "cache"))
        patch.setenv("OMP_NUM_THREADS", "1")
        for key, value in precision_env(precision).items():
            patch.setenv(key, value)
        for stage in STAGES[precision]:
            extra = ["save_steps=2"] if stage == "z3" else []
            assert main(["train", str(cfg), f"output_dir={tmp / stage}", "per_device_train_batch_size=4",
                         "nproc_per_node=2", f"deepspeed={EXAMPLES / f'ds_{stage}_config.json'}", *extra]) == 0
    return tmp, precision


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_zero_trains_like_one_process_with_the_same_global_batch(runs, one_process_reference, stage):
    folder, precision = runs
    if stage not in STAGES[precision]:  # a skip, not a parametrization: indirect pairs would re-run the fixture
        pytest.skip(f"ZeRO-{stage[1]} runs in {' and '.join(p for p in PRECISIONS if stage in STAGES[p])} only (STAGES)")
    (tolerance, weight_tolerance), reference = TOLERANCE[precision], one_process_reference(precision)
    one, zero = logged(reference), logged(folder / stage)
    assert [r["step"] for r in zero] == [1, 2, 3, 4]
    assert [r["epoch"] for r in zero] == [0.125, 0.25, 0.375, 0.5]  # 8 of 64 samples per step
    apart = max_weight_difference(folder / stage, reference)
    print(f"\n{precision} {stage}: loss {max(abs(a['loss'] - b['loss']) for a, b in zip(zero, one)):.2e}, weights "
          f"{apart:.2e} apart")
    for a, b in zip(zero, one):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
    # The final folder is a plain Hugging Face model (ZeRO-3: gathered from the shards at the save).
    assert not list((folder / stage).glob("global_step*"))
    assert apart < weight_tolerance


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["fp32"], indirect=True)  # resuming is precision-blind: one launch less
def test_zero3_checkpoint_resumes_exactly(runs, tmp_path, monkeypatch):
    runs, _ = runs
    checkpoint = runs / "z3" / "checkpoint-2"
    assert (checkpoint / "global_step2").is_dir()  # DeepSpeed's sharded optimizer and weights
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(checkpoint, out / "checkpoint-2")
    monkeypatch.setenv("TUNELAB_CACHE", str(runs / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["train", str(runs / "cfg.yaml"), f"output_dir={out}", "per_device_train_batch_size=4",
                 "nproc_per_node=2", f"deepspeed={EXAMPLES / 'ds_z3_config.json'}", "save_steps=2",
                 "resume_from_checkpoint=true"]) == 0
    resumed, uninterrupted = logged(out), logged(runs / "z3")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted[2:]]
    assert max_weight_difference(out, runs / "z3") == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["fp32"], indirect=True)
def test_zero3_checkpoint_exports_to_one_plain_folder(runs, tmp_path, capsys):
    """`tunelab export` of checkpoint-4's shards (its gathered model.safetensors removed, as a run with
    stage3_gather_16bit_weights_on_model_save false leaves it): the float32 master weights joined from both ranks'
    partitions are exactly what DeepSpeed gathered at the end of the same run (step 4)."""
    runs, _ = runs
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(runs / "z3" / "checkpoint-4", checkpoint, ignore=shutil.ignore_patterns("model.safetensors"))
    out = tmp_path / "exported"
    assert main(["export", f"model_name_or_path={checkpoint}", f"export_dir={out}"]) == 2
    assert capsys.readouterr().err.endswith(
        f"tunelab: error: model_name_or_path: {checkpoint}/global_step4 holds DeepSpeed's pickle shards, which can "
        "run code when loaded; set allow_pickle_weights: true if you trust the run that wrote them\n")
    assert main(["export", f"model_name_or_path={checkpoint}", f"export_dir={out}", "allow_pickle_weights=true"]) == 0
    assert not list(out.glob("*.pt")) and (out / "tokenizer.json").is_file()
    assert max_weight_difference(out, runs / "z3") == 0.0
