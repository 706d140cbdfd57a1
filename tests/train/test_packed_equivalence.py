"""Packed training equals unpacked training, and the transformers behaviour it rests on is pinned.

For a batch of mixed-length samples, packed rows (data/packing.py + PackedCollator) must give the
same per-sample logits, loss and gradients as the samples padded one per row, within 1e-5 in fp32,
for Llama and Qwen2 with sdpa and eager attention, on the position-id path and the block-mask path.

The leak pins assert the conditions of transformers' packed-sequence detection (see the packing
module docstring): with an all-ones attention mask, the KV cache on, or no position ids, the same
packed rows leak across samples. If a transformers upgrade changes either side, a test here fails.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.data.collate import (
    SDPA_VARLEN,
    PackedCollator,
    PaddingFreeCollator,
    SupervisedCollator,
    build_collator,
    side_by_side,
)
from tunelab.data.packing import pack_dataset, pack_lengths
from tunelab.model import varlen_sdpa
from tunelab.model.load import load_model
from tunelab.train.losses import causal_lm_loss
from tunelab.train.trainer import TunelabTrainer

CUTOFF = 64
LEAK = 1e-3  # a leak moves logits by ~0.1-2; isolation agrees to ~1e-7


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


def samples() -> list[dict]:
    """Eight samples of 5..54 tokens, each with a different prompt (unsupervised) length."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        length = 5 + 7 * i
        ids = torch.randint(3, 256, (length,), generator=g).tolist()
        prompt = 1 + (i * 5) % (length - 2)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def load(model_dir, attn: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model


def packed_rows() -> list[dict]:
    packed, _ = pack_dataset(datasets.Dataset.from_list(samples()), CUTOFF)
    return packed.to_list()


def sample_logits(
    logits: torch.Tensor, position_ids: torch.Tensor | None = None, capacity: int = CUTOFF
) -> dict[int, torch.Tensor]:
    """Logits of every sample by its index, from an unpacked (position_ids None) or a packed batch
    (rows of `capacity`: CUTOFF for pack_dataset, the longest sample for padding-free batches)."""
    if position_ids is None:
        return {i: logits[i, : len(s["input_ids"])] for i, s in enumerate(samples())}
    bins = pack_lengths([len(s["input_ids"]) for s in samples()], capacity)  # the bins the collator used
    if position_ids.shape[0] == 1 and len(bins) > 1:  # varlen: the rows flattened into one, in order
        bins = [[index for members in bins for index in members]]
    out = {}
    for row, members in enumerate(bins):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist()
        for index, start in zip(members, starts):
            out[index] = logits[row, start : start + len(samples()[index]["input_ids"])]
    return out


def forward_backward(model, batch: dict, capacity: int = CUTOFF) -> tuple[float, dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    loss = causal_lm_loss(logits, batch["labels"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), sample_logits(logits.detach(), batch.get("position_ids"), capacity), grads


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("attention", ["position_ids", "block_mask"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_unpacked(model_dir, attn, attention):
    model = load(model_dir, attn)
    loss_u, logits_u, grads_u = forward_backward(model, SupervisedCollator(0)(samples()))
    batch = PackedCollator(0, attention)(packed_rows())
    assert batch["input_ids"].shape[0] < len(samples())  # really packed, and rows padded to the longest
    loss_p, logits_p, grads_p = forward_backward(model, batch)
    diffs = {"loss": abs(loss_p - loss_u), "logits": max_diff(logits_u, logits_p), "grads": max_diff(grads_u, grads_p)}
    print(f"{model_dir.name} {attn} {attention}: max |packed - unpacked| "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert len(logits_p) == len(samples())
    assert diffs["loss"] < 1e-5 and diffs["logits"] < 1e-5 and diffs["grads"] < 1e-5
    assert max(g.abs().max().item() for g in grads_u.values()) > 1e-3


def test_sdpa_per_sample_equals_unpacked(model_dir):
    """sdpa_varlen (sdpa run once per sample, model/varlen_sdpa.py) on the packed rows flattened into one: the
    padded batch's logits, loss and gradients. Its all-ones mask turns transformers' own isolation off (the leak
    pins below), so only the per-sample attention keeps the samples apart."""
    model = load(model_dir, "sdpa")
    loss_u, logits_u, grads_u = forward_backward(model, SupervisedCollator(0)(samples()))
    assert varlen_sdpa.use_for_training(model) and model.config._attn_implementation == SDPA_VARLEN
    collator = PackedCollator.for_model(model, 0)
    assert collator == PackedCollator(0, "varlen", ones_mask=True)
    batch = collator(packed_rows())
    assert batch["input_ids"].shape[0] == 1 and batch["attention_mask"].all()
    loss_v, logits_v, grads_v = forward_backward(model, batch)
    diffs = {"loss": abs(loss_v - loss_u), "logits": max_diff(logits_u, logits_v), "grads": max_diff(grads_u, grads_v)}
    print(f"{model_dir.name} sdpa_varlen: max |packed - unpacked| " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert len(logits_v) == len(samples())
    assert diffs["loss"] < 1e-5 and diffs["logits"] < 1e-5 and diffs["grads"] < 1e-5
    with torch.no_grad():  # the same row without its boundaries: one causal sequence, the samples leak
        whole = model(**{k: v for k, v in batch.items() if not k.startswith(("cu_seq", "max_length", "labels"))})
    assert max_diff(logits_u, sample_logits(whole.logits, batch["position_ids"])) > LEAK


def test_every_model_of_a_run_takes_the_per_sample_batches(tiny_llama_dir):
    """A frozen reference or teacher gets the trained model's batches: load_model switches it too (plain sdpa would
    read the batch's all-ones mask as one sequence), and its generation still runs."""
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    frozen = load_model(ModelArguments(model_name_or_path=str(tiny_llama_dir)), FinetuningArguments(), args, tokenizer,
                        is_trainable=False)
    assert frozen.config._attn_implementation == SDPA_VARLEN
    alone = sample_logits(frozen(**SupervisedCollator(0)(samples()) | {"labels": None}).logits.detach())
    batch = PackedCollator(0, "varlen", ones_mask=True)(packed_rows())  # what the trained model's collator makes
    packed = frozen(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.detach()
    assert max_diff(alone, sample_logits(packed, batch["position_ids"])) < 1e-5
    prompt = torch.tensor([samples()[0]["input_ids"][:6]])
    reference = load(tiny_llama_dir, "sdpa").generate(prompt, max_new_tokens=5, do_sample=False)
    assert frozen.generate(prompt, max_new_tokens=5, do_sample=False).tolist() == reference.tolist()


def test_sdpa_per_sample_only_where_every_layer_attends_fully(tiny_qwen2_dir):
    """A sliding-window layer needs sdpa's mask: such a model keeps sdpa, and a packed row reaching the per-sample
    function there is refused, not attended across samples."""
    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    config.use_sliding_window, config.sliding_window = True, 16
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert not varlen_sdpa.use_for_training(model) and model.config._attn_implementation == "sdpa"
    varlen_sdpa.register()
    model.set_attn_implementation(SDPA_VARLEN)
    model.config.use_cache = False
    batch = PackedCollator(0, "varlen", ones_mask=True)(packed_rows())
    with pytest.raises(ValueError, match=r"^sdpa_varlen: cannot isolate the samples of this packed row in "):
        model(**{k: v for k, v in batch.items() if k != "labels"})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_leak_pins(model_dir, attn):
    """Isolation holds only with position ids, no attention mask and no KV cache (transformers' conditions)."""
    model = load(model_dir, attn)
    batch = PackedCollator(0)(packed_rows())
    ids, pos = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        alone = sample_logits(model(**SupervisedCollator(0)(samples()) | {"labels": None}).logits)
        packed = {
            "isolated": model(input_ids=ids, position_ids=pos).logits,
            "all-ones attention_mask": model(
                input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)
            ).logits,
            "KV cache on": model(input_ids=ids, position_ids=pos, use_cache=True).logits,
            "no position_ids": model(input_ids=ids).logits,
        }
    diffs = {name: max_diff(alone, sample_logits(logits, pos)) for name, logits in packed.items()}
    print(f"{model_dir.name} {attn}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert diffs.pop("isolated") < 1e-5
    for name, diff in diffs.items():
        assert diff > LEAK, f"{name}: packed samples no longer leak; transformers changed its packed-sequence detection"


# The trainer-step equalities per precision: (loss, gradients). bf16 autocast rounds each matmul's output, and a
# packed or side-by-side row holds other neighbours in its sums than a padded one (-s prints the measured gaps).
STEP_TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (1e-4, 1e-3)}  # measured bf16: loss 5e-7, grads 2.4e-4


def trainer_step(tmp_path, model_dir, dataset, collator_for, precision: str = "fp32") -> tuple[dict, float]:
    """One SGD step with lr=1 through TunelabTrainer on a model from tunelab's load_model: weights move by the grads.
    bf16: the Trainer's bf16 autocast over the float32 master weights load_model sets up, as a bf16 run trains."""
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(dataset), max_steps=1, learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        report_to="none", save_strategy="no", remove_unused_columns=False, use_cpu=True, seed=0, disable_tqdm=True,
        bf16=precision == "bf16",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(
        ModelArguments(model_name_or_path=str(model_dir), flash_attn="sdpa"),
        FinetuningArguments(finetuning_type="full"), args, tokenizer,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = TunelabTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator_for(model))
    trainer.train()
    grads = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    return grads, next(log["loss"] for log in trainer.state.log_history if "loss" in log)


def test_packed_trainer_step_equals_unpacked(tmp_path, tiny_llama_dir, precision):
    """The real path: load_model turns the KV cache off, PackedCollator.for_model picks position ids."""
    unpacked = datasets.Dataset.from_list(samples())
    packed, _ = pack_dataset(unpacked, CUTOFF)
    grads_u, loss_u = trainer_step(tmp_path / "u", tiny_llama_dir, unpacked, lambda m: SupervisedCollator(0), precision)
    grads_p, loss_p = trainer_step(tmp_path / "p", tiny_llama_dir, packed, lambda m: PackedCollator.for_model(m, 0),
                                   precision)
    print(f"{precision} trainer step: loss {abs(loss_p - loss_u):.1e}, grads {max_diff(grads_u, grads_p):.1e}")
    loss_tolerance, grad_tolerance = STEP_TOLERANCE[precision]
    assert loss_p == pytest.approx(loss_u, abs=loss_tolerance)
    assert max_diff(grads_u, grads_p) < grad_tolerance


def test_side_by_side_layout():
    """Position ids restart per example and each example's first label is -100; varlen flattens the rows."""
    a = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
    b = {"input_ids": [8, 9], "labels": [8, 9]}
    c = {"input_ids": [4, 3, 2, 1, 11], "labels": [-100, -100, 2, 1, 11]}
    assert side_by_side([a, b]) == {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1]}
    batch = PaddingFreeCollator(PackedCollator(0))([a, b, c])  # rows of 5: [c] [a b]
    assert batch["input_ids"].tolist() == [[4, 3, 2, 1, 11], [5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, -100, 2, 1, 11], [-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    d = {"input_ids": [1], "labels": [1]}
    padded = PaddingFreeCollator(PackedCollator(0))([a, d])  # rows of 3: [a] [d + 2 padding]
    assert padded["input_ids"].tolist() == [[5, 6, 7], [1, 0, 0]]
    assert padded["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert padded["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    varlen = PaddingFreeCollator(PackedCollator(0, "varlen"))([a, b, c])
    assert varlen["input_ids"].tolist() == [[4, 3, 2, 1, 11, 5, 6, 7, 8, 9]]
    assert varlen["cu_seq_lens_q"].tolist() == [0, 5, 8, 10] and varlen["max_length_q"] == 5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_equals_padded(model_dir, attn):
    """The same examples side by side: logits, loss and gradients of the padded batch, on fewer positions."""
    model = load(model_dir, attn)
    loss_u, logits_u, grads_u = forward_backward(model, SupervisedCollator(0)(samples()))
    batch = PaddingFreeCollator(PackedCollator(0))(samples())
    # Lengths 5, 12, ..., 54 in rows of 54 (best-fit decreasing): [54] [47 5] [40 12] [33 19] [26]
    assert batch["input_ids"].shape == (5, 54)
    assert (batch["labels"][:, 1:] != -100).sum() == sum(sum(v != -100 for v in s["labels"][1:]) for s in samples())
    loss_f, logits_f, grads_f = forward_backward(model, batch, capacity=54)
    diffs = {"loss": abs(loss_f - loss_u), "logits": max_diff(logits_u, logits_f), "grads": max_diff(grads_u, grads_f)}
    print(f"{model_dir.name} {attn}: max |padding-free - padded| " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert len(logits_f) == len(samples())
    assert diffs["loss"] < 1e-5 and diffs["logits"] < 1e-5 and diffs["grads"] < 1e-5


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_padding_free_trainer_step_equals_padded(tmp_path, tiny_llama_dir, precision):
    """The real path: build_collator picks padding-free batches for transformers' own Llama with sdpa."""
    unpacked = datasets.Dataset.from_list(samples())
    picked = []

    def padding_free(model):
        picked.append(build_collator(model, 0, packing=False, padding_free=None))
        return picked[-1]

    grads_u, loss_u = trainer_step(tmp_path / "u", tiny_llama_dir, unpacked, lambda m: SupervisedCollator(0), precision)
    grads_f, loss_f = trainer_step(tmp_path / "f", tiny_llama_dir, unpacked, padding_free, precision)
    # load_model runs sdpa per sample (model/varlen_sdpa.py): one flattened row and its boundaries.
    assert picked[0] == PaddingFreeCollator(PackedCollator(0, "varlen", ones_mask=True))
    print(f"{precision} trainer step: loss {abs(loss_f - loss_u):.1e}, grads {max_diff(grads_u, grads_f):.1e}")
    loss_tolerance, grad_tolerance = STEP_TOLERANCE[precision]
    assert loss_f == pytest.approx(loss_u, abs=loss_tolerance)
    assert max_diff(grads_u, grads_f) < grad_tolerance


class RemoteCodeLlama(LlamaForCausalLM):
    """Stands for modelling code outside transformers (trust_remote_code), which may ignore packed position ids."""


def test_padding_free_default_only_where_samples_stay_isolated_natively(tiny_llama_dir, caplog):
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.use_cache = False
    native = LlamaForCausalLM(config)
    assert build_collator(native, 0, packing=False) == SupervisedCollator(0)  # padding_free: false
    assert build_collator(native, 0, packing=False, padding_free=None) == PaddingFreeCollator(PackedCollator(0))
    remote = RemoteCodeLlama(config)
    with caplog.at_level("INFO", logger="tunelab.data.collate"):
        assert build_collator(remote, 0, packing=False, padding_free=None) == SupervisedCollator(0)
    assert caplog.messages == [
        "padding-free batches off (RemoteCodeLlama is not transformers' own model code): examples are padded to "
        "the longest of each batch"
    ]
    # Asked for explicitly, it still isolates samples, with the explicit block mask.
    assert build_collator(remote, 0, packing=False, padding_free=True).packed.attention == "block_mask"
    # Positions that do not restart with position ids (learned absolute here; ALiBi elsewhere): padded.
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, use_cache=False))
    caplog.clear()
    with caplog.at_level("INFO", logger="tunelab.data.collate"):
        assert build_collator(gpt2, 0, packing=False, padding_free=None) == SupervisedCollator(0)
    assert caplog.messages == [
        "padding-free batches off (GPT2LMHeadModel has no rotary position embeddings): examples are padded to the "
        "longest of each batch"
    ]


@pytest.mark.slow
def test_sft_with_packing_learns_and_reports_efficiency(tmp_path):
    from tunelab.cli import main  # noqa: PLC0415
    from tunelab.run_folder import read_log  # noqa: PLC0415

    out = tmp_path / "out"
    config = {
        "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 128,
        "cutoff_len": 128, "packing": True, "finetuning_type": "full", "output_dir": str(out),
        "per_device_train_batch_size": 2, "max_steps": 12, "learning_rate": 3e-3, "logging_steps": 3, "seed": 0,
        "disable_tqdm": True,
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0]
    packing = json.loads((out / "data_report.json").read_text())["packing"]["train"]
    assert packing["samples"] == 128 and packing["rows"] < 128 and 0.5 < packing["efficiency"] <= 1.0
