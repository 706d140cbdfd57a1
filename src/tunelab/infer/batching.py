"""Dynamic batching: concurrent generations of one ChatEngine share the model's forward passes.

    Generation (engine.py) → BatchScheduler.submit(row) → a queue
    the scheduler thread: the first waiting row plus those that arrive within BATCH_WINDOW_S, up to max_batch_size
      → prompts left-padded (attention mask 0 on the padding; generate derives the position ids from the mask)
      → one model.generate for the batch, greedy at generate's level, with
          RowSampler  per row: its repetition penalty; when it samples, its temperature / top-k / top-p and a draw
                      from its own torch.Generator, written back as a row where only the drawn token can win
          RowStops    a row ends at a stop id, at its own max_new_tokens, or once its consumer cancelled it
      → each step's token of a live row goes to that row's queue; a row that ended gets the end marker at once,
        so a short answer comes back while its longer batch mates continue.

A batch runs until its last row ends: an ended row's slot is padding until then, and requests that arrive
meanwhile wait for the next batch (no joining a running batch). A batch of one is exactly plain
model.generate on the unpadded prompt; in a larger batch, padding changes the order of floating-point sums,
so logits can differ in their last bits (greedy answers stay equal unless two tokens tie that closely).

Seeds: each sampling row draws from its own generator (seeded with the request's seed, else at random), so a
row's randomness does not depend on which requests share its batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

# How long an idle scheduler waits for companions of a first request. Requests that arrive while a batch
# runs need no window: they are all waiting when it ends.
BATCH_WINDOW_S = 0.01

END = object()  # the marker after a row's last token (an exception may come before it)


@dataclass
class BatchRow:
    """One generation's place in a batch: its prompt, limits and sampling, and the queue its tokens go to."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    image_inputs: dict[str, Any] = field(default_factory=dict)  # a vision model's tensors for this prompt's images
    tokens: queue.Queue = field(default_factory=queue.Queue)  # token ids, then END
    cancel: threading.Event = field(default_factory=threading.Event)  # set by the consumer
    done: threading.Event = field(default_factory=threading.Event)  # set once END is queued
    generated: int = 0

    def finish(self, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        if error is not None:
            self.tokens.put(error)
        self.tokens.put(END)
        self.done.set()


class BatchScheduler:
    """Runs every generation of one model in a single thread, several rows per forward pass."""

    def __init__(self, model, stop_ids: Sequence[int], pad_id: int, max_batch_size: int = 1):
        self.model, self.stop_ids, self.pad_id = model, list(stop_ids), pad_id
        self.max_batch_size = max_batch_size
        self.batch_sizes: list[int] = []  # one entry per batch run: what the scheduler actually grouped
        self._waiting: queue.Queue[BatchRow] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._submit_lock = threading.Lock()  # rows submitted together are collected together

    def submit(self, *rows: BatchRow) -> None:
        with self._submit_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tunelab-batch", daemon=True)
                self._thread.start()
            for row in rows:
                self._waiting.put(row)

    def _loop(self) -> None:
        while True:
            batch = [self._waiting.get()]
            deadline = time.monotonic() + BATCH_WINDOW_S
            with self._submit_lock:  # the rest of a submit(*rows) that is under way
                pass
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self._waiting.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            for row in batch:
                if row.cancel.is_set():  # its client left while it waited
                    row.finish()
            batch = [row for row in batch if not row.done.is_set()]
            if batch:
                self.batch_sizes.append(len(batch))
                self.run(batch)

    @torch.no_grad()
    def run(self, rows: list[BatchRow]) -> None:
        """Generate for `rows` together until each has ended; every row receives its tokens, then END."""
        try:
            device = next(self.model.parameters()).device
            width = max(len(row.prompt_ids) for row in rows)
            pads = [width - len(row.prompt_ids) for row in rows]
            padded = [[self.pad_id] * pad + row.prompt_ids for row, pad in zip(rows, pads, strict=True)]
            input_ids = torch.tensor(padded, device=device)
            attention_mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in pads], device=device)
            self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **_image_inputs(rows),
                max_new_tokens=max(row.max_new_tokens for row in rows),
                do_sample=False, repetition_penalty=1.0,  # sampling and penalties are per row (RowSampler)
                eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([RowSampler(rows, pads, device)]),
                stopping_criteria=StoppingCriteriaList([RowStops(rows)]),
                streamer=_Router(rows, self.stop_ids),
            )
        except BaseException as exc:  # noqa: BLE001  (re-raised in each consumer's thread)
            for row in rows:
                row.finish(exc)
        finally:
            for row in rows:
                row.finish()


def _image_inputs(rows: Sequence[BatchRow]) -> dict[str, torch.Tensor]:
    """The rows' image tensors joined along the image axis, in row order: the order in which the model meets
    their image tokens in the batch (as the training collator joins them, data/vision.py)."""
    keys = sorted({key for row in rows for key in row.image_inputs})
    return {key: torch.cat([row.image_inputs[key] for row in rows if key in row.image_inputs]) for key in keys}


class RowSampler(LogitsProcessor):
    """Each row's own penalty and sampling over the batch's next-token scores.

    The same processors, in the same order, that generate() builds for one request (repetition penalty; then
    temperature, top-k, top-p), applied to the row's unpadded ids; then the row's draw, `softmax` and
    `multinomial` as generate samples, but from the row's generator. Greedy rows keep their scores.
    """

    def __init__(self, rows: Sequence[BatchRow], pads: Sequence[int], device: torch.device):
        self.rows, self.pads = rows, pads
        self.steps: list[list[Any]] = [_processors(row) for row in rows]
        self.generators: list[torch.Generator | None] = []
        for row in rows:
            if row.temperature > 0:
                generator = torch.Generator(device=device)
                if row.seed is None:
                    generator.seed()  # a non-deterministic seed
                else:
                    generator.manual_seed(row.seed)
                self.generators.append(generator)
            else:
                self.generators.append(None)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores
        for i, row in enumerate(self.rows):
            steps, generator = self.steps[i], self.generators[i]
            if row.done.is_set() or (not steps and generator is None):
                continue
            ids, row_scores = input_ids[i : i + 1, self.pads[i] :], scores[i : i + 1]
            for step in steps:
                row_scores = step(ids, row_scores)
            if generator is not None:
                token = torch.multinomial(torch.softmax(row_scores, dim=-1), num_samples=1, generator=generator)
                row_scores = torch.full_like(row_scores, -float("inf")).scatter_(1, token, 0.0)
            if out is scores:
                out = scores.clone()
            out[i] = row_scores[0]
        return out


def _processors(row: BatchRow) -> list[Any]:
    steps: list[Any] = []
    if row.repetition_penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(row.repetition_penalty))
    if row.temperature > 0:
        if row.temperature != 1.0:
            steps.append(TemperatureLogitsWarper(row.temperature))
        if row.top_k:
            steps.append(TopKLogitsWarper(top_k=row.top_k))
        if row.top_p < 1.0:
            steps.append(TopPLogitsWarper(top_p=row.top_p))
    return steps


class RowStops(StoppingCriteria):
    """A row is done once _Router ended it (stop id, its own limit) or its consumer cancelled it."""

    def __init__(self, rows: Sequence[BatchRow]):
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        ended = [row.done.is_set() or row.cancel.is_set() for row in self.rows]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)


class _Router(BaseStreamer):
    """generate()'s streamer: skips the prompt, then hands each live row its token of the step."""

    def __init__(self, rows: Sequence[BatchRow], stop_ids: Sequence[int]):
        self.rows, self.stop_ids = rows, set(stop_ids)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for row, token in zip(self.rows, value.reshape(-1).tolist(), strict=True):
            if row.done.is_set():
                continue  # padding after the row's end
            if row.cancel.is_set():
                row.finish()
                continue
            row.tokens.put(token)
            row.generated += 1
            if token in self.stop_ids or row.generated >= row.max_new_tokens:
                row.finish()

    def end(self) -> None:
        pass  # run() ends the rows, also after an exception
