"""Tools a grpo policy may call during its rollouts (option `tools`): loading them, the schema each shows the model,
and running one call so that no tool can stop, hang or flood the run.

    tools: python,path/to/file.py:fn

- `python` (built-in): runs the call's `code` argument in the executed rewards' sandbox (code_sandbox.py: its own
  process and folder, time and memory limits, no network). The result is what the code prints; a bare expression
  on the last line is printed too, as in a REPL. The first OUTPUT_CHARS characters come back.
- `path/to/file.py:fn` or `package.module:fn`: the user's function, imported by the opt-in rule of user_code.py
  (the same as reward functions). Its schema is what `apply_chat_template(tools=[fn])` renders: transformers'
  get_json_schema, read from its type hints and its Google-style docstring (a summary line and an `Args:` section
  naming every parameter). Each call runs the function with the call's arguments as keyword arguments in a fresh
  child process (the run's Python, environment and working directory: the user's code is trusted, its bugs are
  not): USER_TIMEOUT_S of wall time, USER_MEMORY_BYTES of address space, what it prints discarded. The result is
  its return value (text as it is, anything else as JSON), cut at RESULT_CHARS.

A call that fails gives the model a result starting with `error:` (unknown tool, an exception, a timeout, a
crash) and is counted (`ToolRunner.pop_stats`): training goes on.

This module knows nothing of models, tokens or templates; train/rl/tool_rollout.py turns calls into turns.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.utils import get_json_schema

from tunelab.errors import ConfigError
from tunelab.train.rl.code_sandbox import TIMEOUT_S, run_tests
from tunelab.user_code import import_user_module, is_user_spec, split_user_spec

logger = logging.getLogger(__name__)

PYTHON = "python"
USER_TIMEOUT_S = 10.0
USER_MEMORY_BYTES = 2 * 2**30
RESULT_CHARS = 2000  # what a user tool's result may add to the context
OUTPUT_CHARS = 500  # what the sandbox keeps of a python run's output (code_sandbox._read_result)
_REPORT_BYTES = 12 * RESULT_CHARS + 100  # the report: JSON escapes take up to 12 bytes a character

PYTHON_SCHEMA = {"type": "function", "function": {
    "name": PYTHON,
    "description": "Run Python 3 code (standard library only, no network, a few seconds) and return what it prints. "
                   "The value of a bare expression on the last line is printed too.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The Python code to run."},
    }, "required": ["code"]},
}}

# The child that runs one call of a user's tool: limits, output discarded, the report written to a file.
_USER_RUNNER = r"""
import importlib, importlib.util, json, os, resource, sys
job = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1); os.dup2(null, 2)
sys.stdin = open(os.devnull)
try:
    where = job["where"]
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("tunelab_tool", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules["tunelab_tool"] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    value = getattr(module, job["name"])(**job["arguments"])
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    report = {"ok": True, "text": text[: job["chars"]]}
except BaseException as error:
    report = {"ok": False, "text": f"{type(error).__name__}: {error}"[: job["chars"]]}
with open(job["report"], "w") as handle:
    handle.write(json.dumps(report))
os._exit(0)
"""


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it by
    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}: the template shows it
    where: str | None = None  # user tools: the module's file (absolute) or importable name; None: the built-in python
    function: str | None = None  # user tools: the function's name in it


@dataclass(frozen=True)
class ToolResult:
    text: str  # the tool turn's content
    status: str  # "ok", "error" (unknown tool, exception, crash) or "timeout"


def load_tools(specs: Sequence[str], base_dir: str | Path | None = None) -> tuple[Tool, ...]:
    """The tools `specs` (option tools) name, each with its schema; ConfigError naming the fix otherwise."""
    tools: list[Tool] = []
    for spec in specs:
        tool = _load_tool(spec, base_dir)
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"tools: two tools are called '{tool.name}'; give each function its own name",
                              key="tools")
        tools.append(tool)
    return tuple(tools)


def _load_tool(spec: str, base_dir: str | Path | None) -> Tool:
    if spec == PYTHON:
        return Tool(PYTHON, PYTHON_SCHEMA)
    if not is_user_spec(spec):
        raise ConfigError(f"tools: '{spec}' is not a built-in tool ({PYTHON}); name your own as path/to/file.py:fn or "
                          "package.module:fn", key="tools")
    where, name = split_user_spec(spec)
    module = import_user_module(where, "tools", base_dir, fix_name="fn")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"tools: {where} has no function '{name}'", key="tools")
    try:
        schema = get_json_schema(fn)
    except Exception as error:  # noqa: BLE001  (transformers' docstring / type-hint parsing errors: one line)
        raise ConfigError(
            f"tools: {spec} cannot be described to the model ({error}); give it type hints and a Google-style "
            "docstring: a summary line and an Args: section naming each parameter", key="tools",
        ) from None
    if name == PYTHON:
        raise ConfigError(f"tools: {spec} is called like the built-in '{PYTHON}'; rename it", key="tools")
    return Tool(name, schema, module.__file__ if where.endswith(".py") else where, name)


def echo_last_expression(code: str) -> str:
    """`code` with a bare expression on its last line printed (repr, unless None), as a REPL shows it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # the sandbox reports it
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr):
        return code
    call = last.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
        return code
    head = ast.unparse(ast.Module(body=tree.body[:-1], type_ignores=[]))
    return f"{head}\n_ = ({ast.unparse(last.value)})\nif _ is not None:\n    print(repr(_))\n"


def run_python(code: Any, timeout_s: float = TIMEOUT_S) -> ToolResult:
    if not isinstance(code, str):
        return ToolResult(f"error: the argument code must be text, got {type(code).__name__}", "error")
    result = run_tests(echo_last_expression(code), [], timeout_s=timeout_s)
    output = result.output.replace("completion failed: ", "error: ")  # the sandbox's words for an exception
    if result.status == "timeout":
        return ToolResult(f"{output}\nerror: timed out after {timeout_s:g} s".lstrip(), "timeout")
    if result.status == "crash":
        return ToolResult(f"{output}\nerror: the run crashed (memory or output limit)".lstrip(), "error")
    status = "error" if "completion failed: " in result.output else "ok"
    return ToolResult(output.strip() or "(nothing was printed)", status)


def run_user_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float = USER_TIMEOUT_S,
                  memory_bytes: int = USER_MEMORY_BYTES) -> ToolResult:
    """One call of a user's tool in a fresh child process, killed (with anything it started) at `timeout_s`."""
    folder = tempfile.mkdtemp(prefix="tunelab-tool-")
    report = os.path.join(folder, "report.json")
    job = {"where": tool.where, "name": tool.function, "arguments": arguments, "chars": RESULT_CHARS,
           "memory_bytes": memory_bytes, "report": report}
    try:
        process = subprocess.Popen([sys.executable, "-c", _USER_RUNNER], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            process.communicate(json.dumps(job, default=str).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return ToolResult(f"error: {tool.name} timed out after {timeout_s:g} s", "timeout")
        finally:
            _kill_group(process)
        try:
            with open(report, "rb") as handle:
                parsed = json.loads(handle.read(_REPORT_BYTES).decode("utf-8", "replace"))
            text, ok = str(parsed["text"]), bool(parsed["ok"])
        except (OSError, ValueError, KeyError, TypeError):
            return ToolResult(f"error: {tool.name} crashed (memory limit, or it ended the process)", "error")
        return ToolResult(text, "ok") if ok else ToolResult(f"error: {text}", "error")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class ToolRunner:
    """Runs a batch of calls at once (one thread waiting on each child, up to one per CPU core) and counts them."""

    def __init__(self, tools: Sequence[Tool], workers: int | None = None, timeout_s: float | None = None):
        self.tools = {tool.name: tool for tool in tools}
        self.workers = workers or os.cpu_count() or 1
        self.timeout_s = timeout_s  # None: USER_TIMEOUT_S for the user's tools, the sandbox's TIMEOUT_S for python
        self.stats = {"calls": 0, "errors": 0, "timeouts": 0}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    def run(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            return self._run(name, arguments)
        except Exception as error:  # noqa: BLE001  (no call may stop the run: a child that cannot start, say)
            logger.warning("tool %s: the call could not run: %s: %s", name, type(error).__name__, error)
            return ToolResult(f"error: {name} could not run ({type(error).__name__})", "error")

    def _run(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: there is no tool '{name}'; the tools are {', '.join(self.tools)}", "error")
        if tool.where is None:
            if "code" not in arguments:
                return ToolResult(f"error: {PYTHON} takes one argument, code: the Python code to run", "error")
            return run_python(arguments["code"], self.timeout_s or TIMEOUT_S)
        return run_user_tool(tool, arguments, self.timeout_s or USER_TIMEOUT_S)

    def run_many(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[ToolResult]:
        """The results of (name, arguments) calls, in order."""
        if not calls:
            return []
        with ThreadPoolExecutor(max_workers=min(self.workers, len(calls)), thread_name_prefix="tool-call") as pool:
            results = list(pool.map(lambda call: self.run(*call), calls))
        self.stats["calls"] += len(results)
        self.stats["errors"] += sum(r.status == "error" for r in results)
        self.stats["timeouts"] += sum(r.status == "timeout" for r in results)
        return results

    def pop_stats(self) -> dict[str, int]:
        stats, self.stats = self.stats, {"calls": 0, "errors": 0, "timeouts": 0}
        return stats
