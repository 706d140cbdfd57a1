"""GGUF files as a model source (model/gguf.py): the embedded tiny Llama written as GGUF by tunelab's own writer, then
trained, chatted with and exported from that file as a user's llama.cpp / Ollama download would be.

f32: the loaded weights are exactly the tiny model's; q8_0: exactly the gguf package's dequantization of the file.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    dequantize,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests.hub_cache import config_outcomes, hub_env, lay_out
from tests.real_assets import real
from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.args import ModelArguments
from tunelab.data.templates import get_template, tokenizer_chat_template
from tunelab.errors import ConfigError
from tunelab.export.gguf_writer import write_gguf
from tunelab.infer.engine import load_engine
from tunelab.infer.sampling import SamplingOptions
from tunelab.model import gguf, gguf_weights
from tunelab.model.skeleton import vocab_size
from tunelab.model.tokenizer import load_tokenizer
from tunelab.preflight import load_config
from tunelab.train.outputs import run_options

# ChatML with a system prompt of its own: a template only this file has, so `template: model` is seen to use it.
FILE_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are read from a GGUF.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HUB_COMMIT = hashlib.sha1(b"gguf").hexdigest()


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny model as f32 and q8_0 GGUF files carrying FILE_TEMPLATE, in one folder."""
    folder = tmp_path_factory.mktemp("gguf-models")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    return {kind: write_gguf(tiny, tokenizer, FILE_TEMPLATE, None, folder / f"tiny-{kind}.gguf", kind)
            for kind in ("f32", "q8_0")}


def dequantized(path: Path, name: str) -> torch.Tensor:
    """A tensor of the file as the gguf package dequantizes it (numpy's row-major shape)."""
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape))).copy())


def train(tmp_path: Path, **options) -> Path:
    out = tmp_path / "out"
    config = {"template": "model", "dataset": "demo_reverse", "max_samples": 8, "cutoff_len": 48,
              "output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3,
              "finetuning_type": "lora", "seed": 0, "disable_tqdm": True, "plot_loss": False, **options}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    return out


# ---- loading ------------------------------------------------------------------------------------------------------


def test_an_f32_gguf_loads_exactly_the_models_weights_and_a_q8_0_its_dequantized_ones(tiny, files):
    model = gguf.from_pretrained(AutoModelForCausalLM, files["f32"], dtype=torch.float32)
    expected, loaded = tiny.state_dict(), model.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert [name for name in expected if not torch.equal(loaded[name], expected[name])] == []
    # a dense model, saved like any other: no GGUF quantization marks left, the file as its name
    assert (getattr(model, "hf_quantizer", None), hasattr(model.config, "quantization_config")) == (None, False)
    assert model.name_or_path == str(files["f32"])

    q8 = gguf.from_pretrained(AutoModelForCausalLM, files["q8_0"], dtype=torch.bfloat16)  # to the compute dtype
    assert q8.dtype == torch.bfloat16
    for gguf_name, name in (("token_embd.weight", "model.embed_tokens.weight"),
                            ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")):
        want = dequantized(files["q8_0"], gguf_name)
        assert not torch.equal(want, expected[name])  # q8_0 did round the weights
        assert torch.equal(q8.state_dict()[name], want.to(torch.bfloat16))


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_the_tensor_by_tensor_load_equals_transformers_own_loader(files, monkeypatch):
    # every matrix over 256 values in chunks of rows (the embedding), or whole where the Llama processor reorders it
    # (q and k): the same weights as transformers' loader gives, in float32 and in bf16
    monkeypatch.setattr(gguf_weights, "CHUNK_VALUES", 256)
    chunked, asked = set(), gguf_weights._passes_through

    def passes_through(*args):
        answer = asked(*args)
        if answer:
            chunked.add(args[2])
        return answer

    monkeypatch.setattr(gguf_weights, "_passes_through", passes_through)
    for dtype in (torch.float32, torch.bfloat16):
        ours = gguf.from_pretrained(AutoModelForCausalLM, files["q8_0"], dtype=dtype).state_dict()
        theirs = gguf._from_pretrained_by_transformers(AutoModelForCausalLM, files["q8_0"], dtype=dtype).state_dict()
        assert sorted(ours) == sorted(theirs)
        assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    assert "token_embd.weight" in chunked and "blk.0.ffn_up.weight" in chunked and "blk.0.attn_q.weight" not in chunked


def test_a_reward_head_loads_on_a_gguf_backbone(files):
    # stage rm's load: num_labels and pad_token_id are the config's, the new score head the only missing weight
    model, info = gguf.from_pretrained(AutoModelForSequenceClassification, files["f32"], dtype=torch.float32,
                                       num_labels=1, pad_token_id=0, output_loading_info=True)
    assert (model.config.num_labels, model.config.pad_token_id) == (1, 0)
    assert sorted(info["missing_keys"]) == ["score.weight"]


def test_the_tokenizer_and_template_model_come_from_the_file(files):
    assert tokenizer_chat_template(files["q8_0"]) == FILE_TEMPLATE
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(files["q8_0"])))
    assert tokenizer.chat_template == FILE_TEMPLATE
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(TINY_MODEL_DIR).get_vocab()
    rendered = get_template("model", tokenizer).render(
        [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w2 w1"}])
    assert rendered == ("<|im_start|>system\nYou are read from a GGUF.<|im_end|>\n<|im_start|>user\nw1 w2<|im_end|>\n"
                        "<|im_start|>assistant\nw2 w1<|im_end|>\n")


def test_file_record_has_the_sha256_and_quantization_type(files):
    record = gguf.file_record(files["q8_0"])
    assert record == {
        "file": str(files["q8_0"]), "sha256": hashlib.sha256(files["q8_0"].read_bytes()).hexdigest(),
        "quantization": "Q8_0", "architecture": "llama", "tensor_types": {"F32": 9, "Q8_0": 29},
    }
    assert gguf.file_record(files["f32"])["quantization"] == "F32"
    for path in files.values():  # tunelab's quick header reader agrees with the gguf package's
        reader = GGUFReader(str(path))
        header = gguf.read_header(path)
        assert gguf.tensor_types(header) == Counter(t.tensor_type.name for t in reader.tensors)
        assert header.string("tokenizer.chat_template") == str(reader.get_field("tokenizer.chat_template").contents())
        assert header.metadata["llama.block_count"] == reader.get_field("llama.block_count").contents()
        assert vocab_size(path) == gguf.load_config(path).vocab_size == 864  # `tunelab data` reads it from the header


# ---- train, chat, export ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(files, tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("gguf-lora"), model_name_or_path=str(files["q8_0"]))


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_lora_on_a_gguf_file_records_the_file_and_trains_with_its_template(lora_run, files):
    assert (lora_run / "adapter_model.safetensors").is_file() and not (lora_run / "model.safetensors").exists()
    info = json.loads((lora_run / "run_info.json").read_text())
    assert info["gguf"] == {
        "file": str(files["q8_0"]), "sha256": hashlib.sha256(files["q8_0"].read_bytes()).hexdigest(),
        "quantization": "Q8_0", "architecture": "llama", "tensor_types": {"F32": 9, "Q8_0": 29},
    }
    assert yaml.safe_load((lora_run / "tunelab_config.yaml").read_text())["model_name_or_path"] == str(files["q8_0"])
    assert json.loads((lora_run / "adapter_config.json").read_text())["base_model_name_or_path"] == str(files["q8_0"])
    assert (lora_run / "chat_template.jinja").read_text() == FILE_TEMPLATE


def test_chat_loads_a_gguf_file_and_an_adapter_trained_on_one(lora_run, files):
    engine = load_engine(str(files["q8_0"]), dtype="float32")
    assert engine.template.jinja == FILE_TEMPLATE
    weight = engine.model.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(weight, dequantized(files["q8_0"], "blk.1.ffn_down.weight"))
    tuned = load_engine(str(lora_run), dtype="float32")  # its base: the file its adapter_config.json names
    base = tuned.model.get_base_model().state_dict()["model.layers.1.mlp.down_proj.base_layer.weight"]
    assert torch.equal(base, weight)
    greedy = SamplingOptions(temperature=0, max_new_tokens=4)
    question = [{"role": "user", "content": "w3 w4"}]
    answer = "".join(tuned.generate(question, greedy))
    with torch.no_grad():  # the same greedy answer as the merged model's own generate
        ids = tuned.prompt_ids(question)
        out = tuned.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                   eos_token_id=tuned.stop_ids, pad_token_id=tuned.pad_id)
    assert answer == tuned.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_qlora_quantizes_the_dequantized_weights_exactly_as_a_folders(files, tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'tunelab[qlora]')")
    from tunelab.model.quantization import build_quantization_config  # noqa: PLC0415 - only with bitsandbytes

    dense = gguf.from_pretrained(AutoModelForCausalLM, files["q8_0"], dtype=torch.float32)
    dense.save_pretrained(tmp_path / "folder")  # the same dequantized weights as a plain folder

    def qlora(path):
        config = build_quantization_config(ModelArguments(model_name_or_path=str(path), quantization_bit=4),
                                           torch.float32)
        return gguf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.float32, quantization_config=config)

    from_file, from_folder = qlora(files["q8_0"]), qlora(tmp_path / "folder")
    assert from_file.is_loaded_in_4bit and type(from_file.model.layers[1].mlp.down_proj).__name__ == "Linear4bit"
    packed, expected = from_file.state_dict(), from_folder.state_dict()  # 4-bit blocks and their quantization states
    assert sorted(packed) == sorted(expected)
    assert [name for name in expected if not torch.equal(packed[name], expected[name])] == []
    assert from_file.name_or_path == str(files["q8_0"])


def test_export_merges_the_adapter_into_the_dequantized_base(lora_run, files, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["export", f"model_name_or_path={files['q8_0']}", f"adapter_name_or_path={lora_run}",
                 f"export_dir={out}"]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # without the file as model_name_or_path the export would merge into the default model: refused, naming it
    assert main(["export", f"adapter_name_or_path={lora_run}", f"export_dir={tmp_path / 'other'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tunelab: error: model_name_or_path: the adapter {lora_run} was trained on the GGUF file {files['q8_0']}; "
        f"set model_name_or_path to that file (now {TINY_MODEL_DIR})")  # the default, 'tiny'
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], dequantized(files["q8_0"], "token_embd.weight"))
    assert not torch.equal(weights["model.layers.1.mlp.down_proj.weight"],
                           dequantized(files["q8_0"], "blk.1.ffn_down.weight"))  # the adapter's update is in


# ---- resolving and refusing ---------------------------------------------------------------------------------------


def test_a_folder_plus_gguf_file_resolves_to_the_file(files):
    folder = files["f32"].parent
    config = load_config(None, {"model_name_or_path": str(folder), "gguf_file": "tiny-f32.gguf",
                                "dataset": "demo_reverse"}, purpose="data")
    assert (config.model.model_name_or_path, config.model.gguf_file) == (str(files["f32"]), None)
    with pytest.raises(ConfigError) as missing:
        load_config(None, {"model_name_or_path": str(folder), "gguf_file": "tiny-q4.gguf",
                           "dataset": "demo_reverse"}, purpose="data")
    assert str(missing.value) == (f"gguf_file: {folder / 'tiny-q4.gguf'} is not a file; the folder holds "
                                  "tiny-f32.gguf, tiny-q8_0.gguf")
    for overrides, message in (
        ({"gguf_file": "tiny.bin"}, ("gguf_file: 'tiny.bin' is not a .gguf file name; name the GGUF file inside "
                                     "model_name_or_path")),
        ({"model_name_or_path": str(files["f32"]), "gguf_file": "x.gguf"},
         f"gguf_file: model_name_or_path {files['f32']} is already a GGUF file; remove gguf_file"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config(None, {"model_name_or_path": str(folder), "dataset": "demo_reverse", **overrides}, purpose="data")
        assert str(refused.value) == message


def _gguf_with(path: Path, architecture: str, tensor_type: GGMLQuantizationType) -> Path:
    """A one-tensor GGUF: an architecture or a tensor type of our choosing."""
    writer = GGUFWriter(str(path), architecture)
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    else:  # one block of 256 values a row, as raw bytes
        writer.add_tensor("token_embd.weight", np.zeros((4, GGML_QUANT_SIZES[tensor_type][1]), np.uint8),
                          raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_or_type_transformers_cannot_read_is_one_line(tmp_path, capsys):
    odd = _gguf_with(tmp_path / "odd.gguf", "rwkv7", GGMLQuantizationType.F32)
    assert main(["data", "stats", f"model_name_or_path={odd}", "dataset=demo_reverse"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tunelab: error: model_name_or_path: odd.gguf holds a GGUF of architecture 'rwkv7', which "
                   f"transformers cannot read; it reads {', '.join(gguf.readable_architectures())}")
    assert {"llama", "qwen2", "qwen3", "gemma3", "phi3"} <= set(gguf.readable_architectures())

    k8 = _gguf_with(tmp_path / "k8.gguf", "llama", GGMLQuantizationType.Q8_K)
    with pytest.raises(ConfigError) as refused:
        gguf.check_readable(k8)
    readable = gguf.readable_types("llama")
    assert str(refused.value) == ("model_name_or_path: k8.gguf stores tensors as Q8_K, which transformers cannot "
                                  f"dequantize; it reads {', '.join(readable)}: use a file of another quantization")
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= set(readable)
    assert "Q8_K" not in readable

    (tmp_path / "fake.gguf").write_text("not a model")
    with pytest.raises(ConfigError) as refused:
        gguf.check_readable(tmp_path / "fake.gguf")
    assert str(refused.value) == (f"model_name_or_path: {tmp_path / 'fake.gguf'} is not a readable GGUF file (it does "
                                  "not start with the GGUF magic bytes)")


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_a_hub_id_with_gguf_file_resolves_through_the_cache(files, tmp_path):
    cache = tmp_path / "hf" / "hub"
    lay_out(cache, "org/tiny-GGUF", {"tiny-q8_0.gguf": files["q8_0"]}, HUB_COMMIT)
    base = ["model_name_or_path=org/tiny-GGUF", "dataset=demo_reverse", "template=model", f"output_dir={tmp_path / 'out'}"]
    outcomes = config_outcomes({
        "cached": (None, [*base, "gguf_file=tiny-q8_0.gguf"]),
        "not cached": (None, [*base, "gguf_file=tiny-q4_0.gguf"]),
        "uncached repo": (None, [*base, "model_name_or_path=org/other-GGUF", "gguf_file=x.gguf"]),
    }, hub_env(cache), tmp_path)
    snapshot = cache / "models--org--tiny-GGUF" / "snapshots" / HUB_COMMIT
    assert outcomes["cached"] == f"ok {snapshot / 'tiny-q8_0.gguf'}"
    assert outcomes["not cached"] == (
        f"model_name_or_path: org/tiny-GGUF (gguf_file: tiny-q4_0.gguf) is not in the Hugging Face cache ({cache}), "
        "and HF_HUB_OFFLINE is set; fetch it with `hf download org/tiny-GGUF tiny-q4_0.gguf` or unset HF_HUB_OFFLINE")
    assert outcomes["uncached repo"] == (
        f"model_name_or_path: org/other-GGUF (gguf_file: x.gguf) is no local folder, not in the Hugging Face cache "
        f"({cache}), and HF_HUB_OFFLINE is set; fetch it with `hf download org/other-GGUF` or unset HF_HUB_OFFLINE")


def test_a_hub_gguf_is_recorded_by_repo_commit_and_file(files, tmp_path):
    snapshot = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / HUB_COMMIT
    (snapshot / "q8").mkdir(parents=True)
    (snapshot / "q8" / "tiny.gguf").write_bytes(files["q8_0"].read_bytes())
    config = load_config(None, {"model_name_or_path": str(snapshot), "gguf_file": "q8/tiny.gguf",
                                "dataset": "demo_reverse", "output_dir": str(tmp_path / "out")})
    options = run_options(config)  # what tunelab_config.yaml records: it reruns from the Hub anywhere
    assert (options["model_name_or_path"], options["model_revision"], options["gguf_file"]) == (
        "org/tiny-GGUF", HUB_COMMIT, "q8/tiny.gguf")


# ---- a real file --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_smollm2_q4_1_gguf_answers_and_is_recorded():
    path = real("smollm2")
    gguf.check_readable(path)
    record = gguf.file_record(path)
    assert (record["sha256"], record["quantization"], record["architecture"], record["tensor_types"]) == (
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Q4_1", "llama",
        {"F32": 61, "Q4_1": 210, "Q8_0": 1})
    engine = load_engine(str(path), dtype="float32")
    assert engine.template.jinja == tokenizer_chat_template(path)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = "".join(engine.generate(question, SamplingOptions(temperature=0, max_new_tokens=12)))
    assert answer.startswith("The capital of France is Paris.")
