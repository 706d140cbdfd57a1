"""How the next answer is drawn: SamplingOptions, the one declaration of the sampling options.

`tunelab chat` builds its --temperature, --top-p, ... flags from these fields (their types, defaults and help),
and `tunelab api` fills them from each request. It imports no torch, so the command line can read it without
loading the inference engine (infer/engine.py generates with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tunelab.errors import ConfigError


def _option(default, text: str):
    """A field with its help text (the flag's help in `tunelab chat --help`)."""
    return field(default=default, metadata={"help": text})


@dataclass
class SamplingOptions:
    """How the next answer is drawn. temperature 0 means greedy decoding (the other sampling options then do nothing)."""

    temperature: float = _option(0.7, "0: greedy (deterministic)")
    top_p: float = _option(1.0, "nucleus sampling: keep the most likely tokens whose probabilities add up to this")
    top_k: int = _option(0, "sample among the k most likely tokens (0: off)")
    max_new_tokens: int | None = _option(None, "tokens per answer at most")  # None: up to the end of the context
    repetition_penalty: float = _option(1.0, "> 1 discourages repeats (1: off)")
    # the answer's own random generator: repeatable, whatever shares its batch
    seed: int | None = _option(None, "seed for sampling (the same seed and input give the same answers)")
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        checks = (
            ("temperature", self.temperature >= 0, "a number >= 0 (0: greedy)"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1, "an integer >= 1"),
            ("repetition_penalty", self.repetition_penalty > 0, "a number > 0 (1: off)"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{name}: expected {expected}, got {getattr(self, name)!r}")
        self.stop = tuple(s for s in self.stop if s)
