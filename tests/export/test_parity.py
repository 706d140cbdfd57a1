"""check_parity: an export read back by an independent reader equals the model as trained, and a broken export is
caught with one line naming what differs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TokenizersBackend

from tunelab.data.templates import builtin_source
from tunelab.export import gguf_writer, parity
from tunelab.export.gguf_writer import write_gguf
from tunelab.export.parity import PROBES, STORED_TOLERANCE, TOLERANCES, ParityError, check_parity


def test_f16_gguf_matches_the_trained_model(tiny, tiny_gguf, tmp_path):
    report = check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, tiny_gguf("f16"), "gguf",
                          report_path=tmp_path / "export_report.json", llama_cpp=False)
    (result,) = report.readers
    assert report.ok and report.tensor_type == "f16"
    assert result.template_identical and result.ids_identical and result.special_tokens_identical
    assert 0 < result.max_logit_gap <= TOLERANCES["f16"] and result.stored_gap <= STORED_TOLERANCE
    assert result.greedy_required and result.greedy_identical
    assert all(probe.reference_answer == probe.exported_answer for probe in result.probes)
    saved = json.loads((tmp_path / "export_report.json").read_text())
    assert saved["ok"] is True and saved["readers"][0]["probes"][0]["answers_identical"] is True
    assert report.lines()[0].startswith("export check: gguf tiny-f16.gguf (f16,")


def test_q8_0_gguf_is_within_its_tolerance(tiny, tiny_gguf):
    report = check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, tiny_gguf("q8_0"), "gguf",
                          llama_cpp=False)
    (result,) = report.readers
    assert report.ok and result.ids_identical and result.template_identical
    assert 0 < result.max_logit_gap <= TOLERANCES["q8_0"]
    assert result.stored_gap <= STORED_TOLERANCE  # transformers computes exactly the q8_0 values written
    assert not result.greedy_required  # reported, not required, for quantized types


@pytest.mark.parametrize(("dtype", "tensor_type"), [(torch.float32, "f32"), (torch.float16, "f16")])
def test_hf_folder_matches_the_trained_model(tiny, tmp_path, dtype, tensor_type):
    """A folder loads with plain from_pretrained; saved in float16 it is the trained weights rounded to float16."""
    folder = tmp_path / "hf"
    torch.nn.Module.to(copy.deepcopy(tiny.model), dtype).save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    report = check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, folder, "hf")
    (result,) = report.readers
    assert report.ok and report.tensor_type == tensor_type and result.greedy_identical
    assert result.stored_gap <= STORED_TOLERANCE
    assert result.max_logit_gap == 0 if tensor_type == "f32" else 0 < result.max_logit_gap <= TOLERANCES["f16"]


def test_a_wrong_template_is_caught(tiny, tmp_path):
    path = write_gguf(tiny.model, tiny.tokenizer, builtin_source("default"), None, tmp_path / "t.gguf", "f16")
    with pytest.raises(ParityError, match=r"^export check failed for t.gguf: the GGUF's chat template differs from "
                                          r"the trained one at character \d+: "):
        check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, path, "gguf", llama_cpp=False)


def test_template_variables_missing_from_the_export_are_caught(tiny, tmp_path):
    """Trained with Qwen3's thinking off, exported without the variable: the GGUF's template renders differently."""
    source = builtin_source("qwen3")
    path = write_gguf(tiny.model, tiny.tokenizer, source, None, tmp_path / "v.gguf", "f16")
    with pytest.raises(ParityError, match="the GGUF's chat template differs from the trained one"):
        check_parity(tiny.model, tiny.tokenizer, source, {"enable_thinking": False}, path, "gguf", llama_cpp=False)
    path = write_gguf(tiny.model, tiny.tokenizer, source, {"enable_thinking": False}, tmp_path / "v.gguf", "f16")
    assert check_parity(tiny.model, tiny.tokenizer, source, {"enable_thinking": False}, path, "gguf",
                        llama_cpp=False).ok


def test_a_dropped_special_token_is_caught(tiny, tmp_path):
    """The export's tokenizer lost <|im_end|> as an added special token: llama.cpp and transformers then spell it
    out of byte-level pieces, and the model never sees the token it trained on."""
    spec = json.loads(tiny.tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["content"] != "<|im_end|>"]
    broken = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                     eos_token="</s>", unk_token=None, pad_token="<pad>")
    path = write_gguf(tiny.model, broken, tiny.chat_template, None, tmp_path / "s.gguf", "f16")
    with pytest.raises(ParityError, match=r"the GGUF's tokenizer splits '<\|im_end\|>' into \d+ tokens"):
        check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, path, "gguf", llama_cpp=False)


def test_a_transposed_tensor_is_caught(tiny, tmp_path, monkeypatch):
    values = gguf_writer._Planned.values

    def transposed(self):  # the export bug: one square matrix written transposed
        data = values(self)
        return data.T.copy() if self.name == "blk.2.attn_output.weight" else data

    monkeypatch.setattr(gguf_writer._Planned, "values", transposed)
    path = write_gguf(tiny.model, tiny.tokenizer, tiny.chat_template, None, tmp_path / "w.gguf", "q8_0")
    with pytest.raises(ParityError, match=r"the GGUF's logits differ by up to [\d.]+ standard deviations from the "
                                          r"trained weights rounded as stored \(q8_0\) .* a tensor is not laid out"):
        check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, path, "gguf", llama_cpp=False)


def test_a_missing_rotary_permutation_is_caught(tiny, tmp_path, monkeypatch):
    """Without llama.cpp's q/k row permutation a Llama GGUF attends with the wrong rotary pairs."""
    unpermuted = gguf_writer.Family(gguf_writer.FAMILIES["llama"].arch, False, 0.0)
    monkeypatch.setitem(gguf_writer.FAMILIES, "llama", unpermuted)
    path = write_gguf(tiny.model, tiny.tokenizer, tiny.chat_template, None, tmp_path / "p.gguf", "f16")
    report = check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, path, "gguf", llama_cpp=False,
                          raise_on_mismatch=False)
    assert not report.ok and report.readers[0].stored_gap > 10 * STORED_TOLERANCE
    assert "from the trained weights rounded as stored (f16)" in report.problems[0]


def test_greedy_answers_parting_at_a_near_tie_are_reported_not_failed(tiny, tiny_gguf, monkeypatch):
    """An f16 file must answer as the model as trained, except where rounding may legitimately swap two tokens: where
    the answers part, the trained model's choice led the exported model's by at most twice the tolerance."""
    greedy = parity.TransformersReader.greedy

    def runner_up(self, ids, max_new_tokens, stops):  # the file's reader answers with the second most likely token
        if not self.name.startswith("transformers (GGUF"):
            return greedy(self, ids, max_new_tokens, stops)
        return [int(self.logits(ids)[-1].topk(2).indices[1])]

    monkeypatch.setattr(parity.TransformersReader, "greedy", runner_up)
    (text,) = parity._rendered_probes(tiny.chat_template, None, tiny.tokenizer, PROBES[:1])[0]
    with torch.no_grad():
        logits = tiny.model(torch.tensor([tiny.tokenizer(text, add_special_tokens=False)["input_ids"]])).logits[0, -1]
    top2 = logits.topk(2).values
    margin = float((top2[0] - top2[1]) / logits.std())

    def check(tolerance: float) -> parity.ParityReport:
        monkeypatch.setitem(TOLERANCES, "f16", tolerance)
        return check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, tiny_gguf("f16"), "gguf",
                            probes=PROBES[:1], llama_cpp=False, raise_on_mismatch=False)

    near = check(margin / 2 + 1e-3)  # rounding within this tolerance may close a gap of `margin`
    (probe,) = near.readers[0].probes
    assert near.ok and not probe.answers_identical and probe.tie_margin == pytest.approx(margin, rel=1e-5)
    assert "greedy answers differ at a near tie (reported)" in near.lines()[1]
    clear = check(margin / 4)  # it may not
    assert clear.problems == [
        f"the GGUF's greedy answer to probe 1 is {clear.readers[0].probes[0].exported_text!r}, the trained model's "
        f"{clear.readers[0].probes[0].reference_text!r} (its choice led by {margin:.3g} sd where it differs)"
    ]


@pytest.mark.slow
def test_smollm2_f16_and_q8_0_ggufs_match(tmp_path):
    """SmolLM2-135M-Instruct (30 layers, grouped kv, its own template with a default system prompt), from the
    weights transformers reads out of its Q4_1 GGUF: f16 gives the same ids, template and greedy answers within the
    f16 tolerance; q8_0 stays within its own (this small model's outlier weights make it sensitive: about 0.4 sd).
    Two probes (one with a system turn) and six answer tokens keep it to the reads themselves; all four probes and
    every type: bench/export_parity.py."""
    from tests.real_assets import real  # noqa: PLC0415

    path = real("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)  # AutoTokenizer's pick for llama
    for tensor_type in ("f16", "q8_0"):
        out = write_gguf(model, tokenizer, tokenizer.chat_template, None, tmp_path / f"smollm2-{tensor_type}.gguf",
                         tensor_type)
        report = check_parity(model, tokenizer, tokenizer.chat_template, None, out, "gguf", max_new_tokens=6,
                              probes=PROBES[:2], llama_cpp=False)
        (result,) = report.readers
        assert report.ok and result.ids_identical and result.template_identical
        assert result.max_logit_gap <= TOLERANCES[tensor_type] and result.stored_gap <= STORED_TOLERANCE
        assert result.greedy_identical or tensor_type == "q8_0"
        assert "Paris" in result.probes[0].reference_text


def test_llama_cpp_reader_when_installed(tiny, tiny_gguf):
    """llama.cpp's own tokenizer and kernels read the file as well (only where llama-cpp-python is installed)."""
    pytest.importorskip("xllamacpp")
    report = check_parity(tiny.model, tiny.tokenizer, tiny.chat_template, None, tiny_gguf("q8_0"), "gguf",
                          llama_cpp=True, raise_on_mismatch=False)
    assert [r.reader for r in report.readers] == ["transformers (GGUF loader)", "llama.cpp (xllamacpp server)"]
    assert report.ok, report.problems


@pytest.mark.slow
def test_smollm2_f16_gguf_in_llama_cpp(tmp_path):
    """SmolLM2's f16 export read by llama.cpp's own server (xllamacpp): its Jinja renders the four probes (emoji,
    Chinese, tabs, a system turn, two exchanges) as training did, its tokenizer gives the same ids, and its greedy
    answers are the trained model's."""
    pytest.importorskip("xllamacpp")
    from tests.real_assets import real  # noqa: PLC0415

    path = real("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    out = write_gguf(model, tokenizer, tokenizer.chat_template, None, tmp_path / "smollm2-f16.gguf", "f16")
    report = check_parity(model, tokenizer, tokenizer.chat_template, None, out, "gguf", max_new_tokens=8,
                          llama_cpp=True, raise_on_mismatch=False)
    llama = report.readers[1]
    assert llama.reader == "llama.cpp (xllamacpp server)" and report.ok, report.problems
    assert llama.template_identical and llama.ids_identical and llama.special_tokens_identical
    assert llama.greedy_identical and llama.max_logit_gap <= TOLERANCES["f16"]
    assert len(llama.probes) == len(PROBES)
