"""write_gguf: llama.cpp's names, layouts, types and metadata, proved by reading the files back.

transformers' GGUF loader is the independent reader: it undoes llama.cpp's conventions on its own (its reverse
q/k permutation, Gemma's norm offset, tokenizer rebuilt from the metadata), so an f32 file that reloads to the
same logits was written the way llama.cpp lays models out. Layout details are also checked on the raw file.
"""

from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
    PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, TokenizersBackend,
)

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data.templates import Template, builtin_source
from tunelab.export import gguf_writer, kquants
from tunelab.export.gguf_writer import (
    ExportError, Provenance, embedded_chat_template, source_provenance, write_gguf,
)
from tunelab.errors import TunelabError

TEXT = "<|im_start|>user\nWhat is 12+30? ünï 🙂 the quick brown fox<|im_end|>\n<|im_start|>assistant\n"


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def _reload(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_tiny_f32_reloads_to_identical_logits_ids_and_template(tiny, tiny_gguf):
    model, tokenizer = _reload(tiny_gguf("f32"))
    ids = tiny.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.chat_template == tiny.chat_template
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])).logits, tiny.model(torch.tensor([ids])).logits)


def test_metadata_follows_llama_cpp(tiny, tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf("q8_0"))
    config = tiny.model.config
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert _field(reader, "llama.block_count") == config.num_hidden_layers
    assert _field(reader, "llama.embedding_length") == config.hidden_size
    assert _field(reader, "llama.attention.head_count_kv") == config.num_key_value_heads
    assert _field(reader, "llama.rope.dimension_count") == config.head_dim
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "smollm"  # Digits(individual) + ByteLevel, as SmolLM's
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.ggml.bos_token_id") == tiny.tokenizer.bos_token_id
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tiny.tokenizer.eos_token_id
    assert _field(reader, "tokenizer.ggml.eot_token_id") == tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert _field(reader, "tokenizer.chat_template") == tiny.chat_template
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == config.vocab_size
    assert types[tokens.index("<|im_end|>")] == gguf.TokenType.CONTROL
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied head: llama.cpp reuses token_embd


def test_provenance_is_carried_over(tiny, tmp_path):
    """A run trained from SmolLM2's GGUF: general.name is the run's, the source is general.base_model.0 with its
    organization, its licence is kept, and its pre-tokenizer name (smollm) replaces the generic gpt-2 of the
    tokenizer transformers rebuilt from it. Exported without a run name, the file keeps the source's own name."""
    from tests.real_assets import real  # noqa: PLC0415

    source = source_provenance(real("smollm2"))
    assert source == Provenance("Smollm2 135M 8k Lc100K Mix1 Ep2", "HuggingFaceTB", "apache-2.0", "smollm")
    plain = copy.deepcopy(tiny.tokenizer)
    spec = json.loads(plain.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                    bos_token=tiny.tokenizer.bos_token, eos_token=tiny.tokenizer.eos_token)
    trained = gguf.GGUFReader(write_gguf(tiny.model, plain, tiny.chat_template, None, tmp_path / "run.gguf", "f16",
                                         name="my-run", source=source))
    assert _field(trained, "general.name") == "my-run"
    assert _field(trained, "general.base_model.count") == 1
    assert _field(trained, "general.base_model.0.name") == source.name
    assert _field(trained, "general.base_model.0.organization") == "HuggingFaceTB"
    assert _field(trained, "general.license") == "apache-2.0"
    assert _field(trained, "tokenizer.ggml.pre") == "smollm"
    same = gguf.GGUFReader(write_gguf(tiny.model, tiny.tokenizer, tiny.chat_template, None, tmp_path / "s.gguf",
                                      "f16", source=source))
    assert _field(same, "general.name") == source.name and _field(same, "general.organization") == "HuggingFaceTB"
    assert "general.base_model.count" not in same.fields


def test_provenance_of_a_hugging_face_folder(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# A model\n")
    assert source_provenance(tmp_path) == Provenance(tmp_path.name, None, "mit", None)
    assert source_provenance("HuggingFaceTB/SmolLM2-135M-Instruct") == Provenance(
        "SmolLM2-135M-Instruct", "HuggingFaceTB", None, None)


def test_tensor_types_follow_llama_cpp(tiny_gguf):
    """Norms and other 1-D tensors stay f32; every matrix gets the requested type; in a 4-bit file the tied
    head/embedding gets q8_0 (llama-quantize's q6_k cannot be written by gguf-py)."""
    for tensor_type, matrix in (("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tiny_gguf(tensor_type)).tensors}
        f32 = {name for name, kind in types.items() if kind == "F32"}
        assert f32 == {name for name in types if name.endswith("norm.weight")}
        assert types["blk.0.attn_q.weight"] == matrix
        assert types["token_embd.weight"] == ("Q8_0" if tensor_type == "q4_0" else matrix)


def test_llama_q_and_k_rows_are_permuted_as_llama_cpp_does(tiny, tiny_gguf):
    """HF rotates half-dimension pairs (i, i + d/2); llama.cpp interleaved pairs (2i, 2i + 1): row 2i of each head
    is HF row i, row 2i + 1 is HF row i + d/2."""
    stored = {t.name: t for t in gguf.GGUFReader(tiny_gguf("f32")).tensors}
    head_dim = tiny.model.config.head_dim
    for hf_name, gguf_name in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
        hf = getattr(tiny.model.model.layers[1].self_attn, hf_name).weight.detach().numpy()
        ours = np.asarray(stored[f"blk.1.{gguf_name}.weight"].data).reshape(hf.shape)
        for head in range(hf.shape[0] // head_dim):
            block, rows = hf[head * head_dim:(head + 1) * head_dim], ours[head * head_dim:(head + 1) * head_dim]
            assert np.array_equal(rows[0::2], block[: head_dim // 2])
            assert np.array_equal(rows[1::2], block[head_dim // 2:])
    v = np.asarray(stored["blk.1.attn_v.weight"].data)
    v_proj = tiny.model.model.layers[1].self_attn.v_proj.weight.detach().numpy()
    assert np.array_equal(v.reshape(-1), v_proj.reshape(-1))  # v is not rotated: stored as it is


_SMALL = dict(vocab_size=864, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Two heads of 256 (Qwen3: 128) where transformers' GGUF loader assumes those head sizes (it reads no
# query_pre_attn_scalar / head_dim for these families).
_FEW_HEADS = {**_SMALL, "num_attention_heads": 2, "num_key_value_heads": 1}
FAMILY_CONFIGS = {
    "llama (untied head, grouped kv)": LlamaConfig(**_SMALL, tie_word_embeddings=False),
    "mistral": MistralConfig(**_SMALL, tie_word_embeddings=False),
    "qwen2 (q/k/v biases, tied head)": Qwen2Config(**_SMALL, tie_word_embeddings=True),
    "qwen3 (q/k norms)": Qwen3Config(**_FEW_HEADS, head_dim=128, tie_word_embeddings=False),
    "gemma2 (1 + w norms, soft-capping)": Gemma2Config(**_FEW_HEADS, head_dim=256, query_pre_attn_scalar=256),
    "gemma3 (sliding layers)": Gemma3TextConfig(**{**_FEW_HEADS, "num_hidden_layers": 7}, head_dim=256,
                                                query_pre_attn_scalar=256, sliding_window=8),
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_each_family_reloads_to_identical_logits(family, tmp_path):
    """Random non-trivial weights (norms and biases moved off their initial values), longer than Gemma 3's
    sliding window: written f32, read back by transformers, the same logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILY_CONFIGS[family], dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    path = write_gguf(model, tokenizer, None, None, tmp_path / "model.gguf", "f32")
    reloaded, _ = _reload(path)
    ids = torch.tensor([tokenizer(TEXT * 2, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] > 16
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("ttype", "plain"), [("Q4_K", "Q4_0"), ("Q5_K", "Q5_0"), ("Q6_K", "Q8_0")])
def test_k_quant_blocks_decode_as_gguf_py_reads_them(ttype, plain):
    """kquants' blocks, decoded by gguf-py's own dequantizer (a port of ggml's): each k-quant lands closer to the
    weights than the block type of the same bits (Q6_K between Q5_K and Q8_0), outliers included."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((16, 768)) * 0.05).astype(np.float32)
    values[3, 5], values[7, 300] = 0.9, -0.6

    def error(kind: gguf.GGMLQuantizationType, blocks: np.ndarray) -> float:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        assert blocks.shape == (16, 768 // block * size)
        restored = gguf.quants.dequantize(blocks, kind).reshape(values.shape)
        return float(np.sqrt(((restored - values) ** 2).mean()) / values.std())

    k, q = gguf.GGMLQuantizationType[ttype], gguf.GGMLQuantizationType[plain]
    ours = error(k, kquants.quantize(values, k))
    assert ours < {"Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}[ttype]
    if ttype != "Q6_K":
        assert ours < error(q, gguf.quants.quantize(values, q))
    zeros = gguf.quants.dequantize(kquants.quantize(np.zeros((1, 256), np.float32), k), k)
    assert np.array_equal(zeros, np.zeros((1, 256), np.float32))


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_k_quant_mixes_follow_llama_quantize(tmp_path):
    """q4_k_m on a model whose rows are whole super-blocks: matrices Q4_K, attn_v and ffn_down Q6_K in the layers
    use_more_bits picks (0, 3, 6, 7 of 8), the tied head Q6_K, a row of 64 (not whole super-blocks) Q5_0 as
    llama-quantize falls back; the check passes it from the weights as stored (and in llama.cpp, where installed)."""
    from tunelab.export.parity import STORED_TOLERANCE, TOLERANCES, check_parity  # noqa: PLC0415

    config = LlamaConfig(**{**_SMALL, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
                            "num_attention_heads": 4, "num_key_value_heads": 2}, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    path = write_gguf(model, tokenizer, tokenizer.chat_template, None, tmp_path / "k.gguf", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert _field(gguf.GGUFReader(path), "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert types["token_embd.weight"] == "Q6_K" and types["blk.1.attn_q.weight"] == "Q4_K"
    assert [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (1, 2, 4, 5)} == {"Q4_K"}
    report = check_parity(model, tokenizer, tokenizer.chat_template, None, path, "gguf", max_new_tokens=4,
                          probes=None)
    assert report.ok and report.tensor_type == "q4_k_m", report.problems
    assert report.readers[0].stored_gap <= STORED_TOLERANCE
    assert all(r.max_logit_gap <= TOLERANCES["q4_k_m"] for r in report.readers)
    q6 = write_gguf(model, tokenizer, tokenizer.chat_template, None, tmp_path / "k6.gguf", "q6_k")
    assert {t.tensor_type.name for t in gguf.GGUFReader(q6).tensors} == {"F32", "Q6_K"}


def test_gemma3_keeps_its_layer_pattern_and_local_rope(tmp_path):
    config = Gemma3TextConfig(**{**_FEW_HEADS, "num_hidden_layers": 7}, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=8)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, AutoTokenizer.from_pretrained(TINY_MODEL_DIR), None, None, tmp_path / "g.gguf", "f16")
    reader = gguf.GGUFReader(path)
    assert _field(reader, "gemma3.attention.sliding_window") == 8
    assert _field(reader, "gemma3.attention.sliding_window_pattern") == [
        kind == "sliding_attention" for kind in config.layer_types]
    assert _field(reader, "gemma3.rope.freq_base_swa") == pytest.approx(10000.0)
    assert _field(reader, "gemma3.rope.freq_base") == pytest.approx(1e6)
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.allclose(np.asarray(norm.data), 1.0)  # Gemma's norms start at 0 in HF and are stored as 1 + w


def test_unwritable_types_and_architectures_say_what_can_be_written(tiny, tmp_path):
    with pytest.raises(ExportError, match=r"cannot write 'q2_k'; tunelab writes f32, f16, bf16, .*q4_k_m.*quantize"):
        write_gguf(tiny.model, tiny.tokenizer, None, None, tmp_path / "x.gguf", "q2_k")
    from transformers import GPT2Config  # noqa: PLC0415

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=864))
    with pytest.raises(ExportError, match=r"cannot write model_type 'gpt2'; tunelab writes GGUF for llama, mistral"):
        write_gguf(gpt2, tiny.tokenizer, None, None, tmp_path / "x.gguf", "f16")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.partial"))
    assert issubclass(ExportError, TunelabError) and issubclass(ExportError, ValueError)  # one line in the CLI


def test_a_tokenizer_llama_cpp_cannot_read_is_refused(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    with pytest.raises(ExportError, match="a WordLevel tokenizer cannot be written; llama.cpp reads byte-level BPE"):
        write_gguf(tiny.model, word_level, None, None, tmp_path / "x.gguf", "f16")


def test_template_variables_are_baked_into_the_embedded_template(tiny, tmp_path):
    """A runtime renders the GGUF's template without tunelab's template_kwargs: with them set inside, it renders
    what training rendered (Qwen3 with thinking off pre-fills an empty think block)."""
    source = builtin_source("qwen3")
    baked = embedded_chat_template(source, {"enable_thinking": False})
    messages = [{"role": "user", "content": "Hi"}]
    trained = Template.from_jinja("qwen3", source).prompt(messages, enable_thinking=False)
    assert "<think>\n\n</think>" in trained
    assert Template.from_jinja("baked", baked).prompt(messages) == trained
    macro = "{% macro m() %}{{ flag }}{% endmacro %}{{ m() }}|{{ flag }}"  # macros see the baked value too
    assert Template.from_jinja("m", embedded_chat_template(macro, {"flag": True})).render([]) == "True|True"
    path = write_gguf(tiny.model, tiny.tokenizer, source, {"enable_thinking": False}, tmp_path / "q.gguf", "q8_0")
    assert _field(gguf.GGUFReader(path), "tokenizer.chat_template") == baked
    with pytest.raises(ExportError, match="cannot be written into the GGUF's chat template"):
        embedded_chat_template(source, {"enable_thinking": object()})


def test_pre_tokenizer_regexes_are_the_ones_transformers_reads_back():
    """Our names for tokenizer.json split regexes agree with the table transformers' GGUF loader rebuilds from."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for name, regex in gguf_writer._SPLIT_REGEXES.items():
        assert mapping.GGUF_PRE_TOKENIZER_SPLITS[name] == regex, name


@pytest.mark.slow
@pytest.mark.parametrize(("item", "kind", "config"), [
    ("qwen3", "gpt2/qwen2", Qwen3Config(**{**_FEW_HEADS, "vocab_size": 151936}, head_dim=128, tie_word_embeddings=True)),
    ("llama3_1", "gpt2/llama-bpe", LlamaConfig(**{**_SMALL, "vocab_size": 128256}, tie_word_embeddings=True)),
    # Gemma 3's tokenizer.json lists one token (<image_soft_token>) past the 262,144 rows of its text model.
    ("gemma3", "llama/default", Gemma3TextConfig(**{**_FEW_HEADS, "vocab_size": 262145}, head_dim=256,
                                                 query_pre_attn_scalar=256)),
])
def test_real_tokenizers_round_trip(item, kind, config, tmp_path):
    """Qwen3's and Llama 3's byte-level BPE (151k / 128k tokens, their split regexes, hundreds of added tokens) and
    Gemma 3's SentencePiece vocabulary (262k tokens with byte fallback, written as llama.cpp's 'llama' model with
    merge-ordered scores): the tokenizer transformers rebuilds from the GGUF encodes the rendered probes and plain
    text to the same ids. (The tokenizer class is named, as export's check names it, so transformers parses the
    vocabulary once instead of twice: 4-7 s instead of 20-30 s.)"""
    from tests.real_assets import real  # noqa: PLC0415
    from tunelab.export.parity import PROBES, _gguf_header_value  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(real(item))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = write_gguf(model, tokenizer, tokenizer.chat_template, None, tmp_path / "m.gguf", "f16")
    assert f"{_gguf_header_value(path, 'tokenizer.ggml.model')}/{_gguf_header_value(path, 'tokenizer.ggml.pre')}" == kind
    try:
        reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf", tokenizer_type=config.model_type)
    except ValueError:  # llama has no tokenizer class of its own: AutoTokenizer falls back to the generic one
        reread = TokenizersBackend.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert type(reread) is type(tokenizer) and reread.chat_template == tokenizer.chat_template
    template = Template.from_jinja(item, tokenizer.chat_template)
    tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    texts = [template.prompt(probe, **tokens) for probe in PROBES if item != "gemma3" or probe[0]["role"] != "system"]
    for text in [*texts, "Übersetze «good morning» → 早上好 🙂\n\ttabs,  double  spaces, 3.14159 <unused0>"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert reread(text, add_special_tokens=False)["input_ids"] == ids, text
    assert reread("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]  # BOS as the original adds it


@pytest.mark.slow
@pytest.mark.parametrize(("item", "pre"), [("qwen3", "qwen2"), ("llama3_1", "llama-bpe"), ("gptoss", "gpt-4o")])
def test_real_byte_level_tokenizers_get_llama_cpp_pre_tokenizer_names(item, pre):
    """The pre-tokenizer llama.cpp must apply, recognised from each real tokenizer.json (its regex is compared with
    transformers' own table above; the Qwen3 file is read back in full in test_real_tokenizers_round_trip)."""
    from tests.real_assets import real  # noqa: PLC0415

    spec = json.loads((real(item) / "tokenizer.json").read_text(encoding="utf-8"))
    assert gguf_writer._pre_tokenizer_kind(spec) == pre


def _sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """A small Llama-2 / Mistral-style tokenizer: BPE over '▁'-marked words with byte fallback, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    corpus = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris. Add 12 and 30.",
              "Hello! How can I help you today? Why is the sky blue?"] * 50
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    return tokenizer


def test_sentencepiece_style_tokenizer_writes_as_llama_with_scores(tmp_path):
    """Byte-fallback BPE is llama.cpp's 'llama' (SentencePiece) vocabulary: byte tokens typed BYTE, scores that
    order the merges as tokenizers applies them, the '▁' prefix flag; transformers rebuilds the same encoding."""
    from tunelab.export.parity import check_parity  # noqa: PLC0415

    tokenizer = _sentencepiece_style_tokenizer()
    config = LlamaConfig(**{**_SMALL, "vocab_size": len(tokenizer), "num_hidden_layers": 2})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    source = builtin_source("mistral_v0_3")
    path = write_gguf(model, tokenizer, source, None, tmp_path / "spm.gguf", "f16")
    reader = gguf.GGUFReader(path)
    assert (_field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")) == ("llama", "default")
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    assert types[tokens.index("<0x0A>")] == gguf.TokenType.BYTE
    assert types[tokens.index("[INST]")] == gguf.TokenType.CONTROL
    merges = [m.replace(" ", "") for m in _field(reader, "tokenizer.ggml.merges")]
    assert [scores[tokens.index(m)] for m in merges[:5]] == [0.0, -1.0, -2.0, -3.0, -4.0]
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is True
    report = check_parity(model, tokenizer, source, None, path, "gguf", max_new_tokens=4, llama_cpp=False)
    assert report.ok and report.readers[0].ids_identical


def test_llama3_rope_scaling_is_written_as_llama_cpp_rope_freqs(tmp_path):
    """Llama 3.1's rope scaling travels as rope_freqs.weight: llama.cpp divides each rotary frequency by it, which
    must give transformers' own llama3 frequencies (transformers' GGUF loader does not read it back, so this checks
    the tensor against transformers' rope code directly)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(**{**_SMALL, "max_position_embeddings": 131072, "head_dim": 64}, rope_parameters=rope)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, AutoTokenizer.from_pretrained(TINY_MODEL_DIR), None, None, tmp_path / "l.gguf", "f16")
    factors = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(plain / torch.tensor(np.array(factors.data)), expected, rtol=1e-6, atol=0)
