"""Bad image input → one line naming the dataset file, row and fix (exit 2), or an explicit count (exit 0),
through the real CLI on a tiny LLaVA folder. (Images refused for a text-only model: test_bad_inputs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.bad_inputs.test_bad_inputs import quiet_progress_bars, train  # noqa: F401 - the fixture applies here too

RED = (255, 0, 0)


def dataset(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), RED).save(folder / "red.png")
    (folder / "bad.png").write_bytes(b"this is not a PNG")
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "data.jsonl", "columns": {
        "prompt": "instruction", "response": "output", "images": "images"}}}))
    return folder


GOOD = {"instruction": "<image>Colour?", "output": "red", "images": ["red.png"]}
CASES = [
    ("missing image file", {"images": ["blue.png"]},
     "dataset 'mine' row 1 ({data}/data.jsonl:2): image file {data}/blue.png does not exist (relative paths are read "
     "from {data}): fix the path in the row or add the file; or set skip_bad_rows: true to skip such rows (counted "
     "per reason)"),
    ("corrupt image", {"images": ["bad.png"]},
     "dataset 'mine' row 1 ({data}/data.jsonl:2): image {data}/bad.png is corrupt or not a supported image format "
     "(UnidentifiedImageError: cannot identify image file): replace it with a PNG / JPEG / WebP "
     "/ GIF / BMP file or drop the row; or set skip_bad_rows: true to skip such rows (counted per reason)"),
    ("more placeholders than images", {"instruction": "<image> and <image>?"},
     "dataset 'mine' row 1 ({data}/data.jsonl:2): 2 <image> placeholders for 1 images; write one <image> per image, "
     "in the order of the images; or set skip_bad_rows: true to skip such rows (counted per reason)"),
    ("more images than placeholders", {"images": ["red.png", "red.png"]},
     "dataset 'mine' row 1 ({data}/data.jsonl:2): 1 <image> placeholders for 2 images; write one <image> per image, "
     "in the order of the images; or set skip_bad_rows: true to skip such rows (counted per reason)"),
    ("placeholder in the answer", {"output": "<image>"},
     "dataset 'mine' row 1 ({data}/data.jsonl:2): an answer holds <image>; images go in the prompt (user or system "
     "turns): move the placeholder; or set skip_bad_rows: true to skip such rows (counted per reason)"),
]


@pytest.mark.parametrize("change, expected", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_image_row_fails_with_one_line(tmp_path, capsys, tiny_vlm_dirs, change, expected):
    data = dataset(tmp_path / "data", [GOOD, {**GOOD, **change}])
    code, err = train(tmp_path, capsys, model_name_or_path=str(tiny_vlm_dirs["llava"]), template="model",
                      dataset="mine", dataset_dir=str(data))
    assert (code, err) == (2, f"tunelab: error: {expected.format(data=data)}\n")


def test_bad_image_rows_skipped_and_counted(tmp_path, capsys, tiny_vlm_dirs):
    rows = [GOOD, {**GOOD, "images": ["blue.png"]}, {**GOOD, "images": ["red.png", "red.png"]}, GOOD]
    data = dataset(tmp_path / "data", rows)
    code, _ = train(tmp_path, capsys, model_name_or_path=str(tiny_vlm_dirs["llava"]), template="model",
                    dataset="mine", dataset_dir=str(data), skip_bad_rows=True)
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert code == 0
    assert report["sources"][0]["skipped_by_reason"] == {"bad_image": 1, "placeholders_images_mismatch": 1}
    assert report["train"]["images"] == 2


def test_an_image_larger_than_cutoff_len_is_dropped_and_counted(tmp_path, capsys, tiny_vlm_dirs):
    # LLaVA's image is 16 tokens: with cutoff_len 14 no example with an image fits; the text-only row trains.
    data = dataset(tmp_path / "data", [GOOD, GOOD, {"instruction": "Hi", "output": "red", "images": []}])
    code, _ = train(tmp_path, capsys, model_name_or_path=str(tiny_vlm_dirs["llava"]), template="model",
                    dataset="mine", dataset_dir=str(data), cutoff_len=14)
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert code == 0
    assert (report["train"]["images_dont_fit"], report["train"]["examples"], report["train"]["images"]) == (2, 1, 0)


def test_stages_other_than_sft_refused_for_a_vision_model(tmp_path, capsys, tiny_vlm_dirs):
    folder = tiny_vlm_dirs["llava"]
    code, err = train(tmp_path, capsys, model_name_or_path=str(folder), template="model", stage="rm",
                      dataset="demo_preference")
    assert (code, err) == (2, f"tunelab: error: stage: rm is not supported for vision-language models yet "
                              f"(model_name_or_path {folder} is one); train it with stage: sft or dpo\n")


def test_dedup_refused_with_images(tmp_path, capsys, tiny_vlm_dirs):
    data = dataset(tmp_path / "data", [GOOD, GOOD])
    code, err = train(tmp_path, capsys, model_name_or_path=str(tiny_vlm_dirs["llava"]), template="model",
                      dataset="mine", dataset_dir=str(data), dedup="exact")
    assert (code, err) == (2, "tunelab: error: dedup: exact compares the rows' text, not their images; set dedup: none "
                              "for a vision-language model\n")


def test_image_content_parts_refused_for_a_text_only_model(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    parts = [{"type": "image_url", "image_url": {"url": "red.png"}}, {"type": "text", "text": "Colour?"}]
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "red"}]}
    (folder / "data.jsonl").write_text(json.dumps(row))
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "data.jsonl", "formatting": "openai"}}))
    code, err = train(tmp_path, capsys, dataset="mine", dataset_dir=str(folder))
    assert (code, err) == (2, f"tunelab: error: dataset 'mine' ({folder}/data.jsonl) has image content parts, but "
                              "model_name_or_path is a text-only model and would ignore the images: remove them, or "
                              "train a vision-language model (a folder with its processor)\n")
