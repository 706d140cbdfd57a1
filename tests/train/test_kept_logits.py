"""Logits only where there is a label (train/losses.py): the same loss and gradients as the plain path.

The plain path is written out here on its own: the model's logits at every position, float32
cross-entropy (or log-softmax) over the shifted labels. The kept path is what training runs: the
model called with `logits_to_keep = next_token_mask(labels)` (a 2-D bool tensor, which transformers'
`slice_logits_to_keep` turns into (N, vocab) logits after the model's own logit processing) and the
chunked `token_log_probs`. Equal within 1e-5 (fp32) for Llama, Qwen2 (tied head) and Gemma-2 (final
logit soft-capping), on padded, padding-free and packed batches, for SFT losses and DPO log-probs.
"""

from __future__ import annotations

from types import MethodType

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tunelab.data.collate import PackedCollator, PaddingFreeCollator, PairedCollator, SupervisedCollator
from tunelab.data.packing import pack_dataset
from tunelab.train import losses
from tunelab.train.preference_losses import sequence_log_probs
from tunelab.train.preference_trainer import batch_log_probs
from tunelab.train.trainer import TunelabTrainer, takes_logits_to_keep

VOCAB = 256
TOLERANCE = 1e-5
SMALL_CAP = 0.25  # Gemma-2's soft-capping made tight, so logits without it would differ by far more than TOLERANCE


def tiny(family: str):
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    else:
        model = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=16, final_logit_softcapping=SMALL_CAP))
    model.config._attn_implementation = "eager"
    return model.float().train()


def samples() -> list[dict]:
    """Eight examples of 9..58 tokens whose prompts (label -100) are most of each example."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        length = 9 + 7 * i
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        prompt = length - 2 - i % 4  # answers of 2..5 tokens
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def batch(layout: str) -> dict:
    if layout == "padded":
        return SupervisedCollator(0)(samples())
    if layout == "padding_free":
        return PaddingFreeCollator(PackedCollator(0))(samples())
    packed, _ = pack_dataset(datasets.Dataset.from_list(samples()), 128)
    return PackedCollator(0)(packed.to_list())


def model_inputs(b: dict) -> dict:
    return {k: v for k, v in b.items() if k not in ("labels", "sequence_ids")}


def plain_loss(model, b: dict) -> torch.Tensor:
    logits = model(**model_inputs(b)).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100)


def kept_loss(model, b: dict, smoothing: float = 0.0) -> torch.Tensor:
    mask = losses.next_token_mask(b["labels"])
    logits = model(**model_inputs(b), logits_to_keep=mask).logits
    assert logits.shape == (int(mask.sum()), VOCAB)  # only the positions that predict a label
    return losses.causal_lm_loss(logits, b["labels"], label_smoothing=smoothing)


def loss_and_grads(model, loss_fn, b: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = loss_fn(model, b)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("layout", ["padded", "padding_free", "packed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_kept_logits_loss_and_gradients_equal_the_plain_path(family, layout):
    model, b = tiny(family), batch(layout)
    loss_plain, grads_plain = loss_and_grads(model, plain_loss, b)
    loss_kept, grads_kept = loss_and_grads(model, kept_loss, b)
    print(f"{family} {layout}: |loss| diff {abs(loss_kept - loss_plain):.1e}, grads {max_diff(grads_plain, grads_kept):.1e}")
    assert abs(loss_kept - loss_plain) < TOLERANCE
    assert max_diff(grads_plain, grads_kept) < TOLERANCE
    assert max(g.abs().max().item() for g in grads_plain.values()) > 1e-3  # the comparison is not of zeros


def test_gemma2_kept_logits_are_soft_capped_by_the_model():
    """transformers applies final_logit_softcapping after slicing: kept logits are the capped ones."""
    model, b = tiny("gemma2"), batch("padding_free")
    mask = losses.next_token_mask(b["labels"])
    with torch.no_grad():
        every = model(**model_inputs(b)).logits
        kept = model(**model_inputs(b), logits_to_keep=mask).logits
    assert (kept - every[mask]).abs().max().item() < 1e-6
    assert kept.abs().max().item() < SMALL_CAP
    hidden = model.model(**model_inputs(b)).last_hidden_state[mask]
    assert (model.lm_head(hidden) - kept).abs().max().item() > 0.1  # uncapped logits would differ


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_chunked_cross_entropy_equals_torch_in_every_chunking(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(13, VOCAB, generator=g)).requires_grad_()
    targets = torch.randint(0, VOCAB, (13,), generator=g)
    expected = F.cross_entropy(logits, targets, reduction="sum", label_smoothing=smoothing)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    unchanged = logits.detach().clone()
    for chunk in (1, 4, 13, 100):
        log_p, mean_log_p = losses.token_log_probs(logits, targets, chunk, with_mean=bool(smoothing))
        total = -((1 - smoothing) * log_p + smoothing * mean_log_p).sum()
        (grad,) = torch.autograd.grad(total, logits)
        assert abs(total.item() - expected.item()) < 1e-4
        assert (grad - grad_expected).abs().max().item() < 1e-6
        assert torch.equal(logits, unchanged)  # the in-place softmax works on a copy, never on float32 logits


@pytest.mark.parametrize("with_mean", [False, True])
def test_chunked_gradient_keeps_the_logits_dtype(with_mean):
    logits = torch.randn(5, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    log_p, mean = losses.token_log_probs(logits, torch.arange(5), chunk=2, with_mean=with_mean)
    assert log_p.dtype == torch.float32
    (log_p.sum() + 0.5 * mean.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = logits.detach().float().requires_grad_()
    expected = torch.log_softmax(reference, -1)
    (expected[torch.arange(5), torch.arange(5)].sum() + (0.5 * expected.mean(-1).sum() if with_mean else 0)).backward()
    assert (logits.grad.float() - reference.grad).abs().max() < 1e-2  # bf16 rounding of the float32 gradient


def test_smoothed_loss_on_kept_logits_equals_torch_on_every_position():
    model, b = tiny("qwen2"), batch("padded")
    with torch.no_grad():
        logits = model(**model_inputs(b)).logits
        expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100, label_smoothing=0.2)
        assert abs(kept_loss(model, b, smoothing=0.2).item() - expected.item()) < TOLERANCE


def pairs_batch(padding_free: bool) -> dict:
    rows = [{"chosen_input_ids": a["input_ids"], "chosen_labels": a["labels"],
             "rejected_input_ids": r["input_ids"], "rejected_labels": r["labels"]}
            for a, r in zip(samples()[:4], samples()[4:])]
    return PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0)) if padding_free else None)(rows)


def plain_sequence_log_probs(model, b: dict) -> torch.Tensor:
    """Summed log-probs per sequence from the log-softmax of every position."""
    logits = model(**model_inputs(b)).logits[:, :-1].float()
    labels = b["labels"][:, 1:]
    mask = labels != -100
    token = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    owners = b["sequence_ids"][:, 1:] if "sequence_ids" in b else torch.arange(len(labels))[:, None].expand_as(labels)
    return torch.zeros(8).index_add(0, owners[mask], token[mask])


@pytest.mark.parametrize("keep", ["mask", "index"])
@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dpo_log_probs_and_gradients_equal_the_plain_path(family, padding_free, keep):
    """Kept by the labels' mask, or by a (rows, W) index built on the host (with, padding-free, the sequence count)
    whose logits come back (rows, W, vocab): the plain path's log-probs, token counts and gradients."""
    model, b = tiny(family), pairs_batch(padding_free)
    plain_batch = b
    if keep == "index":
        index = losses.next_token_index(b["labels"], max_waste=10.0)
        b = {**b, "logits_to_keep": index, **({"sequence_count": 8} if padding_free else {})}
        shapes = []
        model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    weights = torch.linspace(-1.0, 1.0, 8)  # a different gradient for every sequence, as DPO's are

    def plain(m, batch_):
        return (plain_sequence_log_probs(m, batch_) * weights).sum()

    def kept(m, batch_):
        logps, counts = batch_log_probs(m, batch_, keep_logits=True)
        assert counts.tolist() == [len(s["input_ids"]) - s["labels"].count(-100) for s in samples()]
        return (logps * weights).sum()

    with torch.no_grad():
        expected = plain_sequence_log_probs(model, plain_batch)
        assert (batch_log_probs(model, b, keep_logits=True)[0] - expected).abs().max().item() < TOLERANCE
        if keep == "index":
            assert shapes[-1] == (b["labels"].shape[0], index.shape[1], VOCAB)
        every = model(**model_inputs(plain_batch)).logits
        assert (sequence_log_probs(every, b["labels"], b.get("sequence_ids"))[0] - expected).abs().max().item() < TOLERANCE
    value_plain, grads_plain = loss_and_grads(model, plain, plain_batch)
    value_kept, grads_kept = loss_and_grads(model, kept, b)
    assert abs(value_plain - value_kept) < TOLERANCE
    assert max_diff(grads_plain, grads_kept) < TOLERANCE


def test_the_trainer_computes_the_output_layer_at_supervised_positions_only(tmp_path):
    """One training step: the head sees one row per supervised next token, and the step equals the plain loss."""
    model, b = tiny("llama"), batch("padded")
    assert takes_logits_to_keep(model)
    expected_loss, _ = loss_and_grads(model, plain_loss, b)
    rows_seen = []
    model.lm_head.register_forward_hook(lambda module, args, output: rows_seen.append(args[0].shape[:-1]))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, learning_rate=0.0, report_to="none",
        save_strategy="no", remove_unused_columns=False, use_cpu=True, disable_tqdm=True, logging_steps=1,
    )
    trainer = TunelabTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(samples()),
                             data_collator=SupervisedCollator(0))
    trainer.train()
    supervised = int((b["labels"][:, 1:] != -100).sum())
    assert rows_seen == [torch.Size([supervised])]
    logged = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    assert abs(logged - expected_loss) < 1e-4  # the Trainer logs a rounded float


def test_kept_logits_of_the_wrong_number_of_rows_are_refused() -> None:
    labels = torch.tensor([[-100, 5, 6, -100]])  # two positions predict a label
    with pytest.raises(ValueError, match="^3 rows of logits for 2 supervised positions$"):
        losses.causal_lm_loss(torch.zeros(3, 11), labels)


@pytest.mark.parametrize("layout", ["padding_free", "packed", "padded"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_batch_keeps_logits_by_a_host_built_index(family, layout):
    """`logits_to_keep` as a (batch, W) index of positions built on the host: each row's kept positions, then
    positions with -100 targets up to the widest row; the logits come back (batch, W, vocab), and loss and
    gradients equal the plain path (padding-free: one row, W = N; packed and padded: several rows, filled)."""
    model = tiny(family)
    b = batch(layout)
    index = losses.next_token_index(b["labels"], max_waste=10.0)
    mask = losses.next_token_mask(b["labels"])
    counts = mask.sum(dim=1)
    assert index.shape == (b["labels"].shape[0], int(counts.max()))
    for row, count in enumerate(counts.tolist()):  # a row's own positions first, in order
        assert index[row, :count].tolist() == mask[row].nonzero().flatten().tolist()
        assert not mask[row, index[row, count:]].any()  # then filling positions that predict nothing
    if layout != "padding_free":
        assert b["labels"].shape[0] > 1 and len(set(counts.tolist())) > 1  # rows of unequal counts were filled

    def by_index(model, b):
        logits = model(**model_inputs(b), logits_to_keep=index).logits
        assert logits.shape == (*index.shape, VOCAB)
        return losses.causal_lm_loss(logits, b["labels"])

    loss_plain, grads_plain = loss_and_grads(model, plain_loss, b)
    loss_index, grads_index = loss_and_grads(model, by_index, b)
    assert abs(loss_index - loss_plain) < TOLERANCE
    assert max_diff(grads_plain, grads_index) < TOLERANCE


def test_the_index_is_refused_where_filling_wastes_head_rows():
    labels = torch.tensor([[-100, 5, 6, 7, 8, 9, 1], [-100, -100, -100, -100, -100, 2, -100]])  # 6 and 1 kept
    assert losses.next_token_index(labels) is None  # 2 rows x 6 = 12 head rows for 7 kept: 71% more
    assert losses.next_token_index(labels, max_waste=1.0).tolist() == [[0, 1, 2, 3, 4, 5], [4, 0, 1, 2, 3, 5]]
    assert losses.next_token_index(torch.full((2, 4), -100)) is None  # nothing kept: the mask path (no logits)
    even = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8]])
    assert losses.next_token_index(even).tolist() == [[0, 1], [1, 2]]


def test_targets_by_width_equal_targets_by_mask():
    labels = torch.tensor([[-100, 5, 6, -100, -100, 7, 8, 9, -100, 4], [-100, -100, 3, -100, -100, -100, -100, -100, 2, -100]])
    assert losses.next_token_targets(labels, 6).tolist() == [[5, 6, 7, 8, 9, 4], [3, 2, -100, -100, -100, -100]]
    by_width = losses.next_token_targets(labels, 6).flatten()
    assert by_width[by_width != -100].tolist() == losses.next_token_targets(labels).tolist() == [5, 6, 7, 8, 9, 4, 3, 2]


def test_filling_rows_count_for_nothing():
    logits = torch.randn(4, 11, requires_grad=True)
    log_p, mean = losses.token_log_probs(logits, torch.tensor([3, -100, 7, -100]), with_mean=True)
    assert log_p[1] == log_p[3] == mean[1] == mean[3] == 0
    assert torch.allclose(log_p[[0, 2]], torch.log_softmax(logits, -1)[[0, 2], [3, 7]])
    (log_p.sum() + mean.sum()).backward()
    assert logits.grad[[1, 3]].abs().max() == 0 and logits.grad[[0, 2]].abs().max() > 0
    # (1, 4, vocab) kept logits of a 5-token row: targets 3 and 7 in the first two rows, then two filling rows;
    # the mean is over the counted targets only
    loss = losses.causal_lm_loss(logits[None], torch.tensor([[-100, 3, -100, 7, -100]]))
    log_softmax = torch.log_softmax(logits, -1)
    assert torch.allclose(loss, -(log_softmax[0, 3] + log_softmax[1, 7]) / 2)


class CountOps(TorchDispatchMode):
    """Counts the ops whose output size depends on tensor values: on a GPU each makes the host wait."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default):
            self.count += 1
        elif func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.count += 1  # selecting by a bool mask (it counts the True entries first)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_training_step_selects_by_no_data_dependent_shape(tmp_path):
    """The trainer builds the index on the host before the batch moves, and the forward and loss do not wait for
    the device to count positions: one example per micro-batch (padding-free) and packed rows. Padded rows of
    unequal answers would be filled by far more than MAX_INDEX_WASTE: they select by bool mask (one count each
    for the logits and the targets)."""

    def step_ops(collator, batch_size, data=None):
        model = tiny("llama")
        rows_seen = []
        model.lm_head.register_forward_hook(lambda module, args, output: rows_seen.append(tuple(args[0].shape[:-1])))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=batch_size, max_steps=1, report_to="none",
            save_strategy="no", remove_unused_columns=False, use_cpu=True, disable_tqdm=True, logging_steps=5,
        )
        counter = CountOps()

        class Counted(TunelabTrainer):  # the forward and loss, on the batch as the device has it
            def compute_loss(self, *a, **k):
                with counter:
                    return super().compute_loss(*a, **k)

        data = data if data is not None else datasets.Dataset.from_list(samples())
        trainer = Counted(model=model, args=args, train_dataset=data, data_collator=collator)
        trainer.train()
        return counter.count, rows_seen

    per_example = {sum(label != -100 for label in row["labels"][1:]) for row in samples()}
    count, rows_seen = step_ops(PaddingFreeCollator(PackedCollator(0)), 1)
    assert count == 0 and len(rows_seen) == 1 and rows_seen[0][0] == 1 and rows_seen[0][1] in per_example
    assert losses.next_token_index(batch("padded")["labels"]) is None
    supervised = int((batch("padded")["labels"][:, 1:] != -100).sum())
    assert step_ops(SupervisedCollator(0), 8) == (2, [(supervised,)])
    uniform = [{"input_ids": list(range(3, 3 + n)), "labels": [-100] * (n - 4) + list(range(n - 1, n + 3))}
               for n in (12, 9, 20, 15)]  # padded rows of four-token answers: no filling at all
    count, rows_seen = step_ops(SupervisedCollator(0), 4, datasets.Dataset.from_list(uniform))
    assert count == 0 and rows_seen == [(4, 4)]


def liger_style_forward(self, input_ids=None, logits_to_keep=0, **kwargs):
    """Stands for Liger's fused forward: defined outside transformers, slices with `[:, logits_to_keep, :]`."""
    return LlamaForCausalLM.forward(self, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)


def test_a_forward_replaced_on_the_instance_keeps_every_position():
    """Liger's use_liger_kernel sets `model.forward` on the instance (found on a lent GPU: its forward indexed the
    hidden states with our 2-D mask and raised IndexError). Such a model gets no logits_to_keep, PEFT-wrapped too."""
    import peft  # noqa: PLC0415

    model = tiny("llama")
    assert takes_logits_to_keep(model)
    model.forward = MethodType(liger_style_forward, model)
    assert not takes_logits_to_keep(model)
    wrapped = peft.get_peft_model(tiny("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert takes_logits_to_keep(wrapped)
    wrapped.get_base_model().forward = MethodType(liger_style_forward, wrapped.get_base_model())
    assert not takes_logits_to_keep(wrapped)


def test_accelerates_mixed_precision_wrapper_still_keeps_logits():
    """Under bf16, accelerate's prepare_model wraps a full model's forward on the instance: autocast, then float32
    outputs (its native-amp branch, rebuilt here from the same public pieces because the suite's AcceleratorState is
    already fp32). Those wrappers name what they wrap, so the model keeps its logits_to_keep; a check that read the
    instance's forward only would drop it for every bf16 full fine-tune."""
    from accelerate.utils import convert_outputs_to_fp32  # noqa: PLC0415

    def mixed_precision(model):
        model.forward = MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
        return model

    model = mixed_precision(tiny("llama"))
    assert model.forward.__func__.__module__ == "accelerate.utils.operations"  # the wrapper is there
    assert takes_logits_to_keep(model)
    model = tiny("llama")
    model.forward = MethodType(liger_style_forward, model)
    assert not takes_logits_to_keep(mixed_precision(model))  # Liger's forward under the same wrappers


def test_a_dpo_step_on_a_host_batch_selects_by_no_data_dependent_shape(tmp_path):
    """PreferenceTrainer builds the index and the sequence count on the host (as TunelabTrainer does for SFT), so
    the DPO loss — policy and reference forwards, log-probs, per-sequence sums — makes no GPU count anything; the
    loss and gradients equal the device-side path (keep by mask, count the sequences from sequence_ids)."""
    import copy  # noqa: PLC0415

    from tunelab.config.args import FinetuningArguments  # noqa: PLC0415
    from tunelab.config.training_args import TrainingArguments  # noqa: PLC0415
    from tunelab.train.preference_trainer import PreferenceTrainer  # noqa: PLC0415

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, remove_unused_columns=False)
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(4):  # chosen: 10 tokens, 4 answered; rejected: 5 tokens, 2 answered (two share a row of 10)
        chosen, rejected = torch.randint(3, VOCAB, (10,), generator=g).tolist(), torch.randint(3, VOCAB, (5,), generator=g).tolist()
        rows.append({"chosen_input_ids": chosen, "chosen_labels": [-100] * 6 + chosen[6:],
                     "rejected_input_ids": rejected, "rejected_labels": [-100] * 3 + rejected[3:]})
    host = PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0)))(rows)
    assert host["labels"].shape == (6, 10) and (host["sequence_ids"] == -1).sum() == 0  # equal counts: no filling

    def step(prepare: bool):
        policy = tiny("llama")
        trainer = PreferenceTrainer(stage="dpo", finetuning=FinetuningArguments(stage="dpo"), model=policy, args=args,
                                    ref_model=copy.deepcopy(policy).eval(), data_collator=None)
        batch = trainer._with_kept_logits(policy, host) if prepare else host
        counter = CountOps()
        with counter:
            loss = trainer.compute_loss(policy, batch)
        loss.backward()
        return batch, counter.count, loss.item(), {n: p.grad.clone() for n, p in policy.named_parameters()}

    batch, count, loss, grads = step(prepare=True)
    assert batch["logits_to_keep"].dtype == torch.long and batch["logits_to_keep"].shape[0] == host["labels"].shape[0]
    assert batch["sequence_count"] == 8
    assert count == 0
    _, count_device, loss_device, grads_device = step(prepare=False)
    assert count_device > 0  # the mask path: the model's slice and the owners each count on the device
    assert abs(loss - loss_device) < TOLERANCE
    assert max_diff(grads, grads_device) < TOLERANCE


def test_a_gpu_takes_more_filling_rows_than_a_cpu_before_it_counts_on_the_device():
    """Padding-free pair rows of unequal answer counts (the DPO bench's fill 0.5-1.6): a CPU keeps them by mask (the
    filling would be arithmetic), a GPU by index (a count read back would stall its queue)."""
    labels = torch.tensor([[-100] + [7] * 9, [-100] * 6 + [7] * 4])  # 9 and 4 kept positions: W = 9, 18 rows for 13
    assert losses.max_index_waste(torch.device("cpu")) == losses.MAX_INDEX_WASTE == 0.25
    assert losses.next_token_index(labels, losses.max_index_waste(torch.device("cpu"))) is None
    index = losses.next_token_index(labels, losses.max_index_waste(torch.device("cuda")))
    assert index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 0, 1, 2, 3, 4]]
