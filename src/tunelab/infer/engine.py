"""The inference engine behind `tunelab chat` and `tunelab api`: load a trained folder, stream answers.

    model folder | adapter folder (+ its base from adapter_config.json, or --model)
      → tokenizer (the adapter's own when it saved one) + chat template (the folder's, or --template NAME)
      → messages (and tools) rendered with the generation prompt → token ids (prompt_tokens); a vision-language
        model's image parts (infer/images.py) become `<image>`, expanded and turned into pixel values by the
        folder's processor exactly as training encodes them (data/vision.py)
      → the batch scheduler (batching.py): one thread runs model.generate, one request or several together,
        and hands each request its tokens through a queue
      → incremental decode (never splits a multi-byte character) → stop strings → text pieces

Generation ends at the template's end-of-turn ids (finish_reason "stop"), at a stop string ("stop"), or
after max_new_tokens ("length"). Concurrent generations share forward passes, up to `max_batch_size` rows
(1: one at a time, as the chat loop needs). It owns no terminal or HTTP code (chat.py, api.py do), and no
tool-call parsing (tool_calls.py): it renders `tools` into the prompt and can start the answer with a prefill.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tunelab.assets import EMBEDDED_MODELS
from tunelab.config.args import ModelArguments
from tunelab.data.formats import IMAGE_PLACEHOLDER, template_shapes
from tunelab.data.images import open_images
from tunelab.data.templates import TEMPLATE_NAMES, Template, get_template
from tunelab.data.vision import expansions, image_inputs
from tunelab.errors import ConfigError, DataError, ImageInputError, InferenceError, ModelError, first_line
from tunelab.infer.batching import END, BatchRow, BatchScheduler
from tunelab.infer.generate import stop_token_ids
from tunelab.infer.images import split_images
from tunelab.infer.sampling import SamplingOptions
from tunelab.infer.tool_calls import ToolSyntax, tool_syntax
from tunelab.infer.trained import inference_template_kwargs, saved_template
from tunelab import hub
from tunelab.model import gguf, rope, vision
from tunelab.model.adapters import load_adapter
from tunelab.model.tokenizer import load_processor, load_tokenizer
from tunelab.run_folder import TrainedFolder

Message = dict[str, Any]
DTYPES = ("auto", "float32", "bfloat16", "float16")


# ---- loading -------------------------------------------------------------------------------------------------


def resolve_folders(
    path: str, base_model: str | None = None, allow_pickle_weights: bool = False, trust_remote_code: bool = False
) -> tuple[str, str | None]:
    """(model folder, adapter folder or None) for a model folder, or an adapter folder and its base model.
    Hub ids (the path, or the base an adapter names) become folders of the Hugging Face cache (tunelab/hub.py)."""
    hub_options = {"allow_pickle": allow_pickle_weights, "trust_remote_code": trust_remote_code}
    if gguf.is_gguf(path):  # a GGUF file: the whole model, its tokenizer and chat template in one
        if base_model is not None:
            raise ConfigError(f"--model: {path} is a whole model (a GGUF file), not a LoRA adapter; drop --model")
        if not Path(path).is_file():
            raise ModelError(f"{path}: no such file")
        gguf.check_readable(path, key="model")
        return path, None
    folder = EMBEDDED_MODELS[path] if path in EMBEDDED_MODELS else Path(hub.resolve_model(path, "", **hub_options))
    if not folder.is_dir():
        raise ModelError(f"{path}: no such folder; pass a model folder (config.json + weights) or a LoRA adapter folder")
    adapter_config = folder / "adapter_config.json"
    if adapter_config.is_file():
        hub.fetch_weights(folder, allow_pickle_weights, key="")
        key, revision = "--model", "main"
        if base_model is None:
            try:
                saved = json.loads(adapter_config.read_text(encoding="utf-8"))
                base_model, revision = saved.get("base_model_name_or_path"), saved.get("revision") or "main"
            except (OSError, ValueError, AttributeError) as exc:
                raise ModelError(f"{adapter_config}: unreadable ({first_line(exc)}); repair it or retrain") from None
            if not base_model:
                raise ModelError(f"{adapter_config} names no base_model_name_or_path; pass the base model with --model")
            key = f"{adapter_config}: base_model_name_or_path"
        base_model = ModelArguments(model_name_or_path=base_model).model_name_or_path
        if gguf.is_gguf(base_model):  # trained on a GGUF file: that file is the base
            if not Path(base_model).is_file():
                raise ModelError(f"{key}: {base_model} is no longer there; pass the GGUF file with --model")
            gguf.check_readable(base_model, key=key)
            return base_model, str(folder)
        base_model = hub.resolve_model(base_model, key, revision, revision_key=f"{adapter_config}: revision", **hub_options)
        return base_model, str(folder)
    if (folder / "config.json").is_file():
        if base_model is not None:
            raise ConfigError(f"--model: {path} is a whole model (config.json), not a LoRA adapter; drop --model")
        return str(folder), None
    raise ModelError(
        f"{path} is neither a model folder (config.json) nor a LoRA adapter folder (adapter_config.json); "
        "pass the output_dir of a training run or a Hugging Face model folder"
    )


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_engine(
    path: str,
    base_model: str | None = None,
    template: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    allow_pickle_weights: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    rope_scaling: tuple[str, float] | None = None,
) -> ChatEngine:
    """A ChatEngine for a model folder, or an adapter folder on its base (adapter_config.json, or `base_model`);
    either may be a Hub id (tunelab/hub.py). `template_kwargs` reach every prompt render; None: those the folder's
    tunelab_config.yaml recorded for its own template (none with a `template` named here). `rope_scaling` (a YAML's
    rope_scaling and resolved rope_factor): the base's RoPE scaled so; None: as the adapter's run recorded (a full
    model's config.json has its own)."""
    model_dir, adapter_dir = resolve_folders(path, base_model, allow_pickle_weights, trust_remote_code)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    trained = TrainedFolder.of(model_dir, adapter_dir)
    tokenizer_dir = trained.tokenizer_folder(model_dir)  # an adapter's own, with the template it trained with
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tokenizer_dir), trust_remote_code=trust_remote_code))
    chat_template = get_template(template, tokenizer) if template is not None else saved_template(tokenizer)
    if chat_template is None:
        raise ConfigError(
            f"{tokenizer_dir} has no chat_template (a pretraining run or a base model); "
            f"pass --template NAME, one of {', '.join(TEMPLATE_NAMES)}"
        )
    if template_kwargs is None and template is not None:
        template_kwargs = {}  # the folder recorded its variables for its own template, not this one
    template_kwargs = inference_template_kwargs(template_kwargs, trained, chat_template)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = default_dtype(device) if dtype == "auto" else getattr(torch, dtype)
    hub.fetch_weights(model_dir, allow_pickle_weights, key="")
    is_vision = vision.is_vision_model_folder(model_dir)
    processor = load_processor(ModelArguments(model_name_or_path=model_dir, trust_remote_code=trust_remote_code))
    auto_class = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
    scaling = rope.RopeScaling(*rope_scaling) if rope_scaling else rope.recorded_rope(adapter_dir)
    try:
        kwargs = rope.with_rope_scaling(model_dir, scaling, trust_remote_code, {"dtype": torch_dtype})
        model, info = gguf.from_pretrained(
            auto_class, model_dir, trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs
        )
    except Exception as exc:  # noqa: BLE001  (missing or corrupt files, unknown architecture, a hub id offline)
        hint = "; pass the base model folder with --model" if adapter_dir else ""
        raise ModelError(f"{model_dir}: cannot load the model: {first_line(exc)}{hint}") from exc
    if info.get("missing_keys"):  # transformers would fill them with random values and answer nonsense
        missing = sorted(info["missing_keys"])
        raise ModelError(f"{model_dir}: the weights lack {', '.join(missing[:3])} ({len(missing)} in all); "
                         "the checkpoint is incomplete")
    if adapter_dir:
        model = load_adapter(model, adapter_dir, is_trainable=False)
    model.to(device).eval()
    name = Path(adapter_dir or model_dir).resolve().name
    return ChatEngine(model, tokenizer, chat_template, name, template_kwargs, processor)


# ---- generation ----------------------------------------------------------------------------------------------


class IncrementalDecoder:
    """Token ids in, text out, never splitting a multi-byte character across pieces.

    Decodes a short window (the previous piece's tokens + the new ones) and emits what the new tokens added,
    so tokenizers that drop a leading space at the start of a decode still join up. A piece that ends in
    U+FFFD (a character whose bytes have not all arrived) waits for the next token. Special tokens are
    skipped, except those in `keep` (id → text: a tool-call opening such as Mistral's [TOOL_CALLS]).
    """

    def __init__(self, tokenizer, lock: threading.Lock | None = None, keep: dict[int, str] | None = None):
        self.tokenizer, self.lock, self.keep = tokenizer, lock or threading.Lock(), keep or {}
        self.ids: list[int] = []
        self.prefix = 0  # start of the window
        self.read = 0  # tokens before this one have been emitted

    def _decode(self, ids: list[int]) -> str:
        with self.lock:  # a tokenizer is shared by the requests' threads
            if not self.keep or not self.keep.keys() & set(ids):
                return self.tokenizer.decode(ids, skip_special_tokens=True)
            parts, start = [], 0
            for i, token_id in enumerate(ids):
                if token_id in self.keep:
                    parts += [self.tokenizer.decode(ids[start:i], skip_special_tokens=True), self.keep[token_id]]
                    start = i + 1
            return "".join(parts) + self.tokenizer.decode(ids[start:], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass
class Generation:
    """One answer: iterate for its text pieces; afterwards `text`, `finish_reason` and the token counts are final.

    Iterating starts it (or `start()`, or `ChatEngine.start` for several at once). Stopping the iteration
    early (closing it, Ctrl-C, a client that went away) or calling `cancel()` ends the generation at the
    next token. `prefill` is text the answer was made to start with: part of the prompt, not of `text`.
    """

    engine: ChatEngine
    prompt_ids: list[int]
    options: SamplingOptions
    max_new_tokens: int
    prefill: str = ""
    keep_tokens: dict[int, str] = field(default_factory=dict)  # special tokens to decode as text (IncrementalDecoder)
    image_inputs: dict[str, Any] = field(default_factory=dict, repr=False)  # pixel_values etc. (vision models)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    completion_tokens: int = 0
    _row: BatchRow | None = field(default=None, repr=False)
    _iterated: bool = field(default=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def start(self) -> None:
        """Queue the generation for the model (no-op once started); its tokens wait until iterated."""
        if self._row is None:
            self.engine.start([self])

    def cancel(self) -> None:
        if self._row is not None:
            self._row.cancel.set()

    def wait(self) -> None:
        """Block until the model is done with this generation (after `cancel()`: within one token)."""
        if self._row is not None:
            self._row.done.wait()

    def __iter__(self) -> Iterator[str]:
        if self._iterated:
            raise RuntimeError("a Generation can be iterated once")
        self._iterated = True
        self.start()
        tokens = self._row.tokens
        stops = self.engine.stop_ids
        decoder = IncrementalDecoder(self.engine.tokenizer, self.engine.tokenizer_lock, self.keep_tokens)
        pending = ""  # decoded text not yet given out: it may be the start of a stop string
        try:
            while (item := tokens.get()) is not END:
                if isinstance(item, BaseException):
                    raise item
                if self.finish_reason is not None:
                    continue  # a token generated after a stop string, before the scheduler noticed
                self.completion_tokens += 1
                if item in stops:
                    self.finish_reason = "stop"
                    continue
                pending += decoder.push(item)
                hits = [i for i in (pending.find(s) for s in self.options.stop) if i >= 0]
                if hits:
                    yield from self._emit(pending[: min(hits)])
                    pending, self.finish_reason = "", "stop"
                    self._row.cancel.set()
                    decoder = None  # nothing after a stop string is given out
                    continue
                keep = _held_back(pending, self.options.stop)
                yield from self._emit(pending[: len(pending) - keep])
                pending = pending[len(pending) - keep :]
            if decoder is not None:  # what was held back: a possible stop string's start, or bytes of no full character
                yield from self._emit(pending + decoder.flush())
            self.finish_reason = self.finish_reason or "length"
        finally:
            self._row.cancel.set()  # no-op when generation already ended; the scheduler drops the row

    def _emit(self, piece: str) -> Iterator[str]:
        if piece:
            self.text += piece
            yield piece

    def _batch_row(self) -> BatchRow:
        options = self.options
        return BatchRow(
            prompt_ids=self.prompt_ids, max_new_tokens=self.max_new_tokens, temperature=options.temperature,
            top_p=options.top_p, top_k=options.top_k, repetition_penalty=options.repetition_penalty, seed=options.seed,
            image_inputs=self.image_inputs,
        )


class ChatEngine:
    """A loaded model, its tokenizer and chat template; `generate(messages)` streams the next answer.

    `max_batch_size`: how many generations may share the model's forward passes (the API raises it; 1 runs
    them one after another).
    """

    def __init__(self, model, tokenizer, template: Template, name: str, template_kwargs: dict[str, Any] | None = None,
                 processor: Any = None):
        self.model, self.tokenizer, self.template, self.name = model, tokenizer, template, name
        self.processor = processor  # a vision-language model's (images in messages); None: text only
        self.template_kwargs = template_kwargs or {}  # the template variables the model trained with
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        # The template's end-of-turn ids, the tokenizer's eos and whatever the folder's generation_config adds.
        self.stop_ids = sorted(set(stop_token_ids(tokenizer, template)) | set(eos))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.context_length = _context_length(model, tokenizer)
        self.tokenizer_lock = threading.Lock()
        self.scheduler = BatchScheduler(model, self.stop_ids, self.pad_id)

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        if value < 1:
            raise ConfigError(f"--max-batch-size: expected an integer >= 1, got {value}")
        self.scheduler.max_batch_size = value

    @cached_property
    def tool_syntax(self) -> ToolSyntax | None:
        """How this model's template writes tool calls (None: it has no tool-call format), from a probe render."""
        return tool_syntax(self.template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "")

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (added tokens included): an upper bound on the characters one
        token stands for (byte-level entries spell one byte a character, SentencePiece ones spell the text itself;
        it assumes no normalizer that deletes characters)."""
        with self.tokenizer_lock:
            return max(map(len, self.tokenizer.get_vocab()), default=1) or 1

    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, prefill: str = ""
    ) -> list[int]:
        """The conversation rendered with the generation prompt (+ `prefill`), tokenised as training tokenised it."""
        return self.prompt_inputs(messages, tools, prefill)[0]

    def prompt_inputs(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, prefill: str = ""
    ) -> tuple[list[int], dict[str, Any]]:
        """(prompt ids, image tensors for the model: {} without images). Image parts (infer/images.py) become
        the processor's expansion of each image, as data/vision.py encodes training rows.

        InferenceError, without tokenising, when the text has more characters than `context_length` tokens can
        spell (see longest_token_chars); when images reach a text-only model, or placeholders and images differ."""
        tok = self.tokenizer
        messages, refs = split_images(messages)
        messages = template_shapes(messages, self.template)  # call turns as training rendered them
        if refs and self.processor is None:
            raise ImageInputError(f"{self.name} is a text-only model and cannot read images; "
                                 "send text only, or load a vision-language model")
        prompt = self.template.prompt(
            messages, tools, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "", **self.template_kwargs
        )
        image_inputs: dict[str, Any] = {}
        if self.processor is not None and (refs or IMAGE_PLACEHOLDER in prompt):
            prompt, image_inputs = self._with_images(prompt, refs)
        text = prompt + prefill
        if self.context_length and len(text) > self.longest_token_chars * self.context_length:
            # No token covers more characters than its vocabulary string has, so this many characters are more
            # tokens than the context holds: refused without tokenising (a huge prompt would hold the lock).
            at_least = -(-len(text) // self.longest_token_chars)
            raise InferenceError(
                f"the conversation is at least {at_least} tokens ({len(text)} characters); {self.name} reads at "
                f"most {self.context_length}: start a new conversation or shorten it"
            )
        with self.tokenizer_lock:
            # The prompt alone, then what the answer starts with: the ids training gave this prompt (data/encode.py).
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            return ids + (tok(prefill, add_special_tokens=False)["input_ids"] if prefill else []), image_inputs

    def _with_images(self, prompt: str, refs: list[Any]) -> tuple[str, dict[str, Any]]:
        """The prompt with each `<image>` replaced by the processor's expansion of its image, and the image tensors."""
        pieces = prompt.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(refs):
            raise ImageInputError(f"the conversation has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders and "
                                 f"{len(refs)} images; give one image per placeholder")
        try:
            images = open_images(refs)
        except DataError as exc:
            raise ImageInputError(str(exc)) from None
        with self.tokenizer_lock:
            texts = expansions(self.processor, images)
            tensors = {k: v.to(self.device) for k, v in image_inputs(self.processor, images).items()}
        prompt = pieces[0] + "".join(text + piece for text, piece in zip(texts, pieces[1:], strict=True))
        if tensors.get("pixel_values") is not None:
            tensors["pixel_values"] = tensors["pixel_values"].to(next(self.model.parameters()).dtype)
        return prompt, tensors

    def generate(
        self, messages: Sequence[Message], options: SamplingOptions, tools: Sequence[dict] | None = None,
        prefill: str = "",
    ) -> Generation:
        """The next assistant answer (not started until iterated). InferenceError when the prompt fills the context.

        `tools` (OpenAI's function schemas) are rendered by the template; the answer then keeps the tool-call
        opening tokens in its text even when they are special tokens, so that tool_calls.py can find the calls.
        """
        ids, image_inputs = self.prompt_inputs(messages, tools, prefill)
        room = self.context_length - len(ids) if self.context_length else None
        if room is not None and room < 1:
            raise InferenceError(
                f"the conversation is {len(ids)} tokens; {self.name} reads at most {self.context_length}: "
                "start a new conversation or shorten it"
            )
        max_new = options.max_new_tokens or room or 2048
        keep = self._opening_tokens if tools else {}
        return Generation(self, ids, options, min(max_new, room) if room else max_new, prefill, keep,
                          image_inputs=image_inputs)

    def start(self, generations: Sequence[Generation]) -> None:
        """Queue several generations at once: they share batches as far as max_batch_size allows."""
        rows = []
        for generation in generations:
            if generation._row is None:
                generation._row = generation._batch_row()
                rows.append(generation._row)
        self.scheduler.submit(*rows)

    def complete(self, messages: Sequence[Message], options: SamplingOptions, **kwargs: Any) -> Generation:
        """generate(), run to the end."""
        generation = self.generate(messages, options, **kwargs)
        for _ in generation:
            pass
        return generation

    @cached_property
    def _opening_tokens(self) -> dict[int, str]:
        """The tool-call openings that are one special token (e.g. Mistral's [TOOL_CALLS]), which decoding drops."""
        syntax, kept, tok = self.tool_syntax, {}, self.tokenizer
        for opening in syntax.openings if syntax else ():
            with self.tokenizer_lock:
                ids = tok(opening, add_special_tokens=False)["input_ids"]
                if len(ids) == 1 and not tok.decode(ids, skip_special_tokens=True) and tok.decode(ids) == opening:
                    kept[ids[0]] = opening
        return kept


def _context_length(model, tokenizer) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    length = getattr(config, "max_position_embeddings", None)
    if isinstance(length, int) and length > 0:
        return length
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < 10**8 else None  # 1e30: "no limit recorded"
