"""`tunelab chat`: a scripted session on stdin, and an interactive one in a pseudo-terminal, with exact transcripts."""

from __future__ import annotations

import io
import os
import pty
import select
import sys
import time

import pytest

from tests.infer.chat_helpers import messages
from tunelab.cli import main
from tunelab.infer.chat import read_turn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chat(monkeypatch, capsys, args: list[str], script: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    code = main(["chat", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_scripted_session_keeps_history_and_clears_it(chat_model, reference, monkeypatch, capsys):
    script = "Say hi\nAgain\n/clear\nAgain\n\n/nonsense\n/clear\nCount\n"
    code, out, err = chat(monkeypatch, capsys, [str(chat_model.adapter), "--temperature", "0"], script)
    # "Again" after "Say hi" continues the conversation; after /clear it is a first message (a different answer).
    fresh_again = reference.answer(messages(None, [("Again", None)]))
    assert fresh_again != "Hi again!"
    assert code == 0
    assert out == (
        f">>> Hi! 你好 🙂\n>>> Hi again!\n>>> (history cleared)\n>>> {fresh_again}\n"
        ">>> >>> >>> (history cleared)\n>>> one two three\n>>> \n"
    )
    assert err.splitlines() == [
        "chatting with adapter (template chatml); /image PATH attaches an image, /clear resets the history, /exit or Ctrl-D quits",
        "unknown command /nonsense; /image PATH attaches an image, /clear resets the history, /exit or Ctrl-D quits",
    ]


def test_system_prompt_limit_and_exit(chat_model, reference, monkeypatch, capsys):
    args = [str(chat_model.merged), "--temperature", "0", "--system", "Be brief.", "--max-new-tokens", "2"]
    code, out, err = chat(monkeypatch, capsys, args, "Count\n/exit\nSay hi\n")
    expected = reference.tokenizer.decode(reference.generate(messages("Be brief.", [("Count", None)]))[:2])
    assert expected == "1 "
    assert (code, out) == (0, ">>> 1 \n>>> ")  # stops at /exit: "Say hi" is never read
    assert err.splitlines()[1] == "(the answer reached the limit of 2 new tokens)"


@pytest.mark.parametrize(("lines", "turn"), [
    (["Say hi"], "Say hi"),
    (["Reverse the letters.\\", "m,i,p,x,w"], "Reverse the letters.\nm,i,p,x,w"),  # a backslash continues
    (["a\\", "b\\", "c"], "a\nb\nc"),
    (['"""Reverse the letters.', "m,i,p,x,w\"\"\""], "Reverse the letters.\nm,i,p,x,w"),  # ollama's block
    (['"""', "  indented", "", "x\\", '"""'], "  indented\n\nx\\"),  # kept as typed inside a block
    (['"""one line"""'], "one line"),
    (["back\\slash"], "back\\slash"),  # only a backslash at the very end continues
])
def test_read_turn_joins_continued_lines_and_blocks(lines, turn):
    prompts = []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        return lines[len(prompts) - 1]

    assert read_turn(read_line) == turn
    assert prompts == [">>> "] + ["... "] * (len(lines) - 1)


def test_read_turn_passes_end_of_input_through():
    lines = iter(['"""open'])

    def read_line(prompt: str) -> str:
        return next(lines) if prompt == ">>> " else (_ for _ in ()).throw(EOFError)

    with pytest.raises(EOFError):
        read_turn(read_line)


def test_scripted_multi_line_turns(chat_model, reference, monkeypatch, capsys):
    expected = reference.answer(messages(None, [("Count\nnow", None)]))
    code, out, _ = chat(monkeypatch, capsys, [str(chat_model.adapter), "--temperature", "0"],
                        'Count\\\nnow\n/clear\n"""Count\nnow"""\n')
    assert code == 0
    assert out == f">>> ... {expected}\n>>> (history cleared)\n>>> ... {expected}\n>>> \n"


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["chat", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"tunelab: error: {tmp_path} is neither a model folder (config.json) nor a LoRA adapter folder "
        "(adapter_config.json); pass the output_dir of a training run or a Hugging Face model folder\n"
    )
    assert main(["chat", "tiny", "--temperature", "-1"]) == 2
    assert capsys.readouterr().err == "tunelab: error: temperature: expected a number >= 0 (0: greedy), got -1.0\n"
    assert main(["api", "tiny", "--max-batch-size", "0"]) == 2
    assert capsys.readouterr().err == "tunelab: error: --max-batch-size: expected an integer >= 1, got 0\n"


class Terminal:
    """A child process on a pseudo-terminal: what it writes, read up to an expected text."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.execve(argv[0], argv, env)
        self.seen = b""

    def read_until(self, expected: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while expected.encode() not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {expected!r} after {timeout}s; the terminal shows {self.seen!r}")
            try:
                self.seen += os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                raise AssertionError(f"the child exited before {expected!r}; the terminal shows {self.seen!r}") from None
        return self.seen.decode()

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def exit_code(self) -> int:
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:
            pass
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.slow
def test_interactive_session_in_a_terminal(chat_model, reference):
    """In a real terminal (readline on a pseudo-terminal): turns keep the history; after /clear a backslash at the
    end of a line continues the turn with the `... ` prompt, and the model answers the two lines joined by a
    newline. One session for both (each `tunelab chat` process imports the stack: ~15 s of the 2-core suite)."""
    env = {**os.environ, "TERM": "dumb", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "tunelab.cli", "chat", str(chat_model.adapter), "--temperature", "0"]
    terminal = Terminal(argv, env)
    terminal.read_until(">>> ")
    terminal.send("Say hi\r")  # Enter sends a carriage return; the terminal turns it into a newline
    terminal.read_until("🙂\r\n>>> ")
    terminal.send("Again\r")
    terminal.read_until("again!\r\n>>> ")
    terminal.send("/clear\r")
    terminal.read_until("(history cleared)\r\n>>> ")
    terminal.send("Count\\\r")
    terminal.read_until("... ")
    terminal.send("now\r")
    expected = reference.answer(messages(None, [("Count\nnow", None)]))
    terminal.read_until(f"{expected}\r\n>>> ")
    terminal.send("\x04")  # Ctrl-D on an empty line: end of input
    terminal.read_until(">>> \r\n")
    assert terminal.exit_code() == 0
    # The banner (stderr) and the conversation share the terminal; the typed lines are echoed. What libraries
    # print while they are imported (e.g. bitsandbytes on some CPUs) comes before the banner and is not ours.
    shown = terminal.seen.decode().replace("\r\n", "\n")
    banner = "chatting with adapter (template chatml); /image PATH attaches an image, /clear resets the history, /exit or Ctrl-D quits\n"
    assert shown.count(banner) == 1
    assert shown[shown.index(banner) :] == (
        banner + ">>> Say hi\nHi! 你好 🙂\n>>> Again\nHi again!\n>>> /clear\n(history cleared)\n"
        f">>> Count\\\n... now\n{expected}\n>>> \n"
    )
