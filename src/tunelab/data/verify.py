"""`tunelab data verify`: batches drawn through the stage's own collator, each checked by `verify_batch`, a pure
function of one batch that returns the first problem as one line (or None); then the rows re-encoded and checked
against their inference prompts (`verify_encoding`), and images against their placeholders; on the run's data
(data/run_data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import datasets
import numpy as np
import torch

from tunelab.config.args import DataArguments
from tunelab.config.stages import stage_row
from tunelab.data.collate import (
    PackedCollator,
    PaddingFreeCollator,
    PairedCollator,
    block_causal_mask,
    padding_free_layout,
)
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder, encoded_row_problem
from tunelab.data.pairwise import with_answer
from tunelab.data.pipeline import load_canonical_splits
from tunelab.data.run_data import RunData, batch_order
from tunelab.data.templates import get_template
from tunelab.data.vision import expansions, image_token_ids, prepare_images


def verify_images(data: RunData, max_rows: int) -> tuple[str | None, list[str]]:
    """Every placeholder got its image: in each sample, the image tokens are exactly those of its images' expansions
    (asked of the processor again, independently of encoding), and none of them is supervised."""

    processor, settings = data.vision
    mm = image_token_ids(processor)
    checked = images = 0
    for name, samples in data.splits.items():
        for index in range(min(len(samples), max_rows)):
            sample = samples[index]
            texts = expansions(processor, prepare_images(sample["images"], settings))
            wanted = sum(sum(i in mm for i in ids) for ids in
                         (data.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []))
            have = sum(i in mm for i in sample["input_ids"])
            if have != wanted:
                return (f"{name} sample {index}: {have} image tokens for its {len(sample['images'])} images, whose "
                        f"expansions hold {wanted}: a placeholder without its image (or the reverse)"), []
            if any(label != -100 for token, label in zip(sample["input_ids"], sample["labels"]) if token in mm):
                return f"{name} sample {index}: an image token is supervised", []
            checked, images = checked + 1, images + len(sample["images"])
    return None, [f"images: {images} images in {checked} samples: each placeholder holds exactly its image's tokens "
                  "(the processor's expansion), none supervised"]


def verify_batch(
    batch: dict[str, Any],
    *,
    pad_token_id: int,
    sample_lengths: Sequence[Sequence[int]] | None = None,
    vocab_size: int | None = None,
    batch_index: int = 0,
    sequence_lengths: Sequence[int] | None = None,
) -> str | None:
    """The first problem of one collated batch, as one line, or None.

    sample_lengths: per batch row, the lengths of the samples it holds in order (one per row unless
    packed; a flattened varlen batch is one row). Without it, lengths are read from the
    attention_mask (padded batches) or from restarts of position_ids (packed: then padding counts
    as a sample). Packed batches are recognised by their position_ids. sequence_lengths: for padding-free
    pair batches, the length of sequence j (sequence_ids must name each sample's sequence, -1 on padding).
    """
    where = f"batch {batch_index}"
    for key in ("input_ids", "labels"):
        if key not in batch:
            return f"{where}: no {key} in the batch (keys: {', '.join(batch)})"
    ids, labels = batch["input_ids"], batch["labels"]
    packed = "position_ids" in batch
    mask = batch.get("attention_mask")
    if ids.dim() != 2:
        return f"{where}: input_ids has shape {tuple(ids.shape)}; expected (batch, length)"
    if not packed and mask is None:
        return f"{where}: no attention_mask in a padded batch"
    # sdpa_varlen's flattened row carries an all-ones 2-D mask beside its boundaries (data/collate.py).
    varlen_ones = "cu_seq_lens_q" in batch and mask is not None and mask.dim() == 2 and bool((mask == 1).all())
    if packed and mask is not None and mask.dim() == 2 and not varlen_ones:
        return f"{where}: a 2-D attention_mask beside packed position_ids lets samples attend to each other; leave it out"
    two_d = ["labels", "position_ids"] if packed else ["labels", "attention_mask"]
    if "sequence_ids" in batch:
        two_d.append("sequence_ids")
    for key in ["input_ids", *two_d]:
        if batch[key].shape != ids.shape:
            return f"{where}: {key} has shape {tuple(batch[key].shape)}, input_ids {tuple(ids.shape)}; they must match"
        if batch[key].dtype != torch.long:
            return f"{where}: {key} has dtype {batch[key].dtype}, expected torch.int64"
    rows, length = ids.shape
    if sample_lengths is not None and len(sample_lengths) != rows:
        return f"{where}: {len(sample_lengths)} rows of sample lengths for {rows} batch rows"

    for row in range(rows):
        given = list(sample_lengths[row]) if sample_lengths is not None else None
        problem = _verify_row(batch, row, given, pad_token_id, vocab_size, packed)
        if problem:
            return f"{where}, sample {row}{problem}"

    if "sequence_ids" in batch:
        problem = _verify_sequence_ids(batch["sequence_ids"], sample_lengths, sequence_lengths)
        if problem:
            return f"{where}{problem}"
    if packed and mask is not None and not varlen_ones:  # block_mask path: the 4-D mask must be the block-causal one
        if mask.dim() != 4 or tuple(mask.shape) != (rows, 1, length, length) or not mask.is_floating_point():
            return (f"{where}: attention_mask beside position_ids must be a float (batch, 1, L, L) block mask, "
                    f"got {tuple(mask.shape)} {mask.dtype}")
        expected = block_causal_mask(batch["position_ids"], mask.dtype)
        for row in range(rows):
            if not torch.equal(mask[row], expected[row]):
                return f"{where}, sample {row}: the 4-D attention_mask is not the block-causal mask of its position_ids"
    if "cu_seq_lens_q" in batch:  # varlen path: one flattened row, sample boundaries passed explicitly
        if rows != 1:
            return f"{where}: cu_seq_lens_q needs one flattened row, the batch has {rows}"
        if sample_lengths is not None:
            starts = np.cumsum([0, *sample_lengths[0]])
        else:
            starts = np.append(torch.nonzero(batch["position_ids"][0] == 0).flatten().numpy(), length)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            got = batch.get(key)
            if got is None or got.tolist() != starts.tolist():
                shown = None if got is None else got.tolist()
                return f"{where}: {key} is {shown}, expected the sample boundaries {starts.tolist()}"
        longest = int(np.diff(starts).max())
        for key in ("max_length_q", "max_length_k"):
            if batch.get(key) != longest:
                return f"{where}: {key} is {batch.get(key)}, expected the longest sample, {longest}"
    return None


def _verify_sequence_ids(
    owners: torch.Tensor, sample_lengths: Sequence[Sequence[int]] | None, sequence_lengths: Sequence[int] | None
) -> str | None:
    """sequence_ids of a padding-free pair batch: one id per sample, each sequence exactly once and as long as
    it is, -1 on padding; as ', sample r: ...' (or ': ...'), or None."""
    if sample_lengths is None or sequence_lengths is None:
        return ": sequence_ids cannot be checked without the batch's sample and sequence lengths"
    seen: list[int] = []
    for row, given in enumerate(sample_lengths):
        values = owners[row].tolist()
        start = 0
        for n in given:
            ids = set(values[start : start + n])
            if len(ids) != 1:
                return f", sample {row}, position {start}: sequence_ids {sorted(ids)} within one sequence, expected one id"
            (owner,) = ids
            if not 0 <= owner < len(sequence_lengths) or sequence_lengths[owner] != n:
                expected = sequence_lengths[owner] if 0 <= owner < len(sequence_lengths) else "no sequence"
                return f", sample {row}, position {start}: sequence_ids {owner} on {n} tokens, but that sequence has {expected}"
            seen.append(owner)
            start += n
        if any(v != -1 for v in values[start:]):
            return f", sample {row}, position {start}: sequence_ids on padding must be -1, got {values[start:]}"
    if sorted(seen) != list(range(len(sequence_lengths))):
        return f": sequence_ids cover {sorted(seen)}, expected each of 0..{len(sequence_lengths) - 1} once"
    return None


def _verify_row(
    batch: dict[str, Any], row: int, given: list[int] | None, pad_token_id: int, vocab_size: int | None, packed: bool
) -> str | None:
    """Problems of one batch row, as ', position t: ...' (or ': ...'), or None."""
    ids = batch["input_ids"][row].tolist()
    labels = batch["labels"][row].tolist()
    length = len(ids)
    if packed:
        positions = batch["position_ids"][row].tolist()
        if given is None:  # every restart is a sample start (padding is a sample of its own)
            given = restart_lengths(positions)
    else:
        mask = batch["attention_mask"][row].tolist()
        if given is None:
            given = [int(sum(mask))]
    real = sum(given)
    if real > length:
        return f": its samples hold {real} tokens but the batch is {length} long"

    if packed:
        expected = [k for n in given for k in range(n)] + list(range(length - real))
        starts = set(np.cumsum([0, *given[:-1]]).tolist()) if given else set()
        sample_of = np.repeat(np.arange(len(given)), given).tolist()
        for t, (got, want) in enumerate(zip(positions, expected)):
            if got == want:
                continue
            if t >= real:
                return f", position {t}: position_id {got} on padding, expected {want} (padding is a sample of its own)"
            if want == 0:
                return (f", position {t}: position_id {got} at the start of packed sample {sample_of[t]}, expected 0 "
                        "(position ids restart at every sample start)")
            return f", position {t}: position_id {got} inside packed sample {sample_of[t]}, expected {want}"
        for t in sorted(starts):
            if t < real and labels[t] != IGNORE_INDEX:
                return (f", position {t}: label {labels[t]} at the start of packed sample {sample_of[t]}, expected -100 "
                        "(the sample before must not predict it)")
    else:
        for t, value in enumerate(mask):
            if t < real and value != 1:
                return f", position {t}: attention_mask is {value} on a real token, expected 1"
            if t >= real and value != 0:
                return f", position {t}: attention_mask is {value} on padding, expected 0"
    for t in range(real, length):
        if ids[t] != pad_token_id:
            return f", position {t}: input_id {ids[t]} on padding, expected the pad id {pad_token_id}"
        if labels[t] != IGNORE_INDEX:
            return f", position {t}: label {labels[t]} on padding, expected -100"
    for t in range(real):
        if ids[t] < 0 or (vocab_size is not None and ids[t] >= vocab_size):
            return f", position {t}: input_id {ids[t]} is outside the model's vocabulary (vocab_size {vocab_size})"
    for t in range(1, length):  # position 0 never reaches the loss: nothing precedes it
        if labels[t] != IGNORE_INDEX and labels[t] != ids[t]:
            hint = ""
            if t + 1 < length and labels[t] == ids[t + 1]:
                hint = "; it equals the next input_id: were the labels shifted already?"
            return (f", position {t}: label {labels[t]} != input_id {ids[t]}; labels must equal input_ids where "
                    f"supervised (the loss shifts them){hint}")
    return None


@dataclass
class VerifyCounts:
    batches: int = 0
    rows: int = 0
    samples: int = 0
    tokens: int = 0
    padding: int = 0
    supervised: int = 0
    batch_rows: int = 0
    shape: tuple[int, ...] | None = None
    keys: tuple[str, ...] = ()


def restart_lengths(position_ids: Sequence[int]) -> list[int]:
    """Lengths of the samples of a packed row: each starts where its position ids restart at 0."""
    starts = [t for t, p in enumerate(position_ids) if p == 0] or [0]
    return [b - a for a, b in zip(starts, [*starts[1:], len(position_ids)])]


def verify_split(
    name: str,
    dataset: datasets.Dataset,
    collator,
    batch_size: int,
    order: np.ndarray,
    *,
    pad_token_id: int,
    vocab_size: int | None,
    max_batches: int,
    lengths_per_row: list[list[int]] | None = None,
) -> tuple[str | None, VerifyCounts]:
    """Collate batches of `dataset` in `order` and verify each; the first problem (prefixed by name) stops."""
    counts = VerifyCounts()
    columns = list(dataset.column_names)
    flattened = getattr(collator, "attention", None) == "varlen"
    for number, start in enumerate(range(0, len(order), batch_size)):
        if max_batches and number >= max_batches:
            break
        index = [int(i) for i in order[start : start + batch_size]]
        block = dataset[index]
        rows = [dict(zip(columns, values)) for values in zip(*(block[c] for c in columns))]
        batch = collator(rows)
        sequence_lengths = None  # pairs: the length of each sequence, by its index in the batch
        if isinstance(collator, PairedCollator):
            sequence_lengths = [len(r[f"{side}input_ids"]) for side in collator.sides for r in rows]
            if collator.padding_free is not None:
                lengths = [[sequence_lengths[i] for i in row] for row in padding_free_layout(sequence_lengths)]
            else:
                lengths = [[n] for n in sequence_lengths]
        elif lengths_per_row is not None:
            lengths = [lengths_per_row[i] for i in index]
        elif isinstance(collator, PaddingFreeCollator):
            layout = padding_free_layout([len(r["input_ids"]) for r in rows])
            lengths = [[len(rows[i]["input_ids"]) for i in row] for row in layout]
        elif isinstance(collator, PackedCollator):  # rows packed upstream (pt): samples end where positions restart
            lengths = [restart_lengths(r["position_ids"]) for r in rows]
        else:
            lengths = [[len(r["input_ids"])] for r in rows]
        if flattened:
            lengths = [[n for row in lengths for n in row]]
        problem = verify_batch(
            batch, pad_token_id=pad_token_id, sample_lengths=lengths, vocab_size=vocab_size, batch_index=number,
            sequence_lengths=sequence_lengths,
        )
        if problem:
            return f"{name}: {problem}", counts
        real = sum(n for row in lengths for n in row)
        counts.batches += 1
        counts.rows += len(rows)
        counts.batch_rows += batch["input_ids"].shape[0]
        counts.samples += sum(len(row) for row in lengths)
        counts.tokens += real
        counts.padding += batch["input_ids"].numel() - real
        counts.supervised += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        counts.shape = tuple(batch["input_ids"].shape) if counts.shape is None else counts.shape
        counts.keys = tuple(k for k in batch if torch.is_tensor(batch[k]))
    return None, counts


def verify_report(data: RunData, max_batches: int) -> tuple[str | None, list[str]]:
    """(first problem or None, summary lines) of `tunelab data verify`."""
    config, tokenizer, collator, vocab_size = data.config, data.tokenizer, data.collator, data.vocab_size
    args = config.training
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    attention = getattr(collator, "attention", None)  # None: padded with an attention mask
    layout = "packed" if isinstance(collator, PackedCollator) else "padding-free"
    kind = type(collator).__name__ + (f" ({attention})" if attention else "")
    lines = []
    for name, samples in data.splits.items():
        batch_size = args.per_device_train_batch_size if name == "train" else args.per_device_eval_batch_size
        packed = data.packed.get(name)
        dataset = packed.rows if packed else samples
        # Training draws shuffled batches; evaluation goes in order.
        order = batch_order(len(dataset), strategy, args.seed) if name == "train" else np.arange(len(dataset))
        problem, counts = verify_split(
            name, dataset, collator, batch_size, order, pad_token_id=tokenizer.pad_token_id, vocab_size=vocab_size,
            max_batches=max_batches, lengths_per_row=packed.sample_lengths if packed else None,
        )
        if problem:
            return problem, lines
        if isinstance(collator, PackedCollator):
            unit = f"{counts.rows} packed rows"
        elif isinstance(collator, PairedCollator):
            rows = "examples" if stage_row(config.finetuning.stage).reads == "unpaired" else "pairs"
            unit = f"{counts.rows} {rows} ({counts.samples} sequences)"
        else:
            unit = f"{counts.rows} samples"
        of = "" if counts.rows == len(dataset) else f" (of {len(dataset)})"
        lines.append(
            f"{name}: {counts.batches} batch{'es' if counts.batches != 1 else ''}, {unit}{of}, through {kind}: "
            f"{', '.join(counts.keys)}; "
            f"first batch {tuple(counts.shape or ())}"
        )
        lines.append(f"  {counts.supervised} supervised positions: label == input_id (the loss shifts them)")
        if attention:
            noun = "sequences" if isinstance(collator, PairedCollator) else "samples"
            lines.append(
                f"  {counts.samples} {layout} {noun} in {counts.batch_rows} batch rows: "
                "position ids restart at 0 at each start and step by 1; label -100 at every sample start"
            )
        if attention and isinstance(collator, PairedCollator):
            lines.append("  sequence_ids: one id per sequence, each of the batch's sequences once, -1 on padding")
        lines.append(
            f"  {counts.padding} padding positions: pad id {tokenizer.pad_token_id}, label -100"
            + ("" if attention else ", attention_mask 0 (1 on every real token)")
        )
    if stage_row(config.finetuning.stage).reads != "text":
        problem, encoding_lines = verify_encoding(config.data, config.finetuning.stage, args.seed, tokenizer,
                                                  max_batches * args.per_device_train_batch_size,
                                                  images=data.vision is not None)
        if problem:
            return problem, lines
        lines += encoding_lines
    if data.vision is not None:
        problem, image_lines = verify_images(data, max_batches * args.per_device_train_batch_size)
        if problem:
            return problem, lines
        lines += image_lines
    checked = "dtypes int64, shapes consistent" + (f", every input id < vocab_size {vocab_size}" if vocab_size else "")
    lines.append(f"ok: every check passed ({checked})")
    return None, lines


def verify_encoding(data_args: DataArguments, stage: str, seed: int, tokenizer, max_rows: int,
                    images: bool = False) -> tuple[str | None, list[str]]:
    """Re-encode up to ``max_rows`` training rows (0: all) of `stage`, read with `seed` as training reads them, and
    check each with ``encoded_row_problem``: answers after their exact inference prompts, ending with the
    end-of-turn token, truncation keeping the last answer."""
    pairs = stage_row(stage).pairs
    encoder = SupervisedEncoder(
        tokenizer=tokenizer, template=get_template(data_args.template, tokenizer), cutoff_len=data_args.cutoff_len,
        train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history or pairs,
        template_vars=data_args.template_kwargs or {},
    )
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the second reading of the rows: no second set of bars
    try:
        # encoder=: with skip_bad_rows the rows training skipped are skipped here too (data/trainable.py)
        rows, _ = load_canonical_splits(data_args, seed, {}, images=images, encoder=encoder)
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    count = len(rows) if max_rows <= 0 else min(len(rows), max_rows)
    for index, row in enumerate(rows.select(range(count))):
        sides = [with_answer(row, {"role": "assistant", "content": row[key], "tool_calls": "", "tool_call_id": ""})
                 for key in ("chosen", "rejected") if row.get(key)] or [row]
        for side in sides:
            problem = encoded_row_problem(encoder, side)
            if problem:
                return f"train row {index}: {problem}", []
    marker = encoder.template.stop_words[0] if encoder.template.stop_words else "(none)"
    return None, [
        f"encoding: {count} training rows re-encoded: every trained answer follows its inference prompt's exact ids "
        f"and is its own ids, ending with {marker!r} as one token; no example over cutoff_len "
        f"{data_args.cutoff_len}, the last answer of each conversation kept"
    ]
