"""`tunelab export` end to end on the embedded tiny model: a LoRA run exported as a folder or a GGUF (+ Modelfile),
read back and checked against base + adapter (export_report.json, the printed summary), a broken export stopping
with one line, and the option combinations refused before anything loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.export_formats import GGUF_TYPES
from tunelab.data.templates import builtin_source
from tunelab.export import gguf_writer
from tunelab.export.gguf_writer import TENSOR_TYPES, embedded_chat_template
from tunelab.export.parity import STORED_TOLERANCE, TOLERANCES, _gguf_header_value, llama_cpp_available

LLAMA_CPP = int(llama_cpp_available())  # the check adds llama.cpp's reading of a GGUF where it is installed
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA adapter folder as a tunelab run saves one: non-zero LoRA weights (so merging changes the model), the
    tokenizer with the qwen3 template it trained with, and the run record: template qwen3, thinking off."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=LINEARS, init_lora_weights=False)).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.chat_template = builtin_source("qwen3")
    tokenizer.save_pretrained(folder)
    (folder / "tunelab_config.yaml").write_text(yaml.safe_dump(
        {"template": "qwen3", "template_kwargs": {"enable_thinking": False}}))
    return folder


def _export(capsys, *options: str) -> tuple[int, list[str], str]:
    code = main(["export", *options])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


@pytest.mark.parametrize("tensor_type", ["f16", "q8_0"])
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_lora_run_exports_to_a_checked_gguf_and_modelfile(lora_run, tmp_path, capsys, tensor_type):
    out = tmp_path / "gguf"
    code, lines, err = _export(capsys, f"adapter_name_or_path={lora_run}", f"export_dir={out}",
                               "export_format=gguf", f"export_gguf_type={tensor_type}")
    name = f"model-{tensor_type}.gguf"
    assert code == 0 and "error" not in err
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "export_report.json", name, "tunelab_config.yaml"]
    assert lines[0] == f"exported to {out / name}"
    assert lines[1].startswith(f"export check: gguf {name} ({tensor_type}, ")
    assert lines[2].startswith("  merge: base + adapter against the merged model, max logit gap ")
    assert lines[2].endswith(" sd (tolerance 0.0001)")
    assert lines[3].startswith("  transformers (GGUF loader): template same, ids same, max logit gap ")
    assert f"; tolerance {TOLERANCES[tensor_type]:g}), 0 sd from the weights as stored, greedy answers identical" in lines[3]
    if LLAMA_CPP:  # llama.cpp's own server read it too: its Jinja, tokenizer, first answer token and answers
        assert lines[4].startswith("  llama.cpp (xllamacpp server): template same, ids same, max logit gap at the "
                                   "first answer token (top 20) ")
        assert "greedy answers identical" in lines[4]
    assert len(lines) == 4 + LLAMA_CPP  # no problem lines

    report = json.loads((out / "export_report.json").read_text())
    assert (report["ok"], report["kind"], report["tensor_type"]) == (True, "gguf", tensor_type)
    assert report["file_bytes"] == (out / name).stat().st_size
    assert 0 < report["merge"]["max_logit_gap"] <= report["merge"]["tolerance"] == TOLERANCES["f32"]
    reader, *others = report["readers"]
    assert reader["reader"] == "transformers (GGUF loader)"
    assert [r["reader"] for r in others] == ["llama.cpp (xllamacpp server)"] * LLAMA_CPP
    assert all(r["template_identical"] and r["ids_identical"] and r["greedy_identical"] for r in others)
    assert reader["template_identical"] and reader["ids_identical"] and reader["special_tokens_identical"]
    assert 0 < reader["max_logit_gap"] <= TOLERANCES[tensor_type] and reader["stored_gap"] <= STORED_TOLERANCE
    assert reader["greedy_identical"] and reader["greedy_required"] == (tensor_type == "f16")
    # The probes were rendered with the template the run trained with: qwen3, thinking off.
    assert all(probe["prompt"].endswith("<|im_start|>assistant\n" + EMPTY_THINK) for probe in reader["probes"])

    # The file carries that template with the variable set inside, and reads back to base + adapter.
    field = gguf.GGUFReader(out / name).fields["tokenizer.chat_template"]
    assert field.contents() == embedded_chat_template(builtin_source("qwen3"), {"enable_thinking": False})
    modelfile = (out / "Modelfile").read_text()
    assert f"FROM ./{name}\n" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "<|im_start|>assistant\n" + EMPTY_THINK + "{{ end }}" in modelfile  # Ollama prompts as training did
    exported = AutoModelForCausalLM.from_pretrained(out, gguf_file=name, dtype=torch.float32).eval()
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), lora_run).eval()
    ids = torch.tensor([[5, 17, 40, 3, 99, 12, 7]])
    with torch.no_grad():
        gap = (exported(ids).logits - trained(ids).logits).abs().max().item()
    assert gap <= {"f16": 0.01, "q8_0": 0.3}[tensor_type]


def test_a_folder_export_is_checked_with_plain_transformers(lora_run, tmp_path, capsys):
    out = tmp_path / "hf"
    code, lines, _ = _export(capsys, f"adapter_name_or_path={lora_run}", f"export_dir={out}", "export_dtype=float16")
    assert code == 0 and lines[0] == f"exported to {out}"
    assert lines[1].startswith("export check: hf hf (f16, ")
    assert lines[3].startswith("  transformers: template same, ids same, max logit gap ")
    report = json.loads((out / "export_report.json").read_text())
    (reader,) = report["readers"]
    assert (report["ok"], report["kind"], report["tensor_type"], reader["reader"]) == (True, "hf", "f16", "transformers")
    assert 0 < reader["max_logit_gap"] <= TOLERANCES["f16"] and reader["stored_gap"] <= STORED_TOLERANCE
    assert reader["greedy_identical"] and report["merge"]["max_logit_gap"] <= TOLERANCES["f32"]
    # The folder's tokenizer carries the run's template; its variables travel in tunelab_config.yaml.
    assert AutoTokenizer.from_pretrained(out).chat_template == builtin_source("qwen3")
    assert yaml.safe_load((out / "tunelab_config.yaml").read_text())["template_kwargs"] == {"enable_thinking": False}


def test_a_gguf_with_the_wrong_template_fails_the_export(lora_run, tmp_path, capsys, monkeypatch):
    """The export bug: the GGUF gets the template without the run's variables (Qwen3 would think again)."""
    write_gguf = gguf_writer.write_gguf

    def forgetful(model, tokenizer, chat_template, template_vars, *args, **kwargs):
        return write_gguf(model, tokenizer, chat_template, None, *args, **kwargs)

    monkeypatch.setattr(gguf_writer, "write_gguf", forgetful)
    out = tmp_path / "broken"
    code, lines, err = _export(capsys, f"adapter_name_or_path={lora_run}", f"export_dir={out}", "export_format=gguf",
                               "export_gguf_type=f16")
    assert code == 2
    assert err.splitlines()[-1] == (
        "tunelab: error: export check failed for model-f16.gguf: the GGUF's chat template differs from the trained one "
        "at character 1: '#- Qwen3 (hybrid thinking): Ch' instead of '%- set enable_thinking = false'"
        + (" (and 1 more problem(s), see export_report.json)" if LLAMA_CPP else "")  # llama.cpp's reading says so too
    )
    assert lines[0].startswith("export check: gguf model-f16.gguf (f16, ")
    assert "template DIFFERENT" in lines[2]
    report = json.loads((out / "export_report.json").read_text())
    assert report["ok"] is False and not report["readers"][0]["template_identical"]


def test_an_adapter_that_does_not_merge_as_it_computes_fails_the_export(lora_run, tmp_path, capsys, monkeypatch):
    """The export bug: the adapter dropped instead of merged (the folder is then the base model)."""
    monkeypatch.setattr(PeftModel, "merge_and_unload", lambda self: self.base_model.unload(), raising=False)
    out = tmp_path / "unmerged"
    code, lines, err = _export(capsys, f"adapter_name_or_path={lora_run}", f"export_dir={out}", "export_dtype=float32")
    assert code == 2
    assert err.splitlines()[-1].startswith("tunelab: error: export check failed for unmerged: the merged model's "
                                           "logits differ by up to ")
    assert err.endswith(" standard deviations from base + adapter, where a float32 merge stays within 0.0001: the "
                        "adapter did not merge as it computes\n")
    assert json.loads((out / "export_report.json").read_text())["merge"]["max_logit_gap"] > 0.1


def test_export_parity_false_skips_the_check(tmp_path, capsys):
    out = tmp_path / "unchecked"
    code, lines, _ = _export(capsys, "model_name_or_path=tiny", f"export_dir={out}", "export_format=gguf",
                             "export_gguf_type=f32", "export_parity=false")
    assert (code, lines) == (0, [f"exported to {out / 'model-f32.gguf'}", "export check: skipped (export_parity: false)"])
    assert not (out / "export_report.json").exists()


@pytest.mark.parametrize(("options", "message"), [
    (["export_gguf_type=f16"],
     "export_gguf_type: f16 applies to export_format: gguf; add export_format=gguf, or remove export_gguf_type to "
     "export a Hugging Face folder"),
    (["export_format=gguf", "export_gguf_type=q4_k_s"],
     "export_gguf_type: 'q4_k_s' is not a type tunelab writes; other k-quants and i-quants need llama.cpp's "
     "llama-quantize: export f16 and quantize that file (docs/deploy.md); types: f32, f16, bf16, q8_0, q5_1, q5_0, "
     "q4_1, q4_0, q6_k, q5_k_m, q4_k_m"),
    (["export_format=gguf", "export_gguf_type=Q4_K_M"],
     "export_gguf_type: 'Q4_K_M' is not a type tunelab writes; did you mean 'q4_k_m'? types: f32, f16, bf16, q8_0, "
     "q5_1, q5_0, q4_1, q4_0, q6_k, q5_k_m, q4_k_m"),
    (["export_format=gguf", "export_quantization=int8-weight"],
     "export_quantization applies to export_format: hf, not gguf: a GGUF is quantized by export_gguf_type (q8_0 ... "
     "q4_0), not torchao; remove export_quantization"),
    (["export_format=gguf", "export_dtype=bfloat16"],
     "export_dtype applies to export_format: hf, not gguf: a GGUF's tensor type is export_gguf_type (f32, f16, bf16, "
     "...); remove export_dtype"),
    (["export_format=ggml"], "export_format: 'ggml' is not one of hf, gguf"),
    (["export_format=gguf", "model_name_or_path=tiny-vision"],
     "export_format gguf: tunelab writes GGUF for text models; a vision-language model exports with export_format: hf"),
])
def test_export_options_that_cannot_work_together_are_one_line(tmp_path, capsys, options, message):
    code, lines, err = _export(capsys, f"export_dir={tmp_path / 'x'}", *options)
    assert (code, lines, err.splitlines()[-1]) == (2, [], f"tunelab: error: {message}")
    assert not (tmp_path / "x").exists()


def test_an_architecture_gguf_cannot_write_is_refused_before_loading(tmp_path, capsys):
    folder = tmp_path / "phi3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", folder)
    code, _, err = _export(capsys, f"model_name_or_path={folder}", f"export_dir={tmp_path / 'x'}", "export_format=gguf")
    assert (code, err.splitlines()[-1]) == (2, "tunelab: error: export_format gguf: cannot write model_type 'phi3'; "
                                               "tunelab writes GGUF for llama, mistral, qwen2, qwen3, gemma2, gemma3_text")


def test_the_config_names_every_type_the_writer_writes_and_no_other():
    assert list(GGUF_TYPES) == list(TENSOR_TYPES)


def test_the_file_type_is_read_from_the_header_alone(tiny_gguf):
    for tensor_type, (_, file_type) in TENSOR_TYPES.items():
        if tensor_type in ("f32", "f16", "q8_0"):
            path = tiny_gguf(tensor_type)
            assert _gguf_header_value(path, "general.file_type") == int(file_type)
            assert _gguf_header_value(path, "tokenizer.ggml.bos_token_id") == gguf.GGUFReader(path).fields[
                "tokenizer.ggml.bos_token_id"].contents()  # after the vocabulary's arrays
    assert _gguf_header_value(tiny_gguf("f16"), "no.such.key") is None


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_check_only_rechecks_an_existing_export(lora_run, tmp_path, capsys):
    """`tunelab export --check-only` writes nothing and runs the same check on what is there; checked against another
    template than the file carries, it fails; no export there is one line."""
    out = tmp_path / "gguf"
    options = [f"adapter_name_or_path={lora_run}", f"export_dir={out}", "export_format=gguf", "export_gguf_type=f16"]
    code, _, err = _export(capsys, "--check-only", *options)
    assert code == 2 and err.strip() == (
        f"tunelab: error: --check-only: {out / 'model-f16.gguf'} does not exist (export_gguf_type f16); export first, "
        "or point export_dir and the export options at the existing export")
    assert _export(capsys, *options)[0] == 0
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, lines, _ = _export(capsys, *options, "--check-only")
    assert code == 0 and lines[0] == f"checked {out / 'model-f16.gguf'}"
    assert lines[1].startswith("export check: gguf model-f16.gguf (f16, ")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != "export_report.json"} == {
        k: v for k, v in written.items() if k != "export_report.json"}  # nothing but the report rewritten

    # Checked against other template variables than the file was written with: the check names the template.
    code, lines, err = _export(capsys, "--check-only", *options, 'template_kwargs={"enable_thinking": true}')
    assert code == 2
    assert err.splitlines()[-1].startswith(
        "tunelab: error: export check failed for model-f16.gguf: the GGUF's chat template differs from the trained one")


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_the_check_scores_held_out_rows_when_named(lora_run, tmp_path, capsys):
    """export_check_dataset: the trained model and every reader answer the same held-out rows; both accuracies are
    printed and saved (this random adapter scores what its export scores, so nothing is flagged)."""
    out = tmp_path / "scored"
    code, lines, err = _export(capsys, f"adapter_name_or_path={lora_run}", f"export_dir={out}", "export_format=gguf",
                               "export_gguf_type=f16", "export_check_dataset=demo_sort_test", "export_check_samples=3",
                               "max_new_tokens=8")
    assert code == 0, err
    report = json.loads((out / "export_report.json").read_text())
    held_out = report["held_out"]
    assert (held_out["source"], held_out["rows"], held_out["max_drop"]) == ("demo_sort_test", 3, 5.0)
    assert all(r["accuracy"] == held_out["reference_accuracy"] for r in report["readers"])
    assert lines[-1] == (f"  held-out exact match (3 rows of demo_sort_test, greedy): trained "
                         f"{100 * held_out['reference_accuracy']:.1f}%, " + ", ".join(
                             f"{r['reader']} {100 * r['accuracy']:.1f}%" for r in report["readers"])
                         + " (allowed drop 5 points)")
