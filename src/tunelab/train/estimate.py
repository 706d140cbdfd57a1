"""`tunelab estimate`: the peak memory a run will show, by parts, and its time per step, measured.

The memory is the whole process's peak on CPU (what `top`, `/usr/bin/time -v` or getrusage report as the
run's peak RSS) and the tensors on the device on a GPU, for the longest micro-batch the run's data gives:

    process baseline   measured, not modelled: the resident memory of this process once it has imported
                       what the stage's training workflow imports (Python, torch, transformers, datasets,
                       tunelab) and loaded the tokenized dataset the way training does (the tokenized cache,
                       memory-mapped), before any model exists. On CPU it is part of the total; on a GPU it is
                       host memory and shown beside the device total.
    weights            every parameter's numel x its element size, counted on a meta-device copy of the
                       model set up exactly as training sets it up (LoRA/freeze/full, dtype, upcasts);
                       tied weights once. 4/8-bit bases: quantized linear weights at bits/8 (+ block
                       constants), approximately.
    gradients          trainable numel x element size (gradients match their parameter's dtype).
    optimizer states   AdamW: 2 per trainable element in the parameter's dtype (8-bit variants: 2 bytes);
                       SGD: 0 (no momentum) or 1; Adafactor: row + column factors of 2-D parameters.
    activations        what autograd saves for backward, per token (Llama-family decoders: gated MLP,
                       RMSNorm, rotary attention), in elements, counted from the saved tensors of
                       transformers' Llama code (tests/train/test_estimate.py pins it against a real count):
                         per decoder layer  6h + 2kv + 4i + 6 (+2h when its norm weights train,
                                            + the LoRA rank of every adapted linear, + heads x seq for
                                            eager attention, which keeps the attention probabilities)
                                            Under a mask (packed rows, several sequences side by side or
                                            padded; not pt's equal windows: `masked_attention`) sdpa keeps
                                            keys and values repeated to every query head (2 heads x head_dim
                                            instead of 2kv: transformers repeats them unless there is no
                                            mask), as eager attention always does, and torch turns the boolean
                                            mask into a float one in every layer and keeps it: + seq per token
                                            (batch x seq^2 a layer). sdpa_varlen (model/varlen_sdpa.py) takes
                                            such rows without a mask, once per sample: kv once per KV head, and
                                            each sample's output kept apart from the joined one (+ h).
                         outside the layers h/4, + 2h when the embeddings / final norm train (full
                                            fine-tuning)
                       plus, per supervised position only (training computes the output layer where a
                       label follows, train/losses.py): its logits (V in the compute dtype), the output
                       layer's input when that layer trains (h), and 12 bytes (the float32 logsumexp and
                       the int64 target).
                       h hidden, i intermediate, kv = key/value heads x head dim, V vocabulary. Only
                       layers at or above the lowest trainable one save anything (freeze). Activation
                       checkpointing keeps each layer's input (h) plus one layer's activations. Half
                       precision stores 2 bytes per element, float32 4.
    loss workspace     during backward: the logits' gradient (supervised positions x V in the compute
                       dtype) plus the float32 softmax of one chunk of rows (losses.CHUNK_ELEMENTS) and
                       its copy of the logits: 2 x min(supervised, chunk rows) x V x 4 bytes.
    total              CPU: baseline + the five parts; GPU: the five parts.

The micro-batch is per_device_train_batch_size rows of the longest tokenized row of the training data
(padded batches are as wide as their longest row; packed rows are cutoff_len long), each with as many
supervised positions as the most supervised row, read from the data when the stage is sft or pt and the
data is not streamed, else cutoff_len rows supervised everywhere, and the output says which.

Not counted (the output says so too): on CPU, the library code the first backward pages in and the free memory
the C allocator keeps in its heap after the first steps (0.5B LoRA at 512: 5,154 MiB measured against 4,586 with
`MALLOC_MMAP_THRESHOLD_=1048576`, which returns it at a cost in speed; train/memory.py); on a GPU,
the CUDA context and the caching allocator's reserved-but-free blocks; evaluation and generation batches
(smaller than a training step's, without gradients), data-loader workers, DeepSpeed/FSDP sharding (divide the
sharded parts by the number of ranks), architectures far from Llama.

Time: a probe trains a few real optimizer steps on the run's first batches (the configured model,
adapters, optimizer, batch size and gradient accumulation, on the tokenized training data when it was
read, else on random rows of cutoff_len tokens) with the allocator as training has it, and reports the
median seconds per step after a warm-up step, and the peak it measured: the process's peak RSS (VmHWM)
on CPU, torch.cuda.max_memory_allocated / max_memory_reserved on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from accelerate.utils import is_deepspeed_available
from torch import nn

from tunelab.config.args import DataArguments, FinetuningArguments, ModelArguments, RunConfig
from tunelab.config.training_args import TrainingArguments
from tunelab.config.stages import Stage, stage_row
from tunelab.data.collate import SDPA_VARLEN, build_collator, takes_varlen
from tunelab.data.run_data import supervised_counts, token_lengths
from tunelab.errors import DataError, TemplateError
from tunelab.model.adapters import (
    LORA_LAYER_TYPES,
    checkpointing_settings,
    decoder_layers,
    trained_skeleton,
)
from tunelab.model.load import load_model
from tunelab.model.resolve import resolve_dtype
from tunelab.model.text_config import text_config
from tunelab.model.tokenizer import load_tokenizer
from tunelab.train.losses import CHUNK_ELEMENTS
from tunelab.train.memory import reset_peak_rss, rss_bytes
from tunelab.train.plan import RunPlan
from tunelab.train.recipe import recipe_for
from tunelab.train.trainer import TunelabTrainer

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation formula reads from a decoder's config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        text = text_config(config)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            hidden=text.hidden_size, intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            layers=text.num_hidden_layers, heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim, vocab=text.vocab_size,
        )


@dataclass(frozen=True)
class TrainingShape:
    """What the activation formula needs to know about how the model trains."""

    batch_size: int
    seq_len: int
    active_layers: int  # layers at or above the lowest trainable one (they save activations)
    norms_train: bool  # the decoder layers' norm weights train (full, freeze)
    outer_train: bool  # embeddings / final norm / head train (full)
    lora_rank_per_layer: int  # sum of LoRA ranks over one layer's adapted linears
    eager_attention: bool
    masked_attention: bool  # the batch's attention has a mask: packed rows, several sequences side by side, padding
    checkpointing: bool
    activation_bytes: int  # 2 (bf16/fp16 compute) or 4
    supervised_per_row: int  # positions whose next token is a label: where the output layer and loss run
    per_sample_attention: bool = False  # sdpa_varlen over such rows: no mask, each sample's output kept (+h)

    @property
    def supervised(self) -> int:
        return self.batch_size * self.supervised_per_row


@dataclass
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    loss_workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations + self.loss_workspace

    @property
    def training_increase(self) -> int:
        """Everything but the weights: what a loaded process adds once it trains."""
        return self.total - self.weights


@dataclass(frozen=True)
class RowLengths:
    """The token lengths the estimate assumed, and where they came from."""

    longest: int  # tokens in the longest training row (the widest padded micro-batch)
    source: str  # one line for the output: the data's lengths, or why cutoff_len was assumed
    from_data: bool
    supervised: int | None = None  # supervised positions of the most supervised row; None: all but the last


@dataclass
class ProbeResult:
    seconds_per_step: float  # the median after the warm-up step
    fastest_step: float  # the least disturbed by other processes on a shared machine
    steps: int
    peak: int  # CPU: the process's peak RSS; GPU: torch.cuda.max_memory_allocated
    reserved: int | None  # GPU: torch.cuda.max_memory_reserved
    batches: str  # what the probe trained on


@dataclass
class Estimate:
    memory: MemoryEstimate
    total_parameters: int
    trainable_parameters: int
    batch_size: int
    lengths: RowLengths
    process_baseline: int  # bytes: this process's RSS after the imports and the data, before the model
    on_gpu: bool
    notes: list[str] = field(default_factory=list)
    probe: ProbeResult | None = None

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.lengths.longest

    @property
    def predicted_peak(self) -> int:
        """CPU: the whole process's peak RSS; GPU: the peak of tensors on the device."""
        return self.memory.total + (0 if self.on_gpu else self.process_baseline)


# ---- activations -----------------------------------------------------------------------------------------


def activation_elements_per_token(model: ModelShape, shape: TrainingShape) -> dict[str, float]:
    """Saved-for-backward elements per token: {'layer': one active layer, 'outside': everything else}."""
    h, kv = model.hidden, model.kv_heads * model.head_dim
    if shape.eager_attention or shape.masked_attention:  # keys and values repeated to every query head
        kv = model.heads * model.head_dim
    layer = 6 * h + 2 * kv + 4 * model.intermediate + 6 + shape.lora_rank_per_layer
    if shape.norms_train:
        layer += 2 * h
    if shape.eager_attention:
        layer += model.heads * shape.seq_len
    elif shape.per_sample_attention:
        layer += h
    elif shape.masked_attention:  # sdpa: the boolean mask made float in every layer, (batch, 1, seq, seq)
        layer += shape.seq_len
    # Full fine-tuning: the embeddings and final norm keep 2h per token; the output layer's input (h) is kept
    # only at supervised positions (counted in activation_bytes).
    outside_half = h / 4 + (2 * h if shape.outer_train else 0)  # stored in the compute dtype
    return {"layer": layer, "outside": outside_half}


def activation_bytes(model: ModelShape, shape: TrainingShape) -> int:
    tokens = shape.batch_size * shape.seq_len
    per = activation_elements_per_token(model, shape)
    if shape.checkpointing:  # each layer's input is kept; one layer is recomputed at a time in backward
        layers = shape.active_layers * model.hidden + (per["layer"] if shape.active_layers else 0)
    else:
        layers = shape.active_layers * per["layer"]
    stored = tokens * (layers + per["outside"]) * shape.activation_bytes
    # The supervised positions' logits, kept for the chunked cross-entropy's backward, + logsumexp and target.
    head_input = model.hidden if shape.outer_train else 0  # the output layer's weight gradient reads it
    kept = shape.supervised * ((model.vocab + head_input) * shape.activation_bytes + 12)
    return int(stored + kept)


def loss_workspace_bytes(model: ModelShape, shape: TrainingShape) -> int:
    chunk_rows = min(shape.supervised, max(1, CHUNK_ELEMENTS // model.vocab))
    return shape.supervised * model.vocab * shape.activation_bytes + 2 * chunk_rows * model.vocab * 4


# ---- parameters, gradients, optimizer ------------------------------------------------------------------


def parameter_bytes(model: nn.Module, quantization_bit: int | None = None) -> tuple[int, int, int]:
    """(weights bytes, gradient bytes, trainable elements); tied parameters once."""

    quantized: set[int] = set()
    if quantization_bit:
        _, layers = decoder_layers(model)
        quantized = {id(m.weight) for m in layers.modules() if isinstance(m, LORA_LAYER_TYPES) and not m.weight.requires_grad}
    weights = grads = trainable = 0
    for param in model.parameters():
        if id(param) in quantized:
            # bits/8 per weight, plus one float32 absmax per 64-weight block (bitsandbytes' default).
            weights += param.numel() * quantization_bit // 8 + param.numel() // 64 * 4
        else:
            weights += param.numel() * param.element_size()
        if param.requires_grad:
            grads += param.numel() * param.element_size()
            trainable += param.numel()
    return weights, grads, trainable


def optimizer_state_bytes(model: nn.Module, optim: str) -> tuple[int, str | None]:
    """Bytes of optimizer state for the trainable parameters, and a note when the optimizer is assumed."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = optim.lower()
    if "8bit" in name:
        return sum(2 * p.numel() for p in params), None
    if name.startswith("sgd"):
        return 0, "SGD without momentum keeps no state (momentum would add one copy of the trainable weights)"
    if name.startswith("adafactor"):
        return sum((sum(p.shape[-2:]) if p.dim() >= 2 else p.numel()) * 4 for p in params), None
    if "adam" not in name and "lion" not in name:
        note = f"optim '{optim}': counted like AdamW (2 states per trainable element)"
    else:
        note = None
    states = 1 if "lion" in name else 2
    return sum(states * p.numel() * p.element_size() for p in params), note


# ---- the estimate ----------------------------------------------------------------------------------------


def training_shape(
    model: nn.Module, model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments,
    seq_len: int | None = None, supervised: int | None = None, *, windows: bool = False,
) -> TrainingShape:
    """How `model` trains under the options, for micro-batches of `seq_len` tokens a row (default cutoff_len) with
    `supervised` positions each (default all but the last). `windows`: the rows are raw-text windows of one length.
    """

    _, layers = decoder_layers(model)
    trainable_layers = [i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())]
    lowest = trainable_layers[0] if trainable_layers else len(layers)
    outer = [p for name, p in model.named_parameters() if ".layers." not in f".{name}" and "lora_" not in name]
    lora_rank = 0
    if trainable_layers:
        for module in layers[trainable_layers[-1]].modules():
            ranks = getattr(module, "r", None)
            if isinstance(ranks, dict) and hasattr(module, "lora_A"):
                lora_rank += sum(ranks.values())
    norms = [p for name, p in layers[trainable_layers[-1]].named_parameters() if "norm" in name] if trainable_layers else []
    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    # Packed or side-by-side rows reach these by their boundaries, without a mask (padding_free false: padded, masked).
    varlen_rows = attn.startswith("flash") or (takes_varlen(attn) and (data_args.packing or data_args.padding_free is not False))
    half = resolve_dtype(model_args, args) in (torch.bfloat16, torch.float16) or args.bf16 or args.fp16
    seq_len = seq_len or data_args.cutoff_len
    return TrainingShape(
        batch_size=args.per_device_train_batch_size,
        seq_len=seq_len,
        active_layers=len(layers) - lowest,
        norms_train=any(p.requires_grad for p in norms),
        outer_train=any(p.requires_grad for p in outer),
        lora_rank_per_layer=lora_rank,
        eager_attention=(attn == "eager" or model_args.flash_attn == "disabled"),
        # Rows of unequal lengths side by side or padded, or packed rows, have a mask; flash_attention_* and sdpa_varlen take their
        # boundaries without one; raw-text windows are all cutoff_len long.
        masked_attention=not varlen_rows and (
            data_args.packing or (args.per_device_train_batch_size > 1 and not windows)
        ),
        per_sample_attention=varlen_rows and attn == SDPA_VARLEN and (
            data_args.packing or args.per_device_train_batch_size > 1
        ),
        checkpointing=checkpointing_settings(args)[0],
        activation_bytes=2 if half else 4,
        supervised_per_row=seq_len - 1 if supervised is None else min(supervised, seq_len - 1),
    )


def estimate(config: RunConfig, probe_steps: int = 3, read_data: bool = True) -> Estimate:
    """Predict the run's peak memory; with probe_steps > 0 also train that many steps (+1 warm-up) to time them.

    The process baseline is this process's RSS once the stage's workflow is imported and the data loaded:
    it stands for a training process only when this runs as its own process (`tunelab estimate`).
    read_data=False assumes cutoff_len rows without reading the dataset.
    """
    import_training_stack(stage_row(config.finetuning.stage))
    lengths, train = row_lengths(config) if read_data else (cutoff_lengths(config.data, "read_data=False"), None)
    baseline = rss_bytes()["VmRSS"]
    reset_peak_rss()  # the probe's peak starts here: tokenizing a dataset on a cache miss is not training
    model = trained_skeleton(config.model, config.finetuning, config.training)
    model_shape = ModelShape.from_config(model.config)
    shape = training_shape(model, config.model, config.data, config.training, lengths.longest, lengths.supervised,
                           windows=stage_row(config.finetuning.stage).reads == "text")
    weights, grads, trainable = parameter_bytes(model, config.model.quantization_bit)
    states, note = optimizer_state_bytes(model, str(getattr(config.training.optim, "value", config.training.optim)))
    memory = MemoryEstimate(
        weights=weights, gradients=grads, optimizer_states=states,
        activations=activation_bytes(model_shape, shape), loss_workspace=loss_workspace_bytes(model_shape, shape),
    )
    total = sum(p.numel() for p in model.parameters())
    on_gpu = config.training.device.type == "cuda"
    result = Estimate(memory, total, trainable, shape.batch_size, lengths, baseline, on_gpu, notes=[note] if note else [])
    if not stage_row(config.finetuning.stage).token_loss:
        result.notes.append(
            f"stage {config.finetuning.stage}: counted (and probed) as single sequences; pair stages run two per "
            "row, and a reference, reward or teacher model adds its own weights"
        )
    if probe_steps > 0:
        result.probe = probe(config.model, config.data, config.finetuning, config.training, probe_steps, train)
    return result


# ---- the data: the lengths training will see ---------------------------------------------------------------


def import_training_stack(row: Stage) -> None:
    """Import what `tunelab train` imports for this stage, so the measured baseline holds the same libraries.

    That includes DeepSpeed when it is installed: accelerate's unwrap_model, called by every Trainer, imports it
    (and DeepSpeed imports mlflow), ~60 MiB of resident memory in every run, DeepSpeed configured or not."""
    importlib.import_module(row.recipe_module)
    if is_deepspeed_available():
        importlib.import_module("deepspeed")


def cutoff_lengths(data_args: DataArguments, why: str) -> RowLengths:
    return RowLengths(data_args.cutoff_len, f"every row cutoff_len = {data_args.cutoff_len} tokens ({why})", False)


def row_lengths(config: RunConfig):
    """(RowLengths, the tokenized train set or None): the stage recipe's datasets (train/recipe.py), read through
    the tokenized cache as `tunelab train` reads them, so a later run finds the same cache entry."""

    stage = config.finetuning.stage
    if not stage_row(stage).token_loss:
        return cutoff_lengths(config.data, f"stage {stage}: its rows are not read"), None
    if config.data.streaming:
        return cutoff_lengths(config.data, "streaming: the data is not read ahead"), None
    try:
        train = recipe_for(RunPlan(config, "estimate")).datasets().train
    except (DataError, TemplateError) as exc:
        return cutoff_lengths(config.data, f"the dataset could not be read: {exc}"), None
    if train is None or len(train) == 0:
        return cutoff_lengths(config.data, "no training rows"), None
    lengths = token_lengths(train)
    supervised = supervised_counts(train)
    names = ", ".join(config.data.dataset or [])
    source = (f"{names}: {len(lengths):,} rows of {int(lengths.min())}-{int(lengths.max())} tokens "
              f"(mean {float(lengths.mean()):.1f}, cutoff_len {config.data.cutoff_len}), "
              f"up to {int(supervised.max())} supervised")
    return RowLengths(int(lengths.max()), source, True, int(supervised.max())), train


# ---- the probe -----------------------------------------------------------------------------------------


class _StepTimes:
    def __init__(self):
        class Callback(transformers.TrainerCallback):
            def on_step_begin(cb, args, state, control, **kwargs):  # noqa: N805
                self.begin = time.perf_counter()

            def on_step_end(cb, args, state, control, **kwargs):  # noqa: N805
                self.times.append(time.perf_counter() - self.begin)

        self.times: list[float] = []
        self.begin = 0.0
        self.callback = Callback()


def probe(model_args: ModelArguments, data_args: DataArguments, finetuning: FinetuningArguments,
          args: TrainingArguments, steps: int, train=None) -> ProbeResult:
    """Train 1 + `steps` optimizer steps: on `train` (the tokenized training set, in the run's order) when
    given, else on random rows of cutoff_len tokens. The median seconds per step after the first, and the peak.

    The C allocator is left as training leaves it (train/memory.py says why).
    """
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, finetuning, args, tokenizer, is_trainable=True)
    if train is not None:
        dataset, batches = train, "the run's first batches"
    else:
        rows = (steps + 1) * args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
        generator = torch.Generator().manual_seed(args.seed)
        vocab = min(len(tokenizer), model.get_input_embeddings().weight.shape[0])
        ids = torch.randint(0, vocab, (rows, data_args.cutoff_len), generator=generator).tolist()
        dataset, batches = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}), "random rows of cutoff_len tokens"
    times = _StepTimes()
    cuda = args.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as scratch:
        probe_args = dataclasses.replace(
            args, output_dir=scratch, max_steps=steps + 1, eval_strategy="no", save_strategy="no",
            logging_strategy="no", report_to="none", do_eval=False, do_predict=False, disable_tqdm=True,
            resume_from_checkpoint=None,
        )
        trainer = TunelabTrainer(
            model=model, args=probe_args, train_dataset=dataset,
            data_collator=build_collator(model, tokenizer.pad_token_id, data_args.packing, data_args.padding_free),
            processing_class=tokenizer, callbacks=[times.callback], finetuning=finetuning,
        )
        for printer in (transformers.PrinterCallback, transformers.ProgressCallback):  # the table is the output
            trainer.remove_callback(printer)
        trainer.train()
    timed = times.times[1:] or times.times
    seconds = (statistics.median(timed), min(timed))
    if cuda:
        torch.cuda.synchronize()
        return ProbeResult(*seconds, steps, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), batches)
    return ProbeResult(*seconds, steps, rss_bytes()["VmHWM"], None, batches)


# ---- the table ---------------------------------------------------------------------------------------------


def format_size(n: int) -> str:
    """Bytes in the largest binary unit they reach (the estimate's figures, out-of-memory messages)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


NOT_COUNTED_CPU = (
    "the C allocator's retained free memory and the library code the first backward pages in (the probe's peak "
    "includes them), evaluation and generation batches, data-loader workers"
)
NOT_COUNTED_GPU = (
    "the CUDA context and the caching allocator's reserved-but-free blocks (the probe's 'reserved'), evaluation "
    "and generation batches; host memory is the baseline above plus pinned buffers"
)


def format_estimate(result: Estimate) -> str:
    memory = result.memory
    rows = [
        ("weights", memory.weights, f"{result.total_parameters:,} parameters"),
        ("gradients", memory.gradients, f"{result.trainable_parameters:,} trainable"),
        ("optimizer states", memory.optimizer_states, ""),
        ("activations", memory.activations,
         f"{result.tokens_per_micro_batch:,} tokens per micro-batch ({result.batch_size} x {result.lengths.longest})"),
        ("loss workspace", memory.loss_workspace, "logits' gradient + one float32 chunk"),
    ]
    baseline = ("process baseline", result.process_baseline, "measured: libraries + tokenized data, before the model")
    if result.on_gpu:
        lines = ["predicted peak memory on the device (tensors):"]
    else:
        lines = ["predicted peak memory (CPU: the whole process's resident memory):"]
        rows.insert(0, baseline)
    width = max(len(name) for name, _, _ in rows) + 2
    lines += [f"  {name:<{width}}{format_size(value):>12}  {detail}".rstrip() for name, value, detail in rows]
    lines.append(f"  {'total':<{width}}{format_size(result.predicted_peak):>12}  "
                 + ("peak of the device's tensors" if result.on_gpu else "peak RSS of the run"))
    if result.on_gpu:
        lines.append(f"host process: {format_size(result.process_baseline)} resident before the model (libraries + tokenized data)")
    lines.append(f"row lengths: {result.lengths.source}")
    not_counted = "not counted: " + (NOT_COUNTED_GPU if result.on_gpu else NOT_COUNTED_CPU)
    lines += textwrap.wrap(not_counted, width=110, subsequent_indent="  ")
    for note in result.notes:
        lines += textwrap.wrap(f"note: {note}", width=110, subsequent_indent="  ")
    probe = result.probe
    if probe is not None:
        steps = f"{probe.steps} step{'s' if probe.steps != 1 else ''}"
        lines.append(f"measured (probe, {steps} after a warm-up on {probe.batches}): "
                     f"{probe.seconds_per_step:.3f} s per optimizer step (median; fastest {probe.fastest_step:.3f})")
        if probe.reserved is None:
            lines.append(f"  peak RSS of this process: {format_size(probe.peak)} measured vs {format_size(result.predicted_peak)} predicted")
        else:
            lines.append(f"  peak on the device: {format_size(probe.peak)} allocated, {format_size(probe.reserved)} reserved, "
                         f"vs {format_size(result.predicted_peak)} predicted")
    return "\n".join(lines)
