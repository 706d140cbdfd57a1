"""Every export read back through an independent reader and compared with the model as trained.

    report = check_parity(model, tokenizer, chat_template, template_vars, out / "model-q8_0.gguf", kind="gguf",
                          report_path=out / "export_report.json")
    print("\\n".join(report.lines()))

The readers know nothing of tunelab: an exported Hugging Face folder is loaded with plain
`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(folder)`; a GGUF with transformers' GGUF loader
(`from_pretrained(folder, gguf_file=name)`: it rebuilds the tokenizer from the file's metadata and dequantizes the
tensors), and also with llama.cpp itself when the `llama_cpp` package imports. On a few probe conversations
rendered with the run's template they must give:

    the chat template     the exported template (a GGUF's with the template variables baked in) renders every
                          probe exactly as training rendered it
    the token ids         identical ids for every rendered probe (and the same BOS/EOS added to plain text)
    next-token logits     at every position of every probe: within float noise of the trained weights rounded
                          exactly as the file stores them (STORED_TOLERANCE: a wrong layout shows at any type), and
                          within the tensor type's tolerance of the model as trained (TOLERANCES: what rounding or
                          quantization may cost; the measured gap is reported)
    greedy answers        identical for f32 / f16 / bf16, unless where they part the trained model's choice led by
                          less than twice the type's tolerance (a near tie rounding may flip: reported); reported
                          for quantized types

With held-out rows (the run's eval set, or export_check_dataset), it also scores accuracy, the figure a user
cares about: each row's prompt answered greedily by the trained model and by every reader, exact match against the
row's answer. An export that loses more than `max_drop` points fails, naming the type to export instead
(STEP_UP): the logit tolerances bound a ruined model, not a useful one.

The report (ParityReport) serialises to export_report.json and prints short console lines; a mismatch raises
ParityError, one line naming what differs, after the report is written. Logits are computed in float32 on both
sides, so the gaps measure what the export changed (rounding, quantization, a wrong transform), not arithmetic.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, TokenizersBackend

from tunelab.data.templates import Template
from tunelab.errors import ExportError, TemplateError
from tunelab.infer.generate import stop_token_ids

logger = logging.getLogger(__name__)

# Gaps are measured in units of the reference logits' standard deviation at that position, so a model with large
# logits is not held to a tighter bound than one with small ones.
#
# TOLERANCES: the largest gap from the model as trained, per stored type: what rounding / quantization may cost.
# Measured on the embedded tiny model and SmolLM2-135M-Instruct (docs/deploy.md) with headroom; for 4/5-bit types
# it is a bound on a model ruined by quantization, not a promise of quality (the report has the measured gap).
TOLERANCES: dict[str, float] = {
    "f32": 1e-4,
    "f16": 0.05,
    "bf16": 0.25,
    "q8_0": 1.0,
    "q5_1": 8.0,
    "q5_0": 8.0,
    "q4_1": 12.0,
    "q4_0": 12.0,
    # k-quant mixes: a q6_k file sits between q8_0 and the 5-bit types; q5_k_m / q4_k_m as their 5- / 4-bit kin
    "q6_k": 4.0,
    "q5_k_m": 8.0,
    "q4_k_m": 12.0,
    "torchao": 12.0,
}
# STORED_TOLERANCE: the largest gap from the trained weights rounded exactly as the file stores them
# (gguf_writer.rounded_as_stored). transformers dequantizes those very values, so whatever the type, anything above
# float noise means the file is not laid out as written (a tensor transposed, permuted or misnamed).
STORED_TOLERANCE = 1e-3
# Types that store the weights as floats: greedy answers must be those of the model as trained (up to near ties).
FLOAT_TYPES = ("f32", "f16", "bf16")
# What to export instead of a type that lost held-out accuracy: the next type that keeps more of the weights.
STEP_UP = {"f16": "f32", "bf16": "f32", "q8_0": "f16"}
DEFAULT_STEP_UP = "q8_0"

Message = dict[str, Any]

PROBES: tuple[list[Message], ...] = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Add 12 and 30, then say 'done'."}],
    [{"role": "user", "content": "Übersetze «good morning» → 早上好 🙂\n\ttabs,  double  spaces, 3.14159"}],
)
PLAIN_PROBES = ("The capital of France is", "def fibonacci(n):\n    ", "Übersetze «good morning» → 早上好 🙂 3.14159")


class ParityError(ExportError):
    """What was written reads back differently from the model as trained; `report` holds everything measured."""

    def __init__(self, message: str, report: ParityReport | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class ProbeResult:
    prompt: str
    tokens: int
    ids_identical: bool
    max_logit_gap: float  # from the model as trained, in reference standard deviations (see TOLERANCES)
    max_abs_logit_gap: float
    stored_gap: float | None  # from the trained weights rounded as stored (STORED_TOLERANCE); None: not compared
    top1_agreement: float  # share of positions whose most likely next token is the same
    reference_answer: list[int]
    exported_answer: list[int]
    reference_text: str = ""
    exported_text: str = ""
    # Where the answers part: how far the trained model's choice led the exported model's choice there, in sd
    # (None while they agree). Below twice the type's tolerance the swap is a near tie rounding may flip.
    tie_margin: float | None = None
    # llama.cpp's server: how many answer tokens precede the position whose log-probabilities were compared. 0, the
    # first answer token, unless that token ends inside a UTF-8 character: the server gives such a token no
    # log-probabilities, so the comparison moves to the token that completes the character (both models given the
    # tokens before it; -1: no answer token completes a character, nothing compared).
    gap_after_tokens: int = 0

    @property
    def answers_identical(self) -> bool:
        return self.reference_answer == self.exported_answer


@dataclass
class ReaderResult:
    """What one independent reader saw."""

    reader: str  # "transformers" or "llama.cpp"
    template_identical: bool
    ids_identical: bool
    special_tokens_identical: bool  # BOS/EOS added to plain text as the trained tokenizer adds them
    max_logit_gap: float
    max_abs_logit_gap: float
    tolerance: float
    stored_gap: float | None  # None: the check ran without a rounded copy (check_parity's transformers=False)
    stored_tolerance: float
    greedy_identical: bool
    greedy_required: bool
    tokens_per_second: float | None
    probes: list[ProbeResult] = field(default_factory=list)
    accuracy: float | None = None  # exact match on the held-out rows (HeldOut), 0-1
    problems: list[str] = field(default_factory=list)
    # Where the logits were compared: every prompt position, or (llama.cpp's server) the first answer token only
    gap_at: str = "every position"


@dataclass
class MergeResult:
    """Base + adapter against the merged model the export starts from, both in float32 (export/merge.py)."""

    max_logit_gap: float  # in reference standard deviations, worst position of every probe
    tolerance: float

    @property
    def problem(self) -> str | None:
        if self.max_logit_gap <= self.tolerance:
            return None
        return (f"the merged model's logits differ by up to {self.max_logit_gap:.3g} standard deviations from base + "
                f"adapter, where a float32 merge stays within {self.tolerance:g}: the adapter did not merge as it "
                "computes")


@dataclass
class HeldOut:
    """The held-out rows the check scores: where they come from and the trained model's exact match on them."""

    source: str  # the eval set's name
    rows: int
    max_drop: float  # percentage points an export may lose
    reference_accuracy: float = 0.0


@dataclass
class ParityReport:
    kind: str  # "hf" or "gguf"
    path: str
    tensor_type: str
    file_bytes: int
    readers: list[ReaderResult] = field(default_factory=list)
    skipped_probes: list[str] = field(default_factory=list)
    merge: MergeResult | None = None  # set by the export when it merged an adapter
    held_out: HeldOut | None = None
    unreadable: list[str] = field(default_factory=list)  # a reader that could not open the export at all

    @property
    def problems(self) -> list[str]:
        merged = [self.merge.problem] if self.merge is not None and self.merge.problem else []
        return merged + self.unreadable + [problem for reader in self.readers for problem in reader.problems]

    def failure(self) -> str | None:
        """The one line a failed check stops the export with; None when everything matched."""
        if not self.problems:
            return None
        others = len(self.problems) - 1
        more = f" (and {others} more problem(s), see export_report.json)" if others else ""
        return f"export check failed for {Path(self.path).name}: {self.problems[0]}{more}"

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for reader, result in zip(data["readers"], self.readers):
            for probe, probe_result in zip(reader["probes"], result.probes):
                probe["answers_identical"] = probe_result.answers_identical
        return data

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def lines(self) -> list[str]:
        """Short console lines: one per reader, then the problems."""
        size = f"{self.file_bytes / 1e6:.1f} MB"
        out = [f"export check: {self.kind} {Path(self.path).name} ({self.tensor_type}, {size})"]
        if self.merge is not None:
            out.append(f"  merge: base + adapter against the merged model, max logit gap {self.merge.max_logit_gap:.3g} "
                       f"sd (tolerance {self.merge.tolerance:g})")
        for r in self.readers:
            speed = f", {r.tokens_per_second:.1f} tokens/s" if r.tokens_per_second else ""
            ties = all(p.tie_margin is not None and p.tie_margin <= 2 * r.tolerance
                       for p in r.probes if not p.answers_identical)
            greedy = ("identical" if r.greedy_identical else "differ (reported)" if not r.greedy_required
                      else "differ at a near tie (reported)" if ties else "DIFFERENT")
            out.append(
                f"  {r.reader}: template {'same' if r.template_identical else 'DIFFERENT'}, ids "
                f"{'same' if r.ids_identical and r.special_tokens_identical else 'DIFFERENT'}, max logit gap "
                f"{'' if r.gap_at == 'every position' else f'at the {r.gap_at} '}{r.max_logit_gap:.3g} sd "
                f"({r.max_abs_logit_gap:.3g} abs; tolerance {r.tolerance:g}), "
                f"{'' if r.stored_gap is None else f'{r.stored_gap:.2g} sd from the weights as stored, '}"
                f"greedy answers {greedy}{speed}"
            )
            moved = [f"probe {n}: " + (f"answer token {p.gap_after_tokens + 1}" if p.gap_after_tokens > 0 else
                                       "none, no answer token completes one") for n, p in enumerate(r.probes, 1)
                     if p.gap_after_tokens]
            if moved:
                out.append(f"    (compared at the token that completes the first character, where the first ends "
                           f"inside one: {', '.join(moved)})")
        if self.held_out is not None:
            h = self.held_out
            scores = ", ".join(f"{r.reader} {100 * r.accuracy:.1f}%" for r in self.readers if r.accuracy is not None)
            out.append(f"  held-out exact match ({h.rows} rows of {h.source}, greedy): trained "
                       f"{100 * h.reference_accuracy:.1f}%, {scores} (allowed drop {h.max_drop:g} points)")
        out.extend(f"  problem: {problem}" for problem in self.problems)
        return out


def check_parity(
    reference_model: torch.nn.Module,
    tokenizer: Any,
    chat_template: str | None,
    template_vars: Mapping[str, Any] | None,
    exported: str | Path,
    kind: str,
    *,
    probes: Sequence[list[Message]] | None = None,
    max_new_tokens: int = 16,
    llama_cpp: bool | None = None,
    report_path: str | Path | None = None,
    raise_on_mismatch: bool = True,
    held_out: tuple[str, Sequence[tuple[list[Message], str]]] | None = None,
    max_drop: float = 5.0,
    held_out_tokens: int = 64,
    transformers: bool = True,
    reference_accuracy: float | None = None,
) -> ParityReport:
    """Read `exported` back (kind "hf": a model folder, "gguf": a .gguf file) and compare it with `reference_model`
    and `tokenizer` on `probes` rendered with `chat_template` + `template_vars`.

    `llama_cpp`: also read a GGUF with llama.cpp (None: when xllamacpp or llama_cpp imports; llama_cpp_reader).
    Writes the report to `report_path` when given, then raises ParityError if anything differs beyond tolerance
    (unless `raise_on_mismatch` is False). `held_out`: (name, [(prompt messages, reference answer)]) to score with
    exact match, `held_out_tokens` answer tokens at most; an export more than `max_drop` points below the trained
    model is a problem. `transformers=False` (a GGUF read by llama.cpp, which must then be installed): neither
    transformers' reading nor the copy rounded as stored, two of the check's three float32 copies of the model, for
    a model too large to hold them (its gaps are then from the model as trained only). `reference_accuracy`: the
    trained model's exact match on `held_out`, where an earlier check of the same model scored it (one model written
    in several types), instead of answering every row again.
    """
    exported = Path(exported)
    if kind not in ("hf", "gguf"):
        raise ValueError(f"kind must be 'hf' or 'gguf', not {kind!r}")
    texts, skipped, _ = _rendered_probes(chat_template, template_vars, tokenizer, probes)
    tensor_type = _gguf_type(exported) if kind == "gguf" else _hf_type(exported)
    file_bytes = exported.stat().st_size if exported.is_file() else sum(
        p.stat().st_size for p in exported.rglob("*") if p.is_file())
    report = ParityReport(kind, str(exported), tensor_type, file_bytes, skipped_probes=skipped)
    stops = _stop_ids(tokenizer, chat_template)
    reference = TransformersReader("reference", reference_model, tokenizer, chat_template)
    if not transformers and (kind != "gguf" or llama_cpp is False or not llama_cpp_available()):
        raise ValueError("check_parity(transformers=False) reads a GGUF with llama.cpp alone: it needs kind 'gguf' "
                         "and xllamacpp (or llama_cpp) installed")
    stored = _rounded_reference(reference_model, tokenizer, kind, tensor_type) if transformers else None
    expected_template = chat_template
    if kind == "gguf":
        # lazy: gguf_writer imports gguf: the gguf extra; GGUF exports only
        from tunelab.export.gguf_writer import embedded_chat_template

        expected_template = embedded_chat_template(chat_template, template_vars)
    # A GGUF's template has the variables baked in; a folder's is rendered with them (tunelab_config.yaml).
    reader_vars = {} if kind == "gguf" else dict(template_vars or {})

    scored = None
    if held_out is not None and chat_template is not None:
        name, rows = held_out
        scored = _held_out_prompts(rows, chat_template, template_vars, tokenizer)
        report.held_out = HeldOut(name, len(rows), max_drop)
        report.held_out.reference_accuracy = (_accuracy(reference, tokenizer, scored, stops, held_out_tokens)
                                              if reference_accuracy is None else reference_accuracy)
    readers: list[Any] = [_transformers_reader(exported, kind)] if transformers else []
    if kind == "gguf" and (llama_cpp or (llama_cpp is None and llama_cpp_available())):
        try:
            readers.append(llama_cpp_reader(exported))
        except Exception as exc:  # noqa: BLE001 - llama.cpp refusing the file is the finding, not a crash
            reason = str(exc).strip() or type(exc).__name__
            report.unreadable.append(f"llama.cpp could not load {exported.name}: {reason}")
    for reader in readers:
        try:
            result = _compare(reference, stored, reader, tokenizer, texts, chat_template, expected_template,
                              reader_vars, tensor_type, kind, stops, max_new_tokens, probes)
            if scored is not None:
                result.accuracy = _accuracy(reader, tokenizer, scored, stops, held_out_tokens)
                result.problems += _accuracy_problems(report.held_out, result, tensor_type)
        finally:
            reader.close()  # llama.cpp's server stops here: it lives as long as its comparison
        report.readers.append(result)
    if report_path is not None:
        report.write(report_path)
    for line in report.lines():
        logger.debug(line)  # the caller prints them (tunelab export does)
    if raise_on_mismatch and report.problems:
        raise ParityError(report.failure(), report)
    return report


def probe_ids(tokenizer: Any, chat_template: str | None, template_vars: Mapping[str, Any] | None,
              probes: Sequence[list[Message]] | None = None) -> list[list[int]]:
    """The probe conversations rendered with the run's template (plain texts without one), as token ids."""
    texts, _, _ = _rendered_probes(chat_template, template_vars, tokenizer, probes)
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


def logit_gap(reference: torch.Tensor, other: torch.Tensor) -> float:
    """The largest gap between two [positions, vocab] logit tensors, in the reference's standard deviations at each
    position (the unit of TOLERANCES)."""
    scale = reference.std(dim=-1, keepdim=True).clamp_min(1e-6)
    return float(((reference - other).abs() / scale).max())


def llama_cpp_available() -> bool:
    """Whether llama.cpp can read here: xllamacpp (the `llamacpp` extra, a prebuilt wheel) or llama-cpp-python."""
    return _importable("xllamacpp") or _importable("llama_cpp")


def llama_cpp_reader(path: Path) -> Any:
    """llama.cpp reading `path`: its server through xllamacpp when that imports, else llama-cpp-python."""
    return LlamaCppServerReader(path) if _importable("xllamacpp") else LlamaCppReader(path)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken build is as good as none
        return False
    return True


# ----------------------------------------------------------------------------------------------------- readers


class TransformersReader:
    """A model + tokenizer in this process: the reference, an exported folder, or a GGUF through transformers."""

    def __init__(self, name: str, model: torch.nn.Module, tokenizer: Any, template: str | None):
        self.name, self.model, self.tokenizer, self.template = name, model.eval(), tokenizer, template
        self.seconds, self.generated = 0.0, 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        return self.model(torch.tensor([ids], device=device)).logits[0].float().cpu()

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
        device = next(self.model.parameters()).device
        start = time.perf_counter()
        out = self.model.generate(
            torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
        )[0, len(ids):].tolist()
        self.seconds += time.perf_counter() - start
        self.generated += len(out)
        return out

    def tokens_per_second(self) -> float | None:
        return self.generated / self.seconds if self.seconds else None

    def close(self) -> None:
        pass


class LlamaCppReader:
    """A GGUF read by llama.cpp itself (llama-cpp-python, where it is installed and xllamacpp is not): its own
    tokenizer, graph and kernels, on CPU."""

    name = "llama.cpp (llama-cpp-python)"

    def __init__(self, path: Path, n_ctx: int = 1024):
        from llama_cpp import Llama  # lazy: optional: only where llama-cpp-python is installed

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_gpu_layers=0)
        self.template = self.llm.metadata.get("tokenizer.chat_template")
        self.seconds, self.generated = 0.0, 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True))

    def decode(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids, special=True).decode("utf-8", errors="replace")

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.from_numpy(self.llm.scores[: len(ids)].copy()).float()

    def greedy(self, ids: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            out.append(token)
            if token in stops:
                break
            self.llm.eval([token])
        self.seconds += time.perf_counter() - start
        self.generated += len(out)
        return out

    def tokens_per_second(self) -> float | None:
        return self.generated / self.seconds if self.seconds else None

    def close(self) -> None:
        self.llm.close()


class LlamaCppServerReader:
    """A GGUF read by llama.cpp's own server (xllamacpp: llama.cpp's C++ server in this process), asked over HTTP on
    127.0.0.1 as Ollama's and LM Studio's clients ask theirs: /apply-template renders with llama.cpp's Jinja,
    /tokenize and /detokenize use its tokenizer, /completion gives greedy answers with the log-probabilities of the
    top FIRST_TOKEN_TOP tokens at each step. It has no endpoint for the logits of every prompt position, so the
    logits are compared at the first answer token only (first_token_logprobs). The server lives until close()."""

    name = "llama.cpp (xllamacpp server)"
    FIRST_TOKEN_TOP = 20
    TIMEOUT_S = 300  # one request; a server that stops answering fails the check instead of hanging it

    def __init__(self, path: Path, n_ctx: int = 4096):
        import xllamacpp  # lazy: the llamacpp extra, which may be missing

        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx, params.n_parallel, params.warmup, params.verbosity = n_ctx, 1, False, -1
        # half the cores: llama.cpp's threads spin at each barrier, and the reference model runs beside it
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        params.hostnames, params.port = ["127.0.0.1"], 0  # loopback only, on a free port
        params.use_jinja = True
        self.server = xllamacpp.Server(params)
        self.address = self.server.listening_address
        self.template = self._get("/props").get("chat_template")
        self.answers: dict[tuple[int, ...], dict[str, Any]] = {}
        self.generated, self.seconds = 0, 0.0

    def _get(self, endpoint: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.address + endpoint, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.TIMEOUT_S) as response:  # noqa: S310 - our loopback
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # e.g. a prompt longer than the context: llama.cpp says why
            detail = exc.read().decode("utf-8", errors="replace")[:300]
            raise ExportError(f"export check: llama.cpp's server answered {endpoint} with HTTP {exc.code}: "
                              f"{detail}") from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise ExportError(f"export check: llama.cpp's server did not answer {endpoint} ({exc})") from None

    def render(self, messages: list[Message]) -> str:
        """The prompt llama.cpp's own Jinja engine renders from the GGUF's template (llama-server --jinja)."""
        return self._get("/apply-template", {"messages": messages})["prompt"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._get("/tokenize", {"content": text, "add_special": add_special_tokens,
                                       "parse_special": True})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._get("/detokenize", {"tokens": ids})["content"]

    def _answer(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        key = (*ids, max_new_tokens)
        if key not in self.answers:
            self.answers[key] = self._get("/completion", {
                "prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "n_probs": self.FIRST_TOKEN_TOP,
                "cache_prompt": False, "return_tokens": True})
            timings = self.answers[key].get("timings", {})
            self.generated += timings.get("predicted_n", 0)
            self.seconds += timings.get("predicted_ms", 0.0) / 1000
        return self.answers[key]

    def first_token_logprobs(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
        """The ids and log-probabilities (over the whole vocabulary) of llama.cpp's top tokens at its first answer
        position that has them, and its answer tokens before that position. The server gives no log-probabilities
        for a token that ends inside a UTF-8 character (a byte of 'Ü' or of an emoji): it reports the next token,
        with the whole character as its text, so its first entry is then a later position."""
        answer = self._answer(ids, max_new_tokens)
        entries = answer.get("completion_probabilities") or []
        if not entries:  # every answer token ended inside a character: no position to compare
            return [], [], torch.empty(0)
        tokens = answer["tokens"]
        at = tokens.index(entries[0]["id"]) if entries[0]["id"] in tokens else 0
        top = entries[0]["top_logprobs"]
        return tokens[:at], [t["id"] for t in top], torch.tensor([t["logprob"] for t in top], dtype=torch.float32)

    def greedy(self, ids: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
        out: list[int] = []
        for token in self._answer(ids, max_new_tokens)["tokens"]:
            out.append(token)
            if token in stops:
                break
        return out

    def tokens_per_second(self) -> float | None:
        return self.generated / self.seconds if self.seconds else None  # llama.cpp's own generation timings

    def close(self) -> None:
        self.server = None  # xllamacpp stops the server and frees the model when its Server is released


def _transformers_reader(exported: Path, kind: str) -> TransformersReader:
    if kind == "hf":
        vision = "vision_config" in json.loads((exported / "config.json").read_text(encoding="utf-8"))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM  # probed with text alone
        model = auto.from_pretrained(exported, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(exported)
        name = "transformers"
    else:
        model = AutoModelForCausalLM.from_pretrained(exported.parent, gguf_file=exported.name, dtype=torch.float32)
        try:  # the tokenizer class of the model type the file declares: AutoTokenizer alone would parse it again
            tokenizer = AutoTokenizer.from_pretrained(exported.parent, gguf_file=exported.name,
                                                      tokenizer_type=model.config.model_type)
        except ValueError:  # a model type without a tokenizer class of its own (llama): AutoTokenizer's fallback
            tokenizer = TokenizersBackend.from_pretrained(exported.parent, gguf_file=exported.name)
        name = "transformers (GGUF loader)"
    return TransformersReader(name, model, tokenizer, tokenizer.chat_template)


# ------------------------------------------------------------------------------------------------- comparison


def _rounded_reference(model: torch.nn.Module, tokenizer: Any, kind: str, tensor_type: str) -> TransformersReader:
    """The trained model with its weights rounded as the export stores them (itself when nothing is rounded)."""
    if tensor_type == "f32" or tensor_type not in TOLERANCES or tensor_type == "torchao":
        return TransformersReader("as stored", model, tokenizer, None)
    if kind == "gguf":
        # lazy: gguf_writer imports gguf: the gguf extra; GGUF exports only
        from tunelab.export.gguf_writer import rounded_as_stored

        rounded = rounded_as_stored(model, tensor_type)
    else:  # a folder stores every weight in its dtype; buffers computed at load (rotary frequencies) stay float32
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[tensor_type]
        rounded = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in rounded.parameters():
                parameter.copy_(parameter.to(dtype))
    return TransformersReader("as stored", rounded, tokenizer, None)


def _compare(reference: TransformersReader, stored: TransformersReader | None, reader: Any, tokenizer: Any,
             texts: list[str], chat_template: str | None, expected_template: str | None, reader_vars: dict[str, Any],
             tensor_type: str, kind: str, stops: list[int], max_new_tokens: int,
             probes: Sequence[list[Message]] | None) -> ReaderResult:
    what = "GGUF" if kind == "gguf" else "exported folder"
    who = f"the {what}'s" if reader.name.startswith("transformers") else f"llama.cpp's reading of the {what}:"
    problems: list[str] = []
    template_ok = reader.template == expected_template
    if hasattr(reader, "render") and reader.template is not None and expected_template is not None:
        # llama.cpp's /props gives the template with trailing whitespace trimmed; its renders are compared below
        template_ok = reader.template.rstrip() == expected_template.rstrip()
    if not template_ok:
        problems.append(f"{who} chat template {_template_difference(reader.template, expected_template)}")
    elif chat_template is not None:
        # The exported template, rendered as that runtime would (llama.cpp's server: by its own Jinja engine),
        # gives the text training rendered.
        exported_texts, _, kept = _rendered_probes(reader.template, reader_vars, tokenizer, probes)
        expected_texts = texts
        if hasattr(reader, "render"):
            exported_texts = [reader.render(messages) for messages in kept]
            expected_texts = llama_cpp_renders(texts, tokenizer, reader)
        if exported_texts != expected_texts:
            template_ok = False
            problems.append(f"{who} chat template renders the probes differently from the trained one")

    bos_probe = "Hello world"
    special_ok = reference.encode(bos_probe, True) == reader.encode(bos_probe, True)
    if not special_ok:
        problems.append(
            f"{who} tokenizer adds {reader.encode(bos_probe, True)} to 'Hello world', the trained one "
            f"{reference.encode(bos_probe, True)} (BOS/EOS flags)"
        )

    tolerance = TOLERANCES.get(tensor_type, TOLERANCES["q4_0"])
    greedy_required = tensor_type in FLOAT_TYPES
    results = []
    for text in texts:
        ids = reference.encode(text)
        exported_ids = reader.encode(text)
        same_ids = ids == exported_ids
        if not same_ids and not any(p.startswith(f"{who} tokenizer") for p in problems):
            problems.append(f"{who} tokenizer {_ids_difference(reference, reader, text, ids, exported_ids)}")
        # Logits and answers are compared on the trained ids, so a tokenizer problem does not hide a weight one.
        if hasattr(reader, "logits"):
            gaps, vocab_problem = _logit_gaps(reference, stored, reader, ids)
        else:
            gaps, vocab_problem = _first_token_gaps(reference, stored, reader, ids, max_new_tokens)
        if vocab_problem and not any(p.startswith(f"{who} vocabulary") for p in problems):
            problems.append(f"{who} {vocab_problem}")
        ref_answer = reference.greedy(ids, max_new_tokens, stops)
        exp_answer = reader.greedy(ids, max_new_tokens, stops)
        results.append(ProbeResult(
            prompt=text, tokens=len(ids), ids_identical=same_ids, **gaps,
            reference_answer=ref_answer, exported_answer=exp_answer,
            reference_text=reference.decode(ref_answer), exported_text=_safe_decode(reader, exp_answer),
        ))
    max_gap = max(r.max_logit_gap for r in results)
    max_stored_gap = None if stored is None else max(r.stored_gap for r in results)
    # llama.cpp's kernels also round activations (to q8 in quantized matmuls): from the stored weights it is held to
    # the type's tolerance only.
    stored_tolerance = STORED_TOLERANCE if reader.name.startswith("transformers") else tolerance
    # A torchao folder has no rounded reference (stored is the model as trained): its scheme's tolerance is all.
    if tensor_type == "torchao":
        stored_tolerance = tolerance
    if max_stored_gap is not None and max_stored_gap > stored_tolerance and tensor_type != "torchao":
        worst = max(results, key=lambda r: r.stored_gap)
        problems.append(
            f"{who} logits differ by up to {max_stored_gap:.3g} standard deviations from the trained weights rounded "
            f"as stored ({tensor_type}) on probe {results.index(worst) + 1}, where a faithful file stays within "
            f"{stored_tolerance:g}: a tensor is not laid out as {'llama.cpp' if kind == 'gguf' else 'transformers'} "
            "expects"
        )
    if max_gap > tolerance:
        worst = max(results, key=lambda r: r.max_logit_gap)
        problems.append(
            f"{who} logits differ by up to {max_gap:.3g} standard deviations ({worst.max_abs_logit_gap:.3g} in logits) "
            f"on probe {results.index(worst) + 1}; {tensor_type} is allowed {tolerance:g}"
        )
    greedy_ok = all(r.answers_identical for r in results)
    if greedy_required and not greedy_ok:
        for number, (text, result) in enumerate(zip(texts, results), 1):
            if result.answers_identical:
                continue
            result.tie_margin = _tie_margin(reference, reference.encode(text), result)
            # Rounding may move two logits apart by twice the tolerance: a closer pair may swap legitimately.
            if result.tie_margin > 2 * tolerance:
                problems.append(
                    f"{who} greedy answer to probe {number} is {result.exported_text!r}, the trained model's "
                    f"{result.reference_text!r} (its choice led by {result.tie_margin:.3g} sd where it differs)"
                )
                break
    return ReaderResult(
        reader=reader.name, template_identical=template_ok, ids_identical=all(r.ids_identical for r in results),
        special_tokens_identical=special_ok, max_logit_gap=max_gap,
        max_abs_logit_gap=max(r.max_abs_logit_gap for r in results), tolerance=tolerance,
        stored_gap=max_stored_gap, stored_tolerance=stored_tolerance,
        greedy_identical=greedy_ok, greedy_required=greedy_required,
        tokens_per_second=reader.tokens_per_second(), probes=results, problems=problems,
        gap_at="every position" if hasattr(reader, "logits") else
        f"first answer token (top {reader.FIRST_TOKEN_TOP})",
    )


def _logit_gaps(reference: TransformersReader, stored: TransformersReader | None, reader: Any,
                ids: list[int]) -> tuple[dict[str, float], str | None]:
    """Gaps at every position of `ids` between the reader's logits and the trained / as-stored model's."""
    ref_logits, exp_logits = reference.logits(ids), reader.logits(ids)
    problem = None
    if exp_logits.shape[-1] != ref_logits.shape[-1]:
        problem = f"vocabulary has {exp_logits.shape[-1]} rows, the model {ref_logits.shape[-1]}"
        exp_logits = exp_logits[..., : ref_logits.shape[-1]]
    gap = (ref_logits - exp_logits).abs()
    scale = ref_logits.std(dim=-1, keepdim=True).clamp_min(1e-6)
    stored_logits = None if stored is None else ref_logits if stored.model is reference.model else stored.logits(ids)
    return {"max_logit_gap": float((gap / scale).max()), "max_abs_logit_gap": float(gap.max()),
            "stored_gap": None if stored_logits is None else float(((stored_logits - exp_logits).abs() / scale).max()),
            "top1_agreement": float((ref_logits.argmax(-1) == exp_logits.argmax(-1)).float().mean())}, problem


def _first_token_gaps(reference: TransformersReader, stored: TransformersReader | None, reader: Any, ids: list[int],
                      max_new_tokens: int) -> tuple[dict[str, float], str | None]:
    """Gaps at the first answer token only, on the reader's top tokens: log-probabilities against the trained /
    as-stored model's log-softmax (a log-probability is the logit less one constant per position, so in sd of the
    logits these gaps are logit gaps without that constant). Where the reader has none for the first answer token
    (first_token_logprobs), at the first one it has, after the same answer tokens on both sides."""
    before, top_ids, top_logprobs = reader.first_token_logprobs(ids, max_new_tokens)
    if not top_ids:
        return {"max_logit_gap": 0.0, "max_abs_logit_gap": 0.0, "stored_gap": None if stored is None else 0.0,
                "top1_agreement": float("nan"), "gap_after_tokens": -1}, None
    ids = ids + before
    ref_logits = reference.logits(ids)[-1]
    if max(top_ids) >= ref_logits.shape[-1]:
        return {"max_logit_gap": float("inf"), "max_abs_logit_gap": float("inf"), "stored_gap": float("inf"),
                "top1_agreement": 0.0}, f"vocabulary has ids up to {max(top_ids)}, the model {ref_logits.shape[-1]}"
    scale = float(ref_logits.std().clamp_min(1e-6))
    gap = (torch.log_softmax(ref_logits, -1)[top_ids] - top_logprobs).abs()
    stored_gap = None
    if stored is not None:
        stored_logits = ref_logits if stored.model is reference.model else stored.logits(ids)[-1]
        stored_gap = float((torch.log_softmax(stored_logits, -1)[top_ids] - top_logprobs).abs().max()) / scale
    return {"max_logit_gap": float(gap.max()) / scale, "max_abs_logit_gap": float(gap.max()),
            "stored_gap": stored_gap, "top1_agreement": float(int(ref_logits.argmax()) == top_ids[0]),
            "gap_after_tokens": len(before)}, None


def llama_cpp_renders(texts: list[str], tokenizer: Any, reader: Any) -> list[str]:
    """The trained prompts as llama.cpp's chat code returns them: where its tokenizer adds BOS itself, it drops the
    BOS text a template writes first (Gemma's `{{ bos_token }}`) and adds the token back when it tokenizes the
    prompt, so the model gets the same ids."""
    bos = tokenizer.bos_token
    adds_bos = bool(bos) and reader.encode("Hello world", True)[:1] == [tokenizer.bos_token_id]
    return [text[len(bos):] if adds_bos and text.startswith(bos) else text for text in texts]


def _held_out_prompts(rows: Sequence[tuple[list[Message], str]], chat_template: str,
                      template_vars: Mapping[str, Any] | None, tokenizer: Any) -> list[tuple[list[int], str]]:
    """Each held-out row as (prompt ids rendered with the run's template, reference answer)."""
    template = Template.from_jinja("export", chat_template)
    tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    return [(list(tokenizer(template.prompt(messages, **tokens, **dict(template_vars or {})),
                            add_special_tokens=False)["input_ids"]), answer) for messages, answer in rows]


def _accuracy(reader: Any, tokenizer: Any, scored: list[tuple[list[int], str]], stops: list[int],
              max_new_tokens: int) -> float:
    """Exact match of greedy answers (cut at the first stop token, decoded by the trained tokenizer, stripped) as
    infer/generate.py scores them for `tunelab eval`."""
    hits = 0
    for ids, answer in scored:
        generated = reader.greedy(ids, max_new_tokens, stops)
        cut = next((i for i, token in enumerate(generated) if token in stops), len(generated))
        hits += tokenizer.decode(generated[:cut], skip_special_tokens=True).strip() == answer.strip()
    return hits / max(len(scored), 1)


def _accuracy_problems(held_out: HeldOut, result: ReaderResult, tensor_type: str) -> list[str]:
    drop = 100 * (held_out.reference_accuracy - (result.accuracy or 0.0))
    if drop <= held_out.max_drop:
        return []
    instead = STEP_UP.get(tensor_type, DEFAULT_STEP_UP)
    if tensor_type == "torchao":
        instead, tensor_type = "a folder without export_quantization", "the torchao scheme"
    return [f"{result.reader} scores {100 * result.accuracy:.1f}% exact match on {held_out.rows} held-out rows of "
            f"{held_out.source} where the trained model scores {100 * held_out.reference_accuracy:.1f}% ({drop:.1f} "
            f"points lost; export_check_max_drop {held_out.max_drop:g}): export {instead} instead of {tensor_type}"]


def _tie_margin(reference: TransformersReader, ids: list[int], result: ProbeResult) -> float:
    """How far the trained model's greedy token led the exported model's at the first token where they part."""
    ours, theirs = result.reference_answer, result.exported_answer
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if at >= len(ours) or at >= len(theirs):
        return float("inf")  # one answer stopped where the other went on: not a swap of two close tokens
    logits = reference.logits(ids + ours[:at])[-1]
    return float((logits[ours[at]] - logits[theirs[at]]) / logits.std().clamp_min(1e-6))


def _rendered_probes(chat_template: str | None, template_vars: Mapping[str, Any] | None, tokenizer: Any,
                     probes: Sequence[list[Message]] | None) -> tuple[list[str], list[str], list[list[Message]]]:
    """The probe conversations as inference prompts (plain texts for a model without a template), the probes the
    template refused, and the conversations it rendered."""
    if chat_template is None:
        return list(PLAIN_PROBES), [], []
    template = Template.from_jinja("export", chat_template)
    tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    texts, skipped, kept = [], [], []
    for messages in probes or PROBES:
        try:
            texts.append(template.prompt(messages, **tokens, **dict(template_vars or {})))
            kept.append(messages)
        except TemplateError as exc:  # e.g. Gemma 2 refuses a system turn: that probe does not apply
            skipped.append(f"{messages[0]['role']}: {messages[0]['content'][:40]!r} ({exc})")
    if not texts:
        raise ExportError(f"export check: the chat template refused every probe conversation ({skipped[0]})")
    return texts, skipped, kept


def _stop_ids(tokenizer: Any, chat_template: str | None) -> list[int]:
    if chat_template is None:
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    return stop_token_ids(tokenizer, Template.from_jinja("export", chat_template, bos_token=bos, eos_token=eos))


def _template_difference(found: str | None, expected: str | None) -> str:
    if found is None:
        return "is missing"
    if expected is None:
        return "is present, but the model trained without one"
    at = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
    return (f"differs from the trained one at character {at}: {found[at:at + 30]!r} instead of "
            f"{expected[at:at + 30]!r}")


def _ids_difference(reference: TransformersReader, reader: Any, text: str, ids: list[int],
                    exported_ids: list[int]) -> str:
    """One line naming why the ids differ: a special token split into pieces, else the first differing token."""
    for token in sorted(set(reference.tokenizer.all_special_tokens) | set(reference.tokenizer.get_added_vocab())):
        if token and token in text and len(reference.encode(token)) == 1:
            pieces = reader.encode(token)
            if len(pieces) != 1:
                return f"splits {token!r} into {len(pieces)} tokens"
    at = next((i for i, (a, b) in enumerate(zip(ids, exported_ids)) if a != b), min(len(ids), len(exported_ids)))
    ours = reference.decode(ids[at:at + 1]) if at < len(ids) else "(end)"
    theirs = _safe_decode(reader, exported_ids[at:at + 1]) if at < len(exported_ids) else "(end)"
    return (f"encodes the probe differently from token {at}: {theirs!r} (id {exported_ids[at:at + 1]}) where the "
            f"trained tokenizer has {ours!r} (id {ids[at:at + 1]})")


def _safe_decode(reader: Any, ids: list[int]) -> str:
    try:
        return reader.decode(ids)
    except Exception:  # noqa: BLE001 - an id outside the reader's vocabulary: report the ids instead
        return str(ids)


def _gguf_type(path: Path) -> str:
    """The tensor type a GGUF file says it mostly holds (general.file_type), as export_gguf_type names it."""
    import gguf  # lazy: the gguf extra, which may be missing; GGUF exports only

    file_type = _gguf_header_value(path, gguf.Keys.General.FILE_TYPE)
    if file_type is None:
        return "unknown"
    name = gguf.LlamaFileType(int(file_type)).name
    floats = {"ALL_F32": "f32", "MOSTLY_F16": "f16", "MOSTLY_BF16": "bf16"}
    return floats.get(name, name.removeprefix("MOSTLY_").lower())


def _gguf_header_value(path: Path, key: str) -> int | float | bool | str | None:
    """One scalar or string of a GGUF's metadata, read from the header up to that key (None: not there, or an
    array). gguf.GGUFReader parses every metadata array first: half a minute for Gemma 3's 262k-token vocabulary."""
    import gguf  # lazy: the gguf extra, which may be missing; GGUF exports only

    V = gguf.GGUFValueType
    scalars = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
               V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}

    def read(fmt: str):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def skip(value_type: int) -> None:
        if value_type == V.STRING:
            f.seek(read("Q"), 1)
        elif value_type == V.ARRAY:
            item_type, count = read("I"), read("Q")
            if item_type in scalars:
                f.seek(count * struct.calcsize(scalars[V(item_type)]), 1)
            else:
                for _ in range(count):
                    skip(item_type)
        else:
            f.seek(struct.calcsize(scalars[V(value_type)]), 1)

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ExportError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        _version, _tensors, n_kv = read("I"), read("Q"), read("Q")
        for _ in range(n_kv):
            name = f.read(read("Q")).decode("utf-8")
            value_type = read("I")
            if name == key and value_type == V.STRING:
                return f.read(read("Q")).decode("utf-8")
            if name == key and value_type in scalars:
                return read(scalars[V(value_type)])
            skip(value_type)
    return None


def _hf_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config"):
        return "torchao"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype, dtype)
