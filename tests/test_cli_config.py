"""How commands take their configuration: options without a YAML (TRL-style), a LlamaFactory inference YAML for
chat / api, the full option list of `train --help`, and one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import _serving_choice, build_parser, main, resume_command


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- options without a YAML file -------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["train", "model_name_or_path=tiny", "dataset=demo_sort", "template=chatml"],
    ["train", "--model_name_or_path", "tiny", "--dataset", "demo_sort", "--template=chatml"],
    ["eval", "--model_name_or_path", "tiny", "--dataset", "demo_sort"],
])
def test_options_alone_are_a_config(capsys, argv):
    # Reaching the output_dir check means the options were read as the config (once: "config file ... does not exist")
    code, out, err = run(capsys, argv)
    assert (code, out) == (2, "")
    assert err in (
        "tunelab: error: output_dir is not set: add `output_dir: saves/my-run` to the config\n",
        "tunelab: error: output_dir is not set: tunelab eval writes predictions.jsonl there; add output_dir=...\n",
    )


def test_data_and_estimate_take_options_alone(capsys):
    code, _, err = run(capsys, ["data", "stats", "--dataset", "demo_sort", "--template", "chatml", "--lora_rnak", "2"])
    assert (code, err) == (2, "tunelab: error: unknown key 'lora_rnak' on the command line; did you mean 'lora_rank'?\n")
    code, _, err = run(capsys, ["estimate", "dataset=demo_sort", "template=chatml", "--probe-steps", "x"])
    assert (code, err) == (2, "tunelab: error: --probe-steps: expected a number, got 'x'\n")


# Each options-only command with the keys it may leave out left out: what it does then, exactly.
MINIMAL = ["--model_name_or_path", "tiny", "--dataset", "demo_sort", "--template", "chatml", "--max_samples", "16"]


@pytest.mark.parametrize("action", ["verify", "coverage"])
def test_data_verify_and_coverage_need_no_output_dir(capsys, action):
    code, out, err = run(capsys, ["data", action, *MINIMAL])
    assert code == 0 and "error" not in err
    assert out.splitlines()[0] == (
        "train: 2 batches, 16 samples, through PaddingFreeCollator (varlen): input_ids, labels, position_ids, "
        "cu_seq_lens_q, cu_seq_lens_k, attention_mask; first batch (1, 260)" if action == "verify"
        else "train: 16 samples, 536 tokens (tokenizer: byte-level, 864 entries; model vocab_size 864 from config.json)")


def test_data_stats_without_output_dir_prints_the_report_and_says_how_to_write_the_files(capsys, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere: not even here
    code, out, err = run(capsys, ["data", "stats", *MINIMAL])
    assert code == 0 and "error" not in err
    assert out.splitlines()[0] == "train: 16 samples (stage sft, template chatml, cutoff_len 2048)"
    assert out.splitlines()[-1] == ("length_histogram.png and stats.json not written: no output_dir or --out given; "
                                    "add --out FOLDER (or output_dir=...) to write them")
    assert list(tmp_path.iterdir()) == []
    code, out, _ = run(capsys, ["data", "stats", *MINIMAL, "--out", str(tmp_path / "stats")])
    assert code == 0 and sorted(p.name for p in (tmp_path / "stats").iterdir()) == ["length_histogram.png", "stats.json"]


def test_estimate_needs_no_output_dir(capsys):
    code, out, err = run(capsys, ["estimate", *MINIMAL, "--probe-steps", "0"])
    assert code == 0 and "error" not in err
    assert "  total " in out


@pytest.mark.parametrize(("argv", "message"), [
    (["train", *MINIMAL], "output_dir is not set: add `output_dir: saves/my-run` to the config"),
    (["train", "--template", "chatml", "--output_dir", "x"],
     "dataset is not set: name one or more datasets from dataset_info.json"),
    (["eval", *MINIMAL], "output_dir is not set: tunelab eval writes predictions.jsonl there; add output_dir=..."),
    (["export", "--model_name_or_path", "tiny"], "export_dir is not set: add export_dir=saves/my-model-merged"),
])
def test_a_key_a_command_cannot_do_without_is_one_line(capsys, argv, message):
    assert run(capsys, argv) == (2, "", f"tunelab: error: {message}\n")


def test_resume_command_without_a_yaml():
    assert resume_command(None, ["--dataset", "demo_sort", "output_dir=out"]) == (
        "tunelab train dataset=demo_sort output_dir=out resume_from_checkpoint=true"
    )


@pytest.mark.slow
def test_trl_style_run_with_save_steps_writes_checkpoints(tmp_path, capsys):
    from tunelab.infer.engine import load_engine  # noqa: PLC0415

    out = tmp_path / "out"
    code, stdout, _ = run(capsys, [
        "train", "--model_name_or_path", "tiny", "--dataset", "demo_sort", "--template", "qwen3_nothink", "--max_samples", "16",
        "--cutoff_len", "64", "--per_device_train_batch_size", "4", "--max_steps", "2", "--save_steps", "1",
        "--output_dir", str(out), "--disable_tqdm", "--plot_loss", "false",
    ])
    assert (code, stdout.splitlines()[-1]) == (0, f"saved to {out}")
    # save_steps alone turned checkpoints on (save_strategy: steps), as in LlamaFactory
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    recorded = yaml.safe_load((out / "tunelab_config.yaml").read_text())
    assert (recorded["save_strategy"], recorded["template"], recorded["template_kwargs"]) == (
        "steps", "qwen3", {"enable_thinking": False}
    )
    # trained without thinking, served without thinking
    engine = load_engine(str(out))
    assert (engine.template.name, engine.template_kwargs) == ("qwen3", {"enable_thinking": False})


# ---- train --help --------------------------------------------------------------------------------------


def test_train_help_lists_every_option_with_tunelab_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    lines = capsys.readouterr().out.splitlines()
    expected = [
        "    stage (default 'sft'; one of pt, sft, rm, dpo, kto, grpo, ppo, kd): Training stage.",
        "    finetuning_type (default 'lora'; one of lora, oft, vera, freeze, full): Which parameters train: lora "
        "(low-rank adapters, peft), oft (orthogonal rotations of the adapted layers, peft OFT), vera (two scaling "
        "vectors per layer over frozen random projections shared by all layers, peft VeRA), freeze (the last or first "
        "N decoder layers) or full.",
        "    logging_steps (tunelab default 10): Log every X updates steps.",
        "    report_to (tunelab default 'none'): The list of integrations to report the results and logs to.",
        "    save_strategy (tunelab default 'no'; one of no, steps, epoch, best): The checkpoint save strategy to adopt "
        "during training. tunelab: checkpoints are opt-in; the final model is always saved, and SIGTERM / SIGINT save one.",
        "    save_steps (default 500): Save checkpoint every X updates steps. tunelab: setting it without save_strategy "
        "turns on save_strategy: steps (as in LlamaFactory).",
        "    eval_strategy (default 'no'; one of no, steps, epoch): When to run evaluation.",
    ]
    for line in expected:
        assert line in lines
    assert any(line.startswith("    learning_rate (default 5e-05): ") for line in lines)
    assert any(line.startswith("    template_kwargs (default None): Variables the chat template reads") for line in lines)


# ---- chat / api with a YAML ----------------------------------------------------------------------------


def serving_namespace(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *argv])


def test_chat_and_api_read_model_adapter_and_template_from_a_yaml(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = tmp_path / "infer.yaml"
    cfg.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "adapter_name_or_path": str(adapter), "template": "qwen3_nothink",
        "trust_remote_code": True,
    }))
    for command in ("chat", "api"):
        assert _serving_choice(serving_namespace(command, str(cfg))) == {
            "path": str(adapter), "base_model": str(TINY_MODEL_DIR), "template": "qwen3",
            "template_kwargs": {"enable_thinking": False}, "trust_remote_code": True,
        }
    # flags win over the YAML
    flags = ("--template", "llama3_1", "--template-kwargs", '{"date_string": "01 Jan 2025"}', "--model", "elsewhere")
    assert _serving_choice(serving_namespace("chat", str(cfg), *flags)) == {
        "path": str(adapter), "base_model": "elsewhere", "template": "llama3_1",
        "template_kwargs": {"date_string": "01 Jan 2025"}, "trust_remote_code": True,
    }
    # a folder: as before, with the alias resolved
    assert _serving_choice(serving_namespace("chat", "tiny", "--template", "qwen3_nothink")) == {
        "path": "tiny", "base_model": None, "template": "qwen3", "template_kwargs": {"enable_thinking": False},
        "trust_remote_code": False,
    }


def test_chat_with_a_yaml_talks_to_its_model(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "infer.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "template": "qwen3_nothink"}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    code, out, err = run(capsys, ["chat", str(cfg), "--temperature", "0"])
    assert (code, out) == (0, ">>> ")
    assert err.splitlines()[0] == "chatting with tiny-llama (template qwen3); /image PATH attaches an image, /clear resets the history, /exit or Ctrl-D quits"


def test_serving_errors_are_one_line(tmp_path, capsys):
    cfg = tmp_path / "infer.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "template": "chatml", "infer_backend": "vllm"}))
    assert run(capsys, ["api", str(cfg)])[2] == (
        f"tunelab: error: infer_backend: vllm in {cfg}; LlamaFactory option: tunelab chat and tunelab api generate "
        "with transformers: remove it (tunelab accepts infer_backend: huggingface)\n"
    )
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "template": "chatml",
                                   "template_kwargs": {"enable_thinking": False}}))
    assert run(capsys, ["api", str(cfg)])[:3:2] == (2, (
        "tunelab: error: template_kwargs: template 'chatml' does not read 'enable_thinking'; it reads no variables "
        "besides the conversation\n"
    ))
    assert run(capsys, ["chat", "tiny", "--template-kwargs", "enable_thinking"])[:3:2] == (2, (
        "tunelab: error: --template-kwargs: expected a JSON object such as '{\"enable_thinking\": false}', "
        "got 'enable_thinking'\n"
    ))
    for flag in ("--max-request-bytes", "--max-batch-size"):
        assert run(capsys, ["api", "tiny", flag, "0"])[:3:2] == (
            2, f"tunelab: error: {flag}: expected an integer >= 1, got 0\n")


def test_a_deepspeed_json_that_does_not_parse_is_one_line(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2,}}')
    code, out, err = run(capsys, ["train", "dataset=demo_sort", "template=chatml", f"output_dir={tmp_path / 'o'}",
                                  f"deepspeed={ds}", "nproc_per_node=2"])
    assert (code, out) == (2, "")
    assert err == (
        f"tunelab: error: deepspeed: {ds} is not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 35 (char 34))\n"
    )
    ds = Path(__file__).resolve().parents[1] / "examples" / "deepspeed" / "ds_z2_config.json"
    assert json.loads(ds.read_text())  # the example file itself is fine
