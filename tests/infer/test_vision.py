"""Images at inference: the engine's prompt for a message with images equals the model's own processor call, every
image reference form gives the same inputs, bad image input is one line; `tunelab chat` with /image, and
`tunelab api` with OpenAI image_url parts through the real `openai` client."""

from __future__ import annotations

import base64
import io
import sys

import openai
import pytest
import torch
from transformers import AutoProcessor

from tests.infer.chat_helpers import api_server
from tunelab.assets import TINY_VISION_DIR
from tunelab.cli import main
from tunelab.data import synthetic
from tunelab.errors import ImageInputError
from tunelab.infer.engine import SamplingOptions, load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUESTION = "How many circles are there?"


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny-vision")


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    """A shapes test picture: (its PNG bytes, a file holding them)."""
    png = synthetic.generate("shapes", "test", 1)[0]["images"][0]["bytes"]
    path = tmp_path_factory.mktemp("pictures") / "shapes.png"
    path.write_bytes(png)
    return png, path


def _ask(image_part: dict) -> list[dict]:
    return [{"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]}]


def test_prompt_equals_the_processors_own_call(engine, picture):
    png, path = picture
    ids, inputs = engine.prompt_inputs(_ask({"type": "image", "path": str(path)}))
    processor = AutoProcessor.from_pretrained(TINY_VISION_DIR)
    from PIL import Image  # noqa: PLC0415

    text = f"<|im_start|>user\n<image>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    expected = processor(images=[Image.open(io.BytesIO(png))], text=text, return_tensors="pt")
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(engine.model.config.image_token_id) == 16
    assert set(inputs) == {"pixel_values"}
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])


def test_every_image_reference_form_gives_the_same_inputs(engine, picture):
    png, path = picture
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    forms = [
        {"type": "image", "path": str(path)},
        {"type": "image", "image": {"bytes": png, "path": None}},
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "image_url", "image_url": {"url": str(path)}},
    ]
    first_ids, first = engine.prompt_inputs(_ask(forms[0]))
    for form in forms[1:]:
        ids, inputs = engine.prompt_inputs(_ask(form))
        assert ids == first_ids and torch.equal(inputs["pixel_values"], first["pixel_values"])


def test_bad_image_input_is_one_line(engine, tmp_path):
    with pytest.raises(ImageInputError) as info:
        engine.generate([{"role": "user", "content": "<image>How many circles are there?"}], SamplingOptions())
    assert str(info.value) == "the conversation has 1 <image> placeholders and 0 images; give one image per placeholder"
    with pytest.raises(ImageInputError, match=r"^messages\.0\.content\.0: an image part without its image; "):
        engine.generate(_ask({"type": "image_url", "image_url": {"url": ""}}), SamplingOptions())
    with pytest.raises(ImageInputError, match=r"^messages\.0\.content\.0: unsupported content part type 'audio'"):
        engine.generate(_ask({"type": "audio"}), SamplingOptions())
    missing = tmp_path / "missing.png"
    with pytest.raises(ImageInputError, match=str(missing)):
        engine.generate(_ask({"type": "image", "path": str(missing)}), SamplingOptions())
    text_only = load_engine("tiny")
    with pytest.raises(ImageInputError) as info:
        text_only.generate(_ask({"type": "image", "path": str(tmp_path / "a.png")}), SamplingOptions())
    assert str(info.value) == ("tiny-llama is a text-only model and cannot read images; send text only, "
                               "or load a vision-language model")


def test_chat_attaches_an_image_to_the_next_message(engine, picture, monkeypatch, capsys):
    _, path = picture
    options = SamplingOptions(temperature=0, max_new_tokens=4)
    expected = engine.complete(_ask({"type": "image", "path": str(path)}), options)
    script = f"/image {path}\n{QUESTION}\n/image nowhere.png\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert main(["chat", "tiny-vision", "--temperature", "0", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == f">>> (image {path} attached to your next message)\n>>> {expected.text}\n>>> >>> \n"
    assert "error: nowhere.png: no such file" in err.splitlines()


@pytest.mark.slow
def test_api_answers_image_url_parts_through_the_openai_client(engine, picture, tmp_path):
    png, path = picture
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    options = SamplingOptions(temperature=0, max_new_tokens=4)
    expected = engine.complete(_ask({"type": "image", "path": str(path)}), options).text
    with api_server(["tiny-vision"], tmp_path / "server.log") as (host, port, _):
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
        for url in (uri, str(path)):
            reply = client.chat.completions.create(
                model="tiny-llava", temperature=0, max_tokens=4,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION},
                ]}],
            )
            assert reply.choices[0].message.content == expected
            assert reply.usage.prompt_tokens == len(engine.prompt_ids(_ask({"type": "image", "path": str(path)})))
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": "<image>Hi"}])
        assert info.value.body["message"] == ("the conversation has 1 <image> placeholders and 0 images; "
                                              "give one image per placeholder")
        assert info.value.body["code"] is None


@pytest.mark.slow
def test_tunelab_eval_answers_the_image_test_set(tmp_path):
    import json  # noqa: PLC0415

    out = tmp_path / "eval"
    assert main(["eval", "model_name_or_path=tiny-vision", "dataset=demo_shapes", "eval_dataset=demo_shapes_test",
                 "template=chatml", "max_samples=8", "max_new_tokens=4", f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    expected = synthetic.generate("shapes", "test", 8)
    assert [r["reference"] for r in rows] == [e["output"] for e in expected]
    assert [r["prompt"] for r in rows] == [
        f"<|im_start|>user\n{e['instruction']}<|im_end|>\n<|im_start|>assistant\n" for e in expected
    ]
    results = json.loads((out / "predict_results.json").read_text())
    assert results["predict_samples"] == 8
    assert results["predict_exact_match"] == sum(r["prediction"] == r["reference"] for r in rows) / 8
