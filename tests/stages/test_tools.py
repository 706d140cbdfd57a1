"""The tools a grpo rollout may call (train/rl/tools.py): loading them and their schemas (one line per mistake), and a
hostile tool suite: a tool that raises, hangs, prints or returns megabytes, exhausts memory or ends its process costs
at most its limits, gives the model an `error:` result, is counted, and the runner goes on."""

from __future__ import annotations

import textwrap

import pytest

from tunelab.errors import ConfigError
from tunelab.preflight import load_config, plan_run
from tunelab.train.rl.rewards import load_reward_functions, score_completions
from tunelab.train.rl.tools import PYTHON, RESULT_CHARS, ToolRunner, echo_last_expression, load_tools

TOOLS = textwrap.dedent('''
    import os, sys, time

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def count(text: str, letter: str) -> str:
        """Count a letter in a text.

        Args:
            text: The text.
            letter: The letter to count.
        """
        return str(text.count(letter))

    def fails(x: int) -> int:
        """Raise.

        Args:
            x: Anything.
        """
        raise ValueError(f"bad x {x}")

    def hangs(x: int) -> int:
        """Never return.

        Args:
            x: Anything.
        """
        while True:
            time.sleep(0.1)

    def chatty(x: int) -> str:
        """Print 20 MB, return a short text.

        Args:
            x: Anything.
        """
        for _ in range(20):
            print("y" * 2**20)
            sys.stderr.write("z" * 2**20)
        return "done"

    def huge(x: int) -> str:
        """Return 10 MB.

        Args:
            x: Anything.
        """
        return "w" * 10 * 2**20

    def greedy(x: int) -> int:
        """Take 8 GB.

        Args:
            x: Anything.
        """
        return len(bytearray(8 * 2**30))

    def leaves(x: int) -> int:
        """End its process.

        Args:
            x: Anything.
        """
        os._exit(3)

    def undocumented(x):
        return x
''')


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return path


def test_a_documented_function_gets_the_schema_apply_chat_template_renders(tools_file):
    (python, add) = load_tools([PYTHON, f"{tools_file}:add"])
    assert python.name == "python" and python.schema["function"]["parameters"]["required"] == ["code"]
    assert add.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number."}}, "required": ["a", "b"]},
        "return": {"type": "integer"}}}


@pytest.mark.parametrize("spec, words", [
    ("{file}:undocumented", "cannot be described to the model"),
    ("{file}:missing", "has no function 'missing'"),
    ("calculator", "not a built-in tool (python)"),
    ("nowhere.py:add", "does not exist"),
])
def test_a_tool_that_cannot_be_loaded_is_one_line_naming_the_fix(tools_file, spec, words):
    with pytest.raises(ConfigError) as error:
        load_tools([spec.format(file=tools_file)])
    message = str(error.value)
    assert message.startswith("tools:") and words in message and "\n" not in message


def test_two_tools_of_one_name_are_refused(tools_file):
    with pytest.raises(ConfigError, match="two tools are called 'add'"):
        load_tools([f"{tools_file}:add", f"{tools_file}:add"])


def test_user_tools_run_in_a_child_and_return_their_value(tools_file):
    runner = ToolRunner(load_tools([f"{tools_file}:add", f"{tools_file}:count"]))
    results = runner.run_many([("add", {"a": 2, "b": 40}), ("count", {"text": "banana", "letter": "a"}),
                               ("add", {"a": 1})])
    assert [r.text for r in results[:2]] == ["42", "3"] and results[2].status == "error"
    assert "missing 1 required positional argument" in results[2].text
    assert runner.pop_stats() == {"calls": 3, "errors": 1, "timeouts": 0}


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_hostile_tools_cost_at_most_their_limits_and_the_runner_goes_on(tools_file):
    names = ["fails", "hangs", "chatty", "huge", "greedy", "leaves", "add"]
    runner = ToolRunner(load_tools([f"{tools_file}:{name}" for name in names]), timeout_s=3)
    results = runner.run_many([(name, {"x": 1} if name != "add" else {"a": 1, "b": 2}) for name in names])
    by_name = dict(zip(names, results))
    assert by_name["fails"].text == "error: ValueError: bad x 1"
    assert by_name["hangs"].status == "timeout" and "timed out after 3 s" in by_name["hangs"].text
    assert by_name["chatty"].text == "done"  # what it printed never reaches the run
    assert by_name["huge"].status == "ok" and len(by_name["huge"].text) == RESULT_CHARS
    assert by_name["greedy"].status == "error" and "MemoryError" in by_name["greedy"].text
    assert by_name["leaves"].status == "error" and "crashed" in by_name["leaves"].text
    assert by_name["add"].text == "3"
    assert runner.pop_stats() == {"calls": 7, "errors": 3, "timeouts": 1}


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_the_python_tool_runs_in_the_sandbox_and_reports_failures_as_results():
    runner = ToolRunner(load_tools([PYTHON]), timeout_s=3)
    codes = ["x = 6\nx * 7", "print(sum(range(10)))", "1 / 0", "while True: pass",
             "print('v' * 2**22)", "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"]
    results = runner.run_many([("python", {"code": code}) for code in codes])
    assert [r.text for r in results[:2]] == ["42", "45"]  # a bare last expression is shown, as in a REPL
    assert results[2].text == "error: ZeroDivisionError: division by zero" and results[2].status == "error"
    assert results[3].status == "timeout"
    assert results[4].status == "error" and len(results[4].text) < 1000  # the output limit, not 4 MB
    assert results[5].status == "error"  # no network
    wrong = runner.run_many([("python", {"script": "print(1)"}), ("calculator", {"x": 1})])
    assert wrong[0].text.startswith("error: python takes one argument, code")
    assert wrong[1].text == "error: there is no tool 'calculator'; the tools are python"
    assert runner.pop_stats() == {"calls": 8, "errors": 5, "timeouts": 1}


def test_echo_last_expression_prints_only_a_bare_last_expression():
    assert "print(repr(_))" in echo_last_expression("a = 2\na ** 10")
    for code in ("print(3)", "a = 3", "for i in range(2):\n    i", "def f(:"):
        assert echo_last_expression(code) == code


def test_a_reward_function_that_names_completion_messages_sees_the_whole_exchange(tmp_path):
    (tmp_path / "r.py").write_text(
        "def used_tool(prompts, completions, references, completion_messages):\n"
        "    return [float(any(m['role'] == 'tool' for m in ms)) for ms in completion_messages]\n"
        "def plain(prompts, completions, references):\n    return [1.0 for _ in completions]\n"
    )
    functions = load_reward_functions([f"{tmp_path}/r.py:used_tool", f"{tmp_path}/r.py:plain"])
    exchanges = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}],
                 [{"role": "assistant", "content": "41"}]]
    totals, per_function = score_completions(functions, ["p", "p"], ["42", "41"], ["42", "42"], [True, True],
                                             exchanges)
    assert per_function[f"{tmp_path}/r.py:used_tool"] == [1.0, 0.0] and totals == [2.0, 1.0]


def test_the_tool_options_are_read_planned_and_checked(tools_file, tmp_path):
    base = {"stage": "grpo", "template": "qwen2_5", "dataset": "demo_tool_math", "output_dir": str(tmp_path / "out"),
            "reward_funcs": "exact_match"}
    plan = plan_run(None, {**base, "tools": f"python,{tools_file}:add", "max_tool_turns": "3"})
    ft = plan.config.finetuning
    assert ft.tools == ["python", f"{tools_file}:add"] and ft.max_tool_turns == 3
    assert [tool.name for tool in plan.tools] == ["python", "add"]
    assert plan_run(None, base).tools == ()
    sft = {key: value for key, value in base.items() if key != "reward_funcs"}
    refusals = [({**base, "max_tool_turns": "0"}, "max_tool_turns must be at least 1"),
                ({**base, "tools": f"{tools_file}:undocumented"}, "cannot be described to the model"),
                ({**sft, "stage": "sft", "tools": "python"}, "only applies to stage grpo")]
    for values, words in refusals:
        with pytest.raises(ConfigError, match=words):
            load_config(None, values)
