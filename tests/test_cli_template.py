"""`tunelab template list|show`: the names, a rendered conversation with trained spans marked ⟦ ⟧, errors."""

from __future__ import annotations

import pytest

from tunelab.cli import main
from tunelab.data.templates import TEMPLATE_NAMES


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["template", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_chatml_marks_the_trained_spans(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "show", "chatml") == (0, (
        "<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n"
        "What is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "⟦4<|im_end|>⟧\n"
        "<|im_start|>user\n"
        "And 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "⟦6<|im_end|>⟧\n"
        "\n"
    ), "")


ALIAS_LINES = (
    "alias qwen = qwen2_5: Qwen2 / Qwen2.5 (ChatML with Qwen's default system prompt)\n"
    'alias qwen3_nothink = qwen3 with template_kwargs {"enable_thinking": false}: Qwen3 with thinking off '
    "(an empty think block in the prompt)\n"
    "alias gemma = gemma3: Gemma (a system message is folded into the first user turn, as Gemma-3 does)\n"
    "alias gemma3n = gemma3: Gemma-3n (Gemma-3's format)\n"
)


def test_list_names_every_builtin(capsys: pytest.CaptureFixture[str]) -> None:
    # stdout: one built-in per line (for scripts); stderr: LlamaFactory's names for them
    assert run(capsys, "list") == (0, "\n".join(TEMPLATE_NAMES) + "\n", ALIAS_LINES)
    assert run(capsys, "show") == (0, "\n".join(TEMPLATE_NAMES) + "\n", ALIAS_LINES)  # show without a name lists too


def test_show_an_alias_renders_its_builtin_with_its_variables(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "qwen3_nothink")
    assert (code, err) == (0, "")
    # enable_thinking: false puts the empty think block in the prompt: it is not trained (outside ⟦ ⟧)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n⟦6<|im_end|>⟧\n\n")
    assert run(capsys, "show", "qwen")[1] == run(capsys, "show", "qwen2_5")[1].replace("'qwen2_5'", "'qwen'")


def test_unknown_name_is_one_line_on_stderr_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "chatm")
    assert (code, out) == (2, "")
    assert err == (
        "tunelab: error: template: 'chatm' does not exist; did you mean 'chatml'? built-ins: "
        f"{', '.join(TEMPLATE_NAMES)}\n"
    )


def test_show_a_history_rewriting_template_per_answer(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "qwen3")
    assert (code, err) == (0, "")
    header, first, second = out.split("--- example ")
    assert header == (
        "'qwen3' renders earlier turns differently once later ones follow, so each answer trains in its own "
        "example: the conversation up to that answer\n"
    )
    assert first.startswith("1 of 2 ---\n") and first.endswith("⟦<think>\n\n</think>\n\n4<|im_end|>⟧\n\n")
    assert second.startswith("2 of 2 ---\n") and second.endswith("⟦<think>\n\n</think>\n\n6<|im_end|>⟧\n\n")
    assert "<|im_start|>assistant\n4<|im_end|>\n" in second  # the earlier answer as Qwen3 rewrites it


def test_show_drops_the_system_turn_for_families_that_refuse_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "gemma2")
    assert code == 0 and err == "note: 'gemma2' refuses a system message, so the example has none\n"
    assert out.startswith(
        "<s><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n⟦4<end_of_turn>⟧\n"
    )


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_show_works_for_every_builtin(capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, _ = run(capsys, "show", name)
    assert code == 0 and out.count("⟦") == out.count("⟧") == 2
