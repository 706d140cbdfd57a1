"""Every command reads each of its options in three spellings: `key=value` (LlamaFactory's), `--key_name value`
(or `--key_name=value`) and `--key-name value`; an unknown option is one line naming the closest spelling."""

from __future__ import annotations

import io
import sys

import pytest

from tunelab.cli import build_parser, main

SPELLINGS = ["key=value", "--key_name value", "--key-name value"]


def spelled(style: str, options: dict[str, str]) -> list[str]:
    """`options` as command-line words in one spelling."""
    words = []
    for key, value in options.items():
        if style == "key=value":
            words.append(f"{key}={value}")
        elif style == "--key_name value":
            words += [f"--{key}", value]
        else:
            words += [f"--{key.replace('_', '-')}", value]
    return words


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("style", SPELLINGS)
def test_chat_takes_each_spelling(style, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    code, out, err = run(capsys, ["chat", "tiny", *spelled(style, {"temperature": "0", "max_new_tokens": "2"})])
    # the default is 1024 tokens: the limit line shows that max_new_tokens was read
    assert (code, out) == (0, ">>> \n\n\n>>> \n")
    assert err.splitlines() == [
        "chatting with tiny-llama (template chatml); /image PATH attaches an image, /clear resets the history, "
        "/exit or Ctrl-D quits",
        "(the answer reached the limit of 2 new tokens)",
    ]


@pytest.mark.parametrize("style", SPELLINGS)
def test_data_takes_each_spelling_of_its_own_and_the_runs_options(style, capsys):
    run_options = {"model_name_or_path": "tiny", "dataset": "demo_sort", "template": "chatml", "max_samples": "16"}
    code, out, err = run(capsys, ["data", "verify", *spelled(style, {**run_options, "max_batches": "1"})])
    assert code == 0 and "error" not in err
    assert out.splitlines()[0] == (
        "train: 1 batch, 8 samples (of 16), through PaddingFreeCollator (varlen): input_ids, labels, "
        "position_ids, cu_seq_lens_q, cu_seq_lens_k, attention_mask; first batch (1, 260)"
    )


# (command, its arguments, option, value as typed, what the command reads): each command's own options.
OWN_OPTIONS = [
    ("chat", ["tiny"], "max_new_tokens", "40", 40),
    ("chat", ["tiny"], "top_p", "0.5", 0.5),
    ("chat", ["tiny"], "template_kwargs", '{"enable_thinking": false}', '{"enable_thinking": false}'),
    ("chat", ["tiny"], "dtype", "bfloat16", "bfloat16"),
    ("chat", ["tiny"], "trust_remote_code", "true", True),
    ("chat", ["tiny"], "trust_remote_code", "false", False),
    ("api", ["tiny"], "max_batch_size", "3", 3),
    ("api", ["tiny"], "api_key", "sk-x", "sk-x"),
    ("webui", [], "port", "0", 0),
    ("webui", [], "root", "elsewhere", ["elsewhere"]),
    ("data", ["stats"], "out", "folder", "folder"),
    ("data", ["verify"], "max_batches", "2", 2),
    ("estimate", [], "probe_steps", "0", 0),
]


@pytest.mark.parametrize("style", [*SPELLINGS, "--key_name=value", "--key-name=value"])
@pytest.mark.parametrize(("command", "arguments", "key", "value", "expected"), OWN_OPTIONS,
                         ids=[f"{row[0]} {row[2]}={row[3]}" for row in OWN_OPTIONS])
def test_each_command_reads_its_own_options_in_every_spelling(style, command, arguments, key, value, expected):
    if style.endswith("=value") and style != "key=value":
        words = ["--" + (key if "_name" in style else key.replace("_", "-")) + f"={value}"]
    else:
        words = spelled(style, {key: value})
    for argv in ([command, *arguments, *words], [command, *words, *arguments]):  # before or after the arguments
        ns = build_parser().parse_args(argv)
        assert getattr(ns, key) == expected


def test_help_after_a_config_file_is_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["data", "stats", "run.yaml", "--help"])
    assert capsys.readouterr().out.startswith("usage: tunelab data [-h] [--out OUT]")


def test_options_after_a_config_file_stay_the_runs_options():
    ns = build_parser().parse_args(["data", "stats", "run.yaml", "max_batches=3", "--lora-rank", "4", "--out", "x"])
    assert (ns.config, ns.overrides, ns.max_batches, ns.out) == ("run.yaml", ["--lora-rank", "4"], 3, "x")


@pytest.mark.parametrize(("argv", "message"), [
    (["chat", "tiny", "max_new_tokns=40"],
     "unknown option 'max_new_tokns' for tunelab chat; did you mean 'max_new_tokens'?"),
    (["chat", "tiny", "--max_new_tokns", "40"],
     "unknown option '--max_new_tokns' for tunelab chat; did you mean '--max_new_tokens'?"),
    (["chat", "tiny", "--max-new-tokns", "40"],
     "unknown option '--max-new-tokns' for tunelab chat; did you mean '--max-new-tokens'?"),
    (["api", "tiny", "--api-kye", "k"], "unknown option '--api-kye' for tunelab api; did you mean '--api-key'?"),
    (["chat", "tiny", "--volume", "11"], "unknown option '--volume' for tunelab chat; see `tunelab chat --help` for its options"),
    (["template", "show", "chatml", "colour=red"],
     "unknown option 'colour' for tunelab template; see `tunelab template --help` for its options"),
    (["chat", "tiny", "max_new_tokens=many"], "max_new_tokens: expected a number, got 'many'"),
    (["chat", "tiny", "--dtype", "int3"], "--dtype: 'int3' is not one of auto, float32, bfloat16, float16"),
    (["api", "tiny", "trust_remote_code=maybe"], "trust_remote_code: expected true or false, got 'maybe'"),
    (["data", "verify", "dataset=demo_sort", "--max-batches", "x"], "--max-batches: expected a number, got 'x'"),
    (["chat", "tiny", "--system"], "--system: expected a value"),
])
def test_an_unknown_or_wrong_option_is_one_line(capsys, argv, message):
    assert run(capsys, argv) == (2, "", f"tunelab: error: {message}\n")


def test_help_shows_the_options_their_defaults_and_the_spellings(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "--max-new-tokens MAX_NEW_TOKENS" in lines
    assert "tokens per answer at most; default 1024" in lines
    assert "--temperature TEMPERATURE" in lines and "0: greedy (deterministic); default 0.7" in lines
    assert out.endswith(
        "Each option also reads as key=value (LlamaFactory's spelling) or --key_name value:\n"
        "max_new_tokens=40, --max_new_tokens 40 and --max-new-tokens 40 are the same.\n"
    )
