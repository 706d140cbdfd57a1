"""Dynamic batching: concurrent generations share forward passes and each gets the answer it gets alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.infer.chat_helpers import messages
from tunelab.infer.engine import SamplingOptions, load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingOptions(temperature=0, max_new_tokens=48)
CHATS = [  # prompts of 12 to 38 tokens: the shorter ones are left-padded in a batch
    messages(None, [("Say hi", None)]),
    messages(None, [("Say hi", "Hi! 你好 🙂"), ("Again", None)]),
    messages("Be brief.", [("Count", None)]),
    messages(None, [("What is the capital of France?", None)]),
]


@pytest.fixture(scope="module")
def engine(chat_model):
    engine = load_engine(str(chat_model.adapter))
    engine.max_batch_size = 4
    return engine


def outcome(generation) -> tuple:
    return generation.text, generation.finish_reason, generation.completion_tokens


def run_together(engine, requests: list[tuple[list[dict], SamplingOptions]]) -> list[tuple]:
    generations = [engine.generate(chat, options) for chat, options in requests]
    engine.start(generations)  # queued at once: the scheduler takes them together
    for generation in generations:
        list(generation)
    return [outcome(generation) for generation in generations]


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_concurrent_greedy_answers_equal_the_single_ones(engine):
    sizes = engine.scheduler.batch_sizes
    alone = [outcome(engine.complete(chat, GREEDY)) for chat in CHATS]
    assert sizes[-4:] == [1, 1, 1, 1]
    assert run_together(engine, [(chat, GREEDY) for chat in CHATS]) == alone
    assert sizes[-1] == 4
    assert [text for text, _, _ in alone[:3]] == ["Hi! 你好 🙂", "Hi again!", "1 2 3"]


def test_each_row_keeps_its_own_options(engine):
    sampled = SamplingOptions(temperature=1.3, top_p=0.95, max_new_tokens=12, seed=7)
    requests = [
        (CHATS[0], SamplingOptions(temperature=0, max_new_tokens=3)),  # ends first, at its own limit
        (CHATS[0], SamplingOptions(temperature=0, stop=("你好",))),
        (CHATS[3], SamplingOptions(temperature=0, max_new_tokens=20, repetition_penalty=1.5)),
        (CHATS[3], sampled),
    ]
    alone = [outcome(engine.complete(chat, options)) for chat, options in requests]
    together = run_together(engine, requests)
    assert engine.scheduler.batch_sizes[-1] == 4
    assert together[:3] == alone[:3]
    assert together[:2] == [("Hi!", "length", 3), ("Hi! ", "stop", 10)]  # 你 and 好: 3 byte-tokens each
    # The sampled row draws from its own generator: the same batch twice gives the same sample. (Against the
    # row alone, padding may change its logits in the last bits, so that is not compared exactly.)
    assert run_together(engine, requests)[3] == together[3]
    assert together[3][2] <= 12 and (together[3][1] == "stop" or together[3][2] == 12)


def test_requests_beyond_max_batch_size_wait_for_the_next_batch(engine):
    chats = CHATS + CHATS[:2]
    alone = [outcome(engine.complete(chat, GREEDY)) for chat in chats]
    assert run_together(engine, [(chat, GREEDY) for chat in chats]) == alone
    assert engine.scheduler.batch_sizes[-2:] == [4, 2]


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_cancelled_row_leaves_its_batch():
    """The untrained tiny Llama writes newlines until its limit: one row is left after two pieces (as a client
    that disconnects), the other runs to its end and gets what it gets alone."""
    engine = load_engine("tiny")
    engine.max_batch_size = 2
    options = replace(GREEDY, max_new_tokens=200)
    alone = outcome(engine.complete(CHATS[0], options))
    left, stays = engine.generate(CHATS[0], options), engine.generate(CHATS[0], options)
    engine.start([left, stays])
    pieces = iter(left)
    assert [next(pieces), next(pieces)] == ["\n", "\n"]
    pieces.close()
    for _ in stays:
        pass
    assert outcome(stays) == alone == ("\n" * 200, "length", 200)
    assert left._row.done.is_set() and left._row.generated < 200
