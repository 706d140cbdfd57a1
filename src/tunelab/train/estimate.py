"""`tunelab estimate`: a run's peak memory by parts, predicted, and its time per step, measured.

Memory (bytes, per device, for one micro-batch of per_device_train_batch_size x cutoff_len tokens — the
longest a batch can be; padded batches of shorter rows need less):

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
                         outside the layers h/4 + V (the log-softmax of the loss, float32), + 3h when
                                            the embeddings / final norm train (full fine-tuning)
                       h hidden, i intermediate, kv = key/value heads x head dim, V vocabulary. Only
                       layers at or above the lowest trainable one save anything (freeze). Activation
                       checkpointing keeps each layer's input (h) plus one layer's activations. Half
                       precision stores 2 bytes per element, float32 4 (the loss's log-softmax is
                       float32 either way).
    loss workspace     the logits and their float32 copy alive while the loss and its gradient are
                       computed: 2 x tokens x V x 4 bytes.
    peak = weights + gradients + optimizer states + activations + loss workspace.

Time: a probe runs a few real optimizer steps (the configured model, adapters, optimizer, batch size and
gradient accumulation, on random tokens of the configured shape) and reports the median seconds per step
after a warm-up step, and the peak memory it measured (CUDA: max_memory_allocated; CPU: the process's
peak RSS increase over the loaded-model baseline, via /proc/self/clear_refs and VmHWM on Linux).

Not modelled: DeepSpeed/FSDP sharding (divide by the shard count), packing isolation masks, CUDA
context and allocator fragmentation, data loader workers.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tunelab.config.args import RunConfig

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
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
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
    checkpointing: bool
    activation_bytes: int  # 2 (bf16/fp16 compute) or 4


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


@dataclass
class Estimate:
    memory: MemoryEstimate
    total_parameters: int
    trainable_parameters: int
    tokens_per_micro_batch: int
    notes: list[str] = field(default_factory=list)
    seconds_per_step: float | None = None
    measured_peak_increase: int | None = None  # probe: peak over the loaded-model baseline, bytes
    measured_how: str | None = None


# ---- activations -----------------------------------------------------------------------------------------


def activation_elements_per_token(model: ModelShape, shape: TrainingShape) -> dict[str, float]:
    """Saved-for-backward elements per token: {'layer': one active layer, 'outside': everything else}."""
    h, kv = model.hidden, model.kv_heads * model.head_dim
    layer = 6 * h + 2 * kv + 4 * model.intermediate + 6 + shape.lora_rank_per_layer
    if shape.norms_train:
        layer += 2 * h
    if shape.eager_attention:
        layer += model.heads * shape.seq_len
    outside_half = h / 4 + (3 * h if shape.outer_train else 0)  # stored in the compute dtype
    return {"layer": layer, "outside": outside_half}


def activation_bytes(model: ModelShape, shape: TrainingShape) -> int:
    tokens = shape.batch_size * shape.seq_len
    per = activation_elements_per_token(model, shape)
    if shape.checkpointing:  # each layer's input is kept; one layer is recomputed at a time in backward
        layers = shape.active_layers * model.hidden + (per["layer"] if shape.active_layers else 0)
    else:
        layers = shape.active_layers * per["layer"]
    stored = tokens * (layers + per["outside"]) * shape.activation_bytes
    # The loss's log-softmax, float32, over the seq_len - 1 positions that predict a next token.
    log_softmax = shape.batch_size * (shape.seq_len - 1) * model.vocab * 4
    return int(stored + log_softmax)


def loss_workspace_bytes(model: ModelShape, shape: TrainingShape) -> int:
    return 2 * shape.batch_size * shape.seq_len * model.vocab * 4


# ---- parameters, gradients, optimizer ------------------------------------------------------------------


def parameter_bytes(model: nn.Module, quantization_bit: int | None = None) -> tuple[int, int, int]:
    """(weights bytes, gradient bytes, trainable elements); tied parameters once."""
    from tunelab.model.adapters import LORA_LAYER_TYPES, decoder_layers  # noqa: PLC0415

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


def meta_model(config: RunConfig) -> nn.Module:
    """The model as training sets it up (adapters, upcasts), on the meta device: shapes and dtypes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    from tunelab.model.adapters import setup_finetuning  # noqa: PLC0415
    from tunelab.model.load import resolve_dtype  # noqa: PLC0415

    model_config = AutoConfig.from_pretrained(config.model.model_name_or_path, trust_remote_code=config.model.trust_remote_code)
    dtype = resolve_dtype(config.model, config.training)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, trust_remote_code=config.model.trust_remote_code)
    # An existing adapter's own rank decides; the meta copy uses the configured LoRA options instead.
    return setup_finetuning(model, config.finetuning, config.training, adapter_name_or_path=None)


def training_shape(model: nn.Module, config: RunConfig) -> TrainingShape:
    from tunelab.model.adapters import _checkpointing, decoder_layers  # noqa: PLC0415
    from tunelab.model.load import resolve_dtype  # noqa: PLC0415

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
    half = resolve_dtype(config.model, config.training) in (torch.bfloat16, torch.float16) or config.training.bf16 or config.training.fp16
    return TrainingShape(
        batch_size=config.training.per_device_train_batch_size,
        seq_len=config.data.cutoff_len,
        active_layers=len(layers) - lowest,
        norms_train=any(p.requires_grad for p in norms),
        outer_train=any(p.requires_grad for p in outer),
        lora_rank_per_layer=lora_rank,
        eager_attention=(attn == "eager" or config.model.flash_attn == "disabled"),
        checkpointing=_checkpointing(config.training)[0],
        activation_bytes=2 if half else 4,
    )


def estimate(config: RunConfig, probe_steps: int = 3) -> Estimate:
    model = meta_model(config)
    model_shape = ModelShape.from_config(model.config)
    shape = training_shape(model, config)
    weights, grads, trainable = parameter_bytes(model, config.model.quantization_bit)
    states, note = optimizer_state_bytes(model, str(getattr(config.training.optim, "value", config.training.optim)))
    memory = MemoryEstimate(
        weights=weights, gradients=grads, optimizer_states=states,
        activations=activation_bytes(model_shape, shape), loss_workspace=loss_workspace_bytes(model_shape, shape),
    )
    total = sum(p.numel() for p in model.parameters())
    result = Estimate(memory, total, trainable, shape.batch_size * shape.seq_len, notes=[note] if note else [])
    if probe_steps > 0:
        result.seconds_per_step, result.measured_peak_increase, result.measured_how = probe(config, probe_steps)
    return result


# ---- the probe -----------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory increase over a baseline taken at start(): CUDA allocator stats, else the process's peak RSS."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.baseline = 0

    @property
    def how(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.cuda else "peak RSS (VmHWM) over the baseline"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            return_freed_memory_to_os()
            reset_peak_rss()
            self.baseline = rss_bytes()["VmRSS"]

    def peak_increase(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return rss_bytes()["VmHWM"] - self.baseline


def return_freed_memory_to_os() -> bool:
    """Fix glibc's mmap threshold at 64 KiB, so every tensor bigger than that is its own mapping, returned to the
    OS when freed: RSS then follows live tensor memory. (glibc otherwise raises the threshold after the first
    large free and keeps later tensors in its heap, so RSS stays at the high-water mark of the first step.)"""
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return False


def rss_bytes() -> dict[str, int]:
    """Current (VmRSS) and peak (VmHWM) resident memory of this process, from /proc/self/status."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


class _StepTimes:
    def __init__(self):
        import transformers  # noqa: PLC0415

        class Callback(transformers.TrainerCallback):
            def on_step_begin(cb, args, state, control, **kwargs):  # noqa: N805
                self.begin = time.perf_counter()

            def on_step_end(cb, args, state, control, **kwargs):  # noqa: N805
                self.times.append(time.perf_counter() - self.begin)

        self.times: list[float] = []
        self.begin = 0.0
        self.callback = Callback()


def probe(config: RunConfig, steps: int) -> tuple[float, int, str]:
    """Run 1 + `steps` optimizer steps on random tokens; (median seconds per step after the first, peak increase, how)."""
    import datasets  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from tunelab.data.collate import build_collator  # noqa: PLC0415
    from tunelab.model.load import load_model, load_tokenizer  # noqa: PLC0415
    from tunelab.train.trainer import TunelabTrainer  # noqa: PLC0415

    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, config.finetuning, config.training, tokenizer, is_trainable=True)
    args = config.training
    rows = (steps + 1) * args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = min(len(tokenizer), model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (rows, config.data.cutoff_len), generator=generator).tolist()
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    times = _StepTimes()
    with tempfile.TemporaryDirectory() as scratch:
        probe_args = dataclasses.replace(
            args, output_dir=scratch, max_steps=steps + 1, eval_strategy="no", save_strategy="no",
            logging_strategy="no", report_to="none", do_eval=False, do_predict=False, disable_tqdm=True,
            resume_from_checkpoint=None,
        )
        trainer = TunelabTrainer(
            model=model, args=probe_args, train_dataset=dataset,
            data_collator=build_collator(model, tokenizer.pad_token_id, False), processing_class=tokenizer,
            callbacks=[times.callback],
        )
        for printer in (transformers.PrinterCallback, transformers.ProgressCallback):  # the table is the output
            trainer.remove_callback(printer)
        peak = PeakMemory(args.device)
        peak.start()
        trainer.train()
        increase = peak.peak_increase()
    return statistics.median(times.times[1:] or times.times), increase, peak.how


# ---- the table ---------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_estimate(result: Estimate) -> str:
    memory = result.memory
    rows = [
        ("weights", memory.weights, f"{result.total_parameters:,} parameters"),
        ("gradients", memory.gradients, f"{result.trainable_parameters:,} trainable"),
        ("optimizer states", memory.optimizer_states, ""),
        ("activations", memory.activations, f"{result.tokens_per_micro_batch:,} tokens per micro-batch"),
        ("loss workspace", memory.loss_workspace, "logits + float32 copy"),
    ]
    width = max(len(name) for name, _, _ in rows) + 2
    lines = ["predicted peak memory per device:"]
    lines += [f"  {name:<{width}}{_size(value):>12}  {detail}".rstrip() for name, value, detail in rows]
    lines.append(f"  {'total':<{width}}{_size(memory.total):>12}")
    if result.seconds_per_step is not None:
        lines.append(f"measured (probe): {result.seconds_per_step:.3f} s per optimizer step")
        lines.append(
            f"  peak increase over the loaded model: {_size(result.measured_peak_increase)} measured "
            f"({result.measured_how}) vs {_size(memory.training_increase)} predicted"
        )
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
