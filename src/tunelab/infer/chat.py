"""`tunelab chat`: a terminal conversation with a loaded ChatEngine, answers streamed as they are generated.

Reads one user turn from stdin (a terminal or a script) with read_turn: one line, or several where a line ends in
a backslash (it continues on the next, as in a shell or llama.cpp's CLI) or inside a block between lines that
start and end with three double quotes (as in `ollama run`); keeps the history, and understands
`/image PATH` (attach an image file to the next message: a vision-language model sees it where that message
starts), `/clear` (forget the history, keep the system prompt) and `/exit` (or end of input, Ctrl-D). Ctrl-C while
an answer streams stops that answer and drops the turn. Only the conversation goes to stdout (the `>>> `
prompt and the answers); the banner and errors go to stderr, so a scripted session's stdout is exact.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tunelab.errors import InferenceError
from tunelab.infer.engine import ChatEngine, Message, SamplingOptions

PROMPT = ">>> "
CONTINUED = "... "  # the prompt of a turn's second and later lines
BLOCK = '"""'
COMMANDS = "/image PATH attaches an image, /clear resets the history, /exit or Ctrl-D quits"


def read_turn(read_line: Callable[[str], str] = input) -> str:
    r'''One user turn from `read_line` (input(): it shows the prompt it is given). A line ending in a backslash
    continues on the next (the backslash dropped); a line starting with three double quotes opens a block that the
    next line ending with them closes, every line in between kept (a block on one line is that line):

        >>> Reverse the letters.\            ->  "Reverse the letters.\nm,i,p,x,w"
        ... m,i,p,x,w
        >>> """Reverse the letters.         ->  the same
        ... m,i,p,x,w"""

    EOFError / KeyboardInterrupt from `read_line` pass through: the turn is dropped.
    '''
    line = read_line(PROMPT)
    if line.lstrip().startswith(BLOCK):
        first = line.lstrip()[len(BLOCK):]
        if first.rstrip().endswith(BLOCK):
            return first.rstrip()[:-len(BLOCK)]
        lines = [first] if first else []
        while True:
            line = read_line(CONTINUED)
            if line.rstrip().endswith(BLOCK):
                last = line.rstrip()[:-len(BLOCK)]
                return "\n".join([*lines, last] if last else lines)
            lines.append(line)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line(CONTINUED)
    return "\n".join([*lines, line])


def chat_loop(
    engine: ChatEngine, options: SamplingOptions, system: str | None = None,
    out: TextIO | None = None, err: TextIO | None = None,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    print(f"chatting with {engine.name} (template {engine.template.name}); {COMMANDS}", file=err)
    head: list[Message] = [{"role": "system", "content": system}] if system else []
    history: list[Message] = []
    images: list[str] = []  # attached with /image, sent with the next message
    while True:
        try:
            line = read_turn()  # input() writes the prompt to stdout; line editing when readline is loaded
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:  # like a shell: Ctrl-C at the prompt drops the line
            print(file=out)
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/image" or text.startswith("/image "):
            path = text.removeprefix("/image").strip()
            if not path:
                print("usage: /image PATH", file=err)
            elif not Path(path).is_file():
                print(f"error: {path}: no such file", file=err)
            else:
                images.append(path)
                print(f"(image {path} attached to your next message)", file=out)
            continue
        if text == "/clear":
            history.clear()
            images.clear()
            print("(history cleared)", file=out)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}; {COMMANDS}", file=err)
            continue
        turn: Message = {"role": "user", "content": text}
        if images:
            turn["content"] = [*({"type": "image", "path": p} for p in images), {"type": "text", "text": text}]
        try:
            generation = engine.generate([*head, *history, turn], options)
        except InferenceError as exc:
            print(f"error: {exc}", file=err)
            images.clear()  # attached to the message that failed
            continue
        images.clear()
        try:
            for piece in generation:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            print("\n(interrupted; this turn is not kept)", file=out)
            continue
        print(file=out)
        if generation.finish_reason == "length":
            print(f"(the answer reached the limit of {generation.max_new_tokens} new tokens)", file=err)
        history += [turn, {"role": "assistant", "content": generation.text}]
