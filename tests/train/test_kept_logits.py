"""Logits only where there is a label (train/losses.py): the same loss and gradients as the plain path.

The plain path is written out here on its own: the model's logits at every position, float32
cross-entropy (or log-softmax) over the shifted labels. The kept path is what training runs: the
model called with `logits_to_keep = next_token_mask(labels)` (a 2-D bool tensor, which transformers'
`slice_logits_to_keep` turns into (N, vocab) logits after the model's own logit processing) and the
chunked `token_log_probs`. Equal within 1e-5 (fp32) for Llama, Qwen2 (tied head) and Gemma-2 (final
logit soft-capping), on padded, padding-free and packed batches, for SFT losses and DPO log-probs.
"""

from __future__ import annotations

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
    for chunk in (1, 4, 13, 100):
        log_p, mean_log_p = losses.token_log_probs(logits, targets, chunk)
        total = -((1 - smoothing) * log_p + smoothing * mean_log_p).sum()
        (grad,) = torch.autograd.grad(total, logits)
        assert abs(total.item() - expected.item()) < 1e-4
        assert (grad - grad_expected).abs().max().item() < 1e-6


def test_chunked_gradient_keeps_the_logits_dtype():
    logits = torch.randn(5, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    log_p, _ = losses.token_log_probs(logits, torch.arange(5), chunk=2)
    assert log_p.dtype == torch.float32
    log_p.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


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


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dpo_log_probs_and_gradients_equal_the_plain_path(family, padding_free):
    model, b = tiny(family), pairs_batch(padding_free)
    weights = torch.linspace(-1.0, 1.0, 8)  # a different gradient for every sequence, as DPO's are

    def plain(m, batch_):
        return (plain_sequence_log_probs(m, batch_) * weights).sum()

    def kept(m, batch_):
        logps, counts = batch_log_probs(m, batch_, keep_logits=True)
        assert counts.tolist() == [len(s["input_ids"]) - s["labels"].count(-100) for s in samples()]
        return (logps * weights).sum()

    with torch.no_grad():
        expected = plain_sequence_log_probs(model, b)
        assert (batch_log_probs(model, b, keep_logits=True)[0] - expected).abs().max().item() < TOLERANCE
        every = model(**model_inputs(b)).logits
        assert (sequence_log_probs(every, b["labels"], b.get("sequence_ids"))[0] - expected).abs().max().item() < TOLERANCE
    value_plain, grads_plain = loss_and_grads(model, plain, b)
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


@pytest.mark.parametrize("layout", ["padding_free", "packed"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_one_row_batch_keeps_logits_by_a_host_built_index(family, layout):
    """A padding-free batch is one row (so is a packed batch of one row): `logits_to_keep` is a 1-D index of
    positions, the logits come back (1, N, vocab), and loss and gradients equal the plain path."""
    model = tiny(family)
    if layout == "packed":
        packed, _ = pack_dataset(datasets.Dataset.from_list(samples()), 128)
        b = PackedCollator(0)(packed.to_list()[:1])
    else:  # one example per micro-batch (the usual GPU set-up for long rows: batch 1 + gradient accumulation)
        b = PaddingFreeCollator(PackedCollator(0))(samples()[-1:])
    assert b["labels"].shape[0] == 1
    positions = losses.next_token_positions(b["labels"])
    assert positions.tolist() == losses.next_token_mask(b["labels"])[0].nonzero().flatten().tolist()

    def by_index(model, b):
        logits = model(**model_inputs(b), logits_to_keep=positions).logits
        assert logits.shape == (1, len(positions), VOCAB)
        return losses.causal_lm_loss(logits, b["labels"])

    loss_plain, grads_plain = loss_and_grads(model, plain_loss, b)
    loss_index, grads_index = loss_and_grads(model, by_index, b)
    assert abs(loss_index - loss_plain) < TOLERANCE
    assert max_diff(grads_plain, grads_index) < TOLERANCE


def test_targets_by_count_equal_targets_by_mask():
    labels = torch.tensor([[-100, 5, 6, -100, -100, 7, 8, 9, -100, 4]])
    assert losses.next_token_targets(labels, 6).tolist() == losses.next_token_targets(labels).tolist() == [5, 6, 7, 8, 9, 4]
    with pytest.raises(ValueError, match="^a 1-D index of kept positions serves one row, not 2$"):
        losses.next_token_positions(torch.zeros(2, 3, dtype=torch.long))


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


def test_a_padding_free_training_step_selects_by_no_data_dependent_shape(tmp_path):
    """One example per micro-batch: the trainer builds the index on the host before the batch moves, and the
    forward and loss do not wait for the device to count positions (a batch of several rows selects by bool mask: one count each for the logits
    and the targets)."""

    def step_ops(collator, batch_size):
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

        trainer = Counted(model=model, args=args, train_dataset=datasets.Dataset.from_list(samples()), data_collator=collator)
        trainer.train()
        return counter.count, rows_seen

    per_example = {sum(label != -100 for label in row["labels"][1:]) for row in samples()}
    count, rows_seen = step_ops(PaddingFreeCollator(PackedCollator(0)), 1)
    assert count == 0 and len(rows_seen) == 1 and rows_seen[0][0] == 1 and rows_seen[0][1] in per_example
    supervised = int((batch("padded")["labels"][:, 1:] != -100).sum())
    assert step_ops(SupervisedCollator(0), 8) == (2, [(supervised,)])
