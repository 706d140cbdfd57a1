"""The chat models the serving tests talk to, and the plain transformers + peft reference they must equal.

The chat model: the embedded tiny Llama plus a LoRA adapter that memorised four answers, built in seconds
with plain LoRA steps (a `tunelab train` run that learns as much takes ~25 s on 2 CPU cores; here the
serving code is under test, not training). Saved the way a tunelab run saves its output: the adapter folder
holds the adapter, the tokenizer with the chatml chat template and a generation_config whose eos ids are the
end-of-turn tokens; `merged` is the same model as a whole folder. The answers contain multi-byte characters
that the byte-level tokenizer splits across several tokens.

The tool model: the same recipe with the `default` template (tools as JSON lines, calls as
<tool_call>{...}</tool_call>) on two conversations with a weather tool: one that calls it and answers from
its result, one that needs no tool.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data.collate import SupervisedCollator
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.train.losses import causal_lm_loss, kept_pairs

CONVERSATIONS = [
    (None, [("Say hi", "Hi! 你好 🙂")]),
    (None, [("Say hi", "Hi! 你好 🙂"), ("Again", "Hi again!")]),
    (None, [("Count", "one two three")]),
    ("Be brief.", [("Count", "1 2 3")]),
]


@dataclass(frozen=True)
class ChatModel:
    adapter: Path  # LoRA adapter folder on the embedded tiny Llama
    merged: Path  # the same weights merged into a whole model folder


def messages(system: str | None, turns: list[tuple[str, str | None]]) -> list[dict]:
    """Chat messages; a turn whose answer is None ends the list (the prompt for that answer)."""
    out = [{"role": "system", "content": system}] if system else []
    for question, answer in turns:
        out.append({"role": "user", "content": question})
        if answer is not None:
            out.append({"role": "assistant", "content": answer})
    return out


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}
WEATHER_QUESTION, WEATHER_RESULT, WEATHER_ANSWER = "Weather in Paris?", "18°C, sunny", "It is 18°C and sunny in Paris."
WEATHER_CALL = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def _turn(role: str, content: str, tool_calls: str = "", tool_call_id: str = "") -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": tool_calls, "tool_call_id": tool_call_id}


TOOL_CONVERSATIONS = [
    [
        _turn("user", WEATHER_QUESTION),
        _turn("assistant", "", tool_calls=json.dumps([WEATHER_CALL])),
        _turn("tool", WEATHER_RESULT, tool_call_id="call_1"),
        _turn("assistant", WEATHER_ANSWER),
    ],
    [_turn("user", "Say hi"), _turn("assistant", "Hi!")],
]


def build_chat_model(folder: Path) -> ChatModel:
    """Train the chat adapter (80 LoRA steps, one thread) and save both folders under `folder`."""
    with _one_thread():
        tokenizer, template = AutoTokenizer.from_pretrained(TINY_MODEL_DIR), "chatml"
        rows = [{"system": system or "", "messages": messages(None, turns)} for system, turns in CONVERSATIONS]
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR),
            LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"),
        )
        template = _fit(model, tokenizer, template, rows, steps=80, lr=2e-3)
        adapter, merged = folder / "adapter", folder / "merged"
        for out in (adapter, merged):
            _save_tokenizer_and_generation_config(model, tokenizer, template, out)
        model.save_pretrained(adapter)
        model.merge_and_unload().save_pretrained(merged)
    return ChatModel(adapter=adapter, merged=merged)


def build_tool_model(folder: Path) -> Path:
    """Fine-tune the whole tiny model on the tool conversations (80 steps, one thread); returns its folder.

    Full fine-tuning: the tool prompts are ~200 tokens and LoRA needs several times more steps to learn them.
    """
    with _one_thread():
        tokenizer, model = AutoTokenizer.from_pretrained(TINY_MODEL_DIR), AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
        rows = [{"system": "", "messages": turns, "tools": json.dumps([WEATHER_TOOL])} for turns in TOOL_CONVERSATIONS]
        template = _fit(model, tokenizer, "default", rows, steps=80, lr=3e-3)
        _save_tokenizer_and_generation_config(model, tokenizer, template, folder)
        model.save_pretrained(folder)
    return folder


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fit(model, tokenizer, template_name: str, rows: list[dict], steps: int, lr: float):
    """Plain AdamW steps on all the rows' examples in one batch; returns the template."""
    template = get_template(template_name, tokenizer)
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=template, cutoff_len=512)
    examples = [{"input_ids": e["input_ids"], "labels": e["labels"]} for kept in encoder.encode_rows(rows) for e in kept]
    batch = SupervisedCollator(tokenizer.pad_token_id)(examples)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        causal_lm_loss(logits, batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    _check_memorised(model, batch)
    return template


@torch.no_grad()
def _check_memorised(model, batch, least_margin: float = 2.0) -> None:
    """Every answer token must beat the runner-up by a wide logit margin: the serving tests compare exact texts,
    and a near tie flips with the CPU's kernels (at lr 5e-3 the least margin was -0.7 with an AMX Xeon's AVX-512
    kernels and 4.9 with its AVX2 ones)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logits, targets = kept_pairs(logits, batch["labels"])
    target_logits = logits.gather(1, targets[:, None])[:, 0]
    runner_up = logits.scatter(1, targets[:, None], float("-inf")).amax(dim=1)
    margin = (target_logits - runner_up).min().item()
    assert margin >= least_margin, f"the fixture model did not memorise its answers: least logit margin {margin:.2f}"


def _save_tokenizer_and_generation_config(model, tokenizer, template, folder: Path) -> None:
    """As a tunelab run saves them: the chat template in the tokenizer, the end-of-turn ids as eos ids."""
    tokenizer.chat_template = template.jinja
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, template)
    tokenizer.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


class Reference:
    """The adapter through plain transformers + peft: apply_chat_template, then model.generate."""

    def __init__(self, adapter: Path):
        self.tokenizer = AutoTokenizer.from_pretrained(adapter)
        self.generation_config = GenerationConfig.from_pretrained(adapter)
        self.model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), adapter).eval()

    def prompt_ids(self, chat: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def generate(self, chat: list[dict], max_new_tokens: int = 48, seed: int | None = None, **sampling) -> list[int]:
        """Generated ids, the end-of-turn id included when it came. Greedy unless sampling options are given."""
        ids = torch.tensor([self.prompt_ids(chat)])
        if seed is not None:
            torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), eos_token_id=self.generation_config.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id, max_new_tokens=max_new_tokens, do_sample=bool(sampling), **sampling,
        )
        return out[0, ids.shape[1]:].tolist()

    def answer(self, chat: list[dict], **kwargs) -> str:
        ids = self.generate(chat, **kwargs)
        if ids and ids[-1] in self.generation_config.eos_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@contextmanager
def api_server(arguments: list[str], log: Path) -> Iterator[tuple[str, int, int]]:
    """`tunelab api ARGUMENTS --port 0` in a subprocess, yielding (host, port, pid) once uvicorn says where it
    listens; stopped with Ctrl-C (uvicorn's graceful shutdown), which must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the test process (one_torch_thread): identical kernels
    argv = [sys.executable, "-m", "tunelab.cli", "api", *arguments, "--port", "0"]
    with log.open("w") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while not (started := re.search(r"Uvicorn running on http://(127\.0\.0\.1):(\d+)", log.read_text())):
            assert process.poll() is None, f"the server exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not start: {log.read_text()}"
            time.sleep(0.2)
        yield started.group(1), int(started.group(2)), process.pid
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
