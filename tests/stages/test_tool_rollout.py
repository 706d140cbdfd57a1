"""Tool-using rollouts (train/rl/tool_rollout.py) on real Qwen tokenizers and chat templates: the rollout's ids are
what inference sends (the template's own apply_chat_template of the same messages, with the generation prompt before
the final answer), only the policy's sampled tokens are in the loss mask, and a call the template writes otherwise,
or one past max_tool_turns, is handled as documented. The policy is scripted (its turns are fixed token lists) so
that the layout is known; the python tool runs for real in its sandbox."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.real_assets import real
from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.data.prompts import PromptEncoder
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.run_folder import read_log
from tunelab.train.rl import tool_rollout as tool_rollout_module
from tunelab.train.rl.grpo import GRPO
from tunelab.train.rl.rewards import RewardFunction, exact_match_reward
from tunelab.train.rl.rollout import Rollout, left_pad
from tunelab.train.rl.tool_rollout import ToolUse, tool_rollout
from tunelab.train.rl.tools import PYTHON_SCHEMA, Tool

QUESTION = {"system": "", "tools": "", "messages": [  # a canonical row (data/formats.py)
    {"role": "user", "content": "What is 6 * 7? Reply with the number alone."}, {"role": "assistant", "content": "42"}]}
CANONICAL_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
LOOSE_CALL = '<tool_call>\n{"name":"python","arguments":{"code":"print(6*7)"}}\n</tool_call>'


def qwen3():
    return AutoTokenizer.from_pretrained(real("qwen3"))


def qwen25_coder():
    path = real("qwen2.5-coder-0.5b")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, tokenizer_type="qwen2")


TOKENIZERS = [pytest.param(qwen3, id="qwen3"),
              pytest.param(qwen25_coder, id="qwen2.5-coder", marks=pytest.mark.slow)]  # a GGUF's tokenizer: slow


class ScriptedPolicy:
    """Stands in for generate_rollout: each call gives every row its next scripted turn (text + the stop token);
    `finals`: the last turn row by row instead (answers that differ within a group)."""

    def __init__(self, tokenizer, stop_id: int, turns: list[str], finals: list[str] | None = None):
        self.tokenizer, self.stop_id = tokenizer, stop_id
        self.turns = [self.tokens(t) for t in turns]
        self.finals = [self.tokens(t) for t in finals] if finals else None
        self.calls = 0
        self.seen: list[list[int]] = []  # the ids each turn was sampled after

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_id]

    def __call__(self, model, tokenizer, prompt_ids, stop_ids, max_new_tokens, temperature, pad_id, group_size=1):
        last = self.calls >= len(self.turns) - 1
        rows = [list(p) for p in prompt_ids for _ in range(group_size)]
        turns = [self.turns[min(self.calls, len(self.turns) - 1)]] * len(rows)
        if last and self.finals:
            turns = [self.finals[i % len(self.finals)] for i in range(len(rows))]
        self.calls += 1
        self.seen += rows
        width = max(len(t) for t in turns)
        prompts, mask = left_pad(rows, pad_id, "cpu")
        completion = torch.tensor([t + [pad_id] * (width - len(t)) for t in turns])
        done = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in turns])
        return Rollout(torch.cat([prompts, completion], 1), torch.cat([mask, done.long()], 1), done,
                       prompts.shape[1], [""] * len(rows), [True] * len(rows), group_size)


def end_of_turn(tokenizer, template) -> int:
    (token,) = tokenizer(template.stop_words[0], add_special_tokens=False)["input_ids"]
    return token


def setting(make_tokenizer, monkeypatch, turns: list[str], max_tool_turns: int = 2):
    tokenizer = make_tokenizer()
    template = get_template("model", tokenizer)
    row = PromptEncoder(tokenizer, template, tools=(PYTHON_SCHEMA,))(QUESTION)
    stops = stop_token_ids(tokenizer, template)
    policy = ScriptedPolicy(tokenizer, end_of_turn(tokenizer, template), turns)
    monkeypatch.setattr(tool_rollout_module, "generate_rollout", policy)
    use = ToolUse.build(template, tokenizer, [Tool("python", PYTHON_SCHEMA)], max_tool_turns)
    result = tool_rollout(torch.nn.Linear(1, 1), tokenizer, use, [row], stops, max_new_tokens=64, temperature=1.0,
                          pad_id=tokenizer.pad_token_id, group_size=2)
    return tokenizer, row, policy, result


def row_ids(rollout: Rollout, i: int) -> tuple[list[int], list[int]]:
    """(prompt + completion ids without padding, the completion's loss mask without padding)."""
    real_tokens = rollout.attention_mask[i].bool()
    width = rollout.prompt_width
    length = int(real_tokens[width:].sum())
    return rollout.input_ids[i][real_tokens].tolist(), rollout.completion_mask[i, :length].long().tolist()


def inference_ids(tokenizer, messages, tools) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS)
def test_the_ids_are_what_inference_sends_and_only_the_policys_tokens_train(make_tokenizer, monkeypatch):
    tokenizer, row, policy, result = setting(make_tokenizer, monkeypatch, [CANONICAL_CALL, "42"])
    first, final = policy.turns
    messages, tools = json.loads(row["messages"]), json.loads(row["tools"])
    for i in range(2):  # the group's two rollouts
        exchange = result.completion_messages[i]
        assert [m["role"] for m in exchange] == ["assistant", "tool", "assistant"]
        assert exchange[0]["tool_calls"][0]["function"] == {"name": "python", "arguments": {"code": "print(6 * 7)"}}
        assert exchange[1]["content"] == "42"  # the sandbox ran the code
        # The ids the final answer was sampled after are the template's render of the same messages (the API's).
        before_answer = inference_ids(tokenizer, [*messages, *exchange[:-1]], tools)
        assert policy.seen[2 + i] == before_answer
        ids, own = row_ids(result.rollout, i)
        assert ids == before_answer + final
        # Loss mask: the sampled call (through its stop token) and the final answer; nothing of the template's glue.
        prompt_length = len(row["prompt_ids"])
        glue = len(before_answer) - prompt_length - len(first)
        assert own == [1] * len(first) + [0] * glue + [1] * len(final)
        assert ids[prompt_length: prompt_length + len(first)] == first
    assert result.rollout.completions == ["42", "42"] and result.rollout.finished == [True, True]
    assert result.stats["tools/calls_per_rollout"] == 1 and result.stats["tools/errors"] == 0
    assert result.stats["tools/rewritten_calls"] == 0


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS[:1])
def test_a_call_written_unlike_the_template_is_rendered_its_way_and_masked(make_tokenizer, monkeypatch):
    tokenizer, row, policy, result = setting(make_tokenizer, monkeypatch, [LOOSE_CALL, "42"])
    exchange = result.completion_messages[0]
    before_answer = inference_ids(tokenizer, [*json.loads(row["messages"]), *exchange[:-1]], json.loads(row["tools"]))
    ids, own = row_ids(result.rollout, 0)
    loose, final = policy.turns
    assert ids == before_answer + final  # the template's way of writing the call, as inference would send it
    rendered = before_answer[len(row["prompt_ids"]):]
    same = next(i for i, (a, b) in enumerate(zip(loose, rendered)) if a != b)
    assert 0 < same < len(loose)  # "<tool_call>", "\n", ... until the first space the policy left out
    # The policy's tokens up to where the render differs train; the template's tokens from there on do not.
    assert own == [1] * same + [0] * (len(rendered) - same) + [1] * len(final)
    assert result.stats["tools/rewritten_calls"] == 2  # both rollouts of the group


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS[:1])
def test_an_untagged_call_runs_and_only_the_answer_after_it_trains(make_tokenizer, monkeypatch):
    # Qwen2.5-Coder-0.5B-Instruct writes its calls without <tool_call> (llama.cpp reads them as calls, and so does
    # the API's parser): the call runs, inference sends the template's tagged form of it, so none of the policy's
    # tokens of that turn are in the row and none train.
    bare = '{"name": "python", "arguments": {"code": "print(6 * 7)"}}'
    tokenizer, row, policy, result = setting(make_tokenizer, monkeypatch, [bare, "42"])
    exchange = result.completion_messages[0]
    assert exchange[1] == {**exchange[1], "role": "tool", "content": "42"}
    before_answer = inference_ids(tokenizer, [*json.loads(row["messages"]), *exchange[:-1]], json.loads(row["tools"]))
    ids, own = row_ids(result.rollout, 0)
    assert ids == before_answer + policy.turns[1]
    assert own == [0] * (len(before_answer) - len(row["prompt_ids"])) + [1] * len(policy.turns[1])
    assert result.stats["tools/rewritten_calls"] == 2 and result.rollout.completions == ["42", "42"]


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS[:1])
def test_calls_stop_after_max_tool_turns_and_the_last_turn_is_the_answer(make_tokenizer, monkeypatch):
    tokenizer, row, policy, result = setting(make_tokenizer, monkeypatch, [CANONICAL_CALL], max_tool_turns=2)
    exchange = result.completion_messages[0]
    assert [m["role"] for m in exchange] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "tool_calls" not in exchange[-1] and "<tool_call>" in exchange[-1]["content"]  # not run
    assert result.stats["tools/calls_per_rollout"] == 2
    ids, own = row_ids(result.rollout, 0)
    assert sum(own) == 3 * len(policy.turns[0])  # three sampled turns train; every template turn between is masked


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS[:1])
def test_a_failing_call_becomes_an_error_result_and_the_rollout_goes_on(make_tokenizer, monkeypatch):
    bad = '<tool_call>\n{"name": "python", "arguments": {"code": "1 / 0"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "search", "arguments": {"query": "6 * 7"}}\n</tool_call>'
    tokenizer, row, policy, result = setting(make_tokenizer, monkeypatch, [bad, unknown, "42"])
    exchange = result.completion_messages[0]
    assert exchange[1]["content"].startswith("error: ZeroDivisionError")
    assert exchange[3]["content"].startswith("error: there is no tool 'search'")
    assert exchange[-1] == {"role": "assistant", "content": "42"}
    assert result.stats["tools/errors"] == 4  # two calls in each of the group's two rollouts


def canonical_call(template, tokenizer, code: str) -> str:
    """How `template` writes a python call: the answer text between the generation prompt and the end of turn."""
    asked = [{"role": "user", "content": "q"}]
    call = {"type": "function", "id": "call_1", "function": {"name": "python", "arguments": {"code": code}}}
    tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    full = template.render([*asked, {"role": "assistant", "content": "", "tool_calls": [call]}], [PYTHON_SCHEMA],
                           **tokens)
    turn = full[len(template.prompt(asked, [PYTHON_SCHEMA], **tokens)):]
    return turn[: turn.index(template.stop_words[0])]


def test_grpo_scores_the_final_answers_and_trains_only_the_policys_tokens(monkeypatch):
    # The embedded tiny Llama with the built-in `default` template (Hermes calls); the policy's turns are scripted:
    # a python call, then 42 in one rollout of the group and 41 in the other.
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    template = get_template("default", tokenizer)
    row = PromptEncoder(tokenizer, template, tools=(PYTHON_SCHEMA,))(QUESTION)
    stops = stop_token_ids(tokenizer, template)
    call = canonical_call(template, tokenizer, "print(6 * 7)")
    policy = ScriptedPolicy(tokenizer, end_of_turn(tokenizer, template), [call, ""], finals=["42", "41"])
    monkeypatch.setattr(tool_rollout_module, "generate_rollout", policy)
    use = ToolUse.build(template, tokenizer, [Tool("python", PYTHON_SCHEMA)], max_tool_turns=1)
    seen_messages = []

    def used_tool(prompts, completions, references, completion_messages):
        seen_messages.extend(completion_messages)
        return [0.0 for _ in completions]

    rewards = [RewardFunction("exact_match", exact_match_reward, 1.0, False),
               RewardFunction("used_tool", used_tool, 1.0, False, wants_messages=True)]
    finetuning = SimpleNamespace(
        num_generations=2, kl_coef=0.0, epsilon=0.2, num_iterations=1, loss_type="grpo", scale_rewards="none",
        advantage_estimator="rloo", epsilon_high=None, importance_sampling_level="token",
        mask_truncated_completions=False, dynamic_sampling=False, top_entropy_quantile=1.0, finetuning_type="full",
    )
    config = SimpleNamespace(finetuning=finetuning, generation=SimpleNamespace(temperature=1.0, max_new_tokens=16))
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, unwrap_model=lambda m: m)
    recorded: list[dict] = []
    samples: list[list[dict]] = []
    loop = SimpleNamespace(accelerator=accelerator, model=model, record=recorded.append, record_samples=samples.append)
    grpo = GRPO(loop, None, tokenizer, stops, rewards, config.finetuning, config.generation, tool_use=use)

    batch = grpo.finish_rollout(grpo.start_rollout([{"prompt": row["prompt"], "reference": "42", **row}]))
    assert batch.rollout.completions == ["42", "41"]
    assert batch.advantages.tolist() == [1.0, -1.0]  # rloo: each reward against the other's
    assert [[m["role"] for m in ms] for ms in seen_messages] == [["assistant", "tool", "assistant"]] * 2
    stats = recorded[0]
    assert stats["tools/calls_per_rollout"] == 1 and stats["tools/rewritten_calls"] == 0
    assert stats["reward/exact_match"] == 0.5
    # completions.jsonl's records: the final answers, their rewards and each whole exchange.
    assert [(s["completion"], s["reward"], s["group"]) for s in samples[0]] == [("42", 1.0, 0), ("41", 0.0, 0)]
    assert [m["role"] for m in samples[0][0]["messages"]] == ["assistant", "tool", "assistant"]
    call_tokens = len(policy.tokens(call))
    for i, final in enumerate(policy.finals):
        mask = batch.loss_mask[i].long().tolist()
        trained = [t for t, m in zip(batch.rollout.input_ids[i, batch.rollout.prompt_width:].tolist(), mask) if m]
        assert sum(mask) == call_tokens + len(final)
        assert trained[-len(final):] == final  # the answer trains; the tool's "42" and the template's turns do not
    loss, _ = grpo.loss(batch)
    loss.backward()
    assert loss.isfinite() and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.slow
def test_grpo_with_tools_trains_through_the_cli_and_scores_held_out_answers_with_tools(tmp_path):
    # The tiny model calls no tools: this checks the plumbing (config, preflight, prompts rendered with the tools,
    # the held-out check with tools, the log) on a real run.
    (tmp_path / "my_tools.py").write_text(
        'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: One.\n        b: Two.\n    """\n'
        "    return a + b\n"
    )
    out = tmp_path / "grpo_tools"
    config = tmp_path / "grpo_tools.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "full", "template": "default",
        "dataset": "demo_tool_math", "max_samples": 8, "eval_dataset": "demo_tool_math_test", "eval_generation": True,
        "eval_generation_samples": 2, "cutoff_len": 1024, "max_new_tokens": 6, "reward_funcs": "exact_match",
        "tools": "python,my_tools.py:add", "max_tool_turns": 1, "num_generations": 2, "per_device_train_batch_size": 2,
        "max_steps": 1, "logging_steps": 1, "seed": 0, "disable_tqdm": True, "plot_loss": False,
        "output_dir": str(out),
    }))
    assert main(["train", str(config)]) == 0
    (record,) = read_log(out)
    assert {"tools/calls_per_rollout", "tools/errors", "tools/timeouts", "tools/rewritten_calls"} <= set(record)
    metrics = json.loads((out / "all_results.json").read_text())
    assert {"tool_calls_per_answer_before", "tool_calls_per_answer_after", "exact_match_after"} <= set(metrics)
