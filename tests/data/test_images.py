"""data/images.py: every image reference form opens to the same RGB image; bad ones fail in one line."""

import base64
import io

import pytest
from PIL import Image

from tunelab.data.images import ImageSource, open_image, open_images
from tunelab.errors import DataError


def _png(color=(255, 0, 0), size=(4, 3), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(_png())
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    (tmp_path / "cut.png").write_bytes(_png(size=(64, 64))[:60])
    return tmp_path


def test_every_reference_form_opens_the_same_pixels(folder):
    data = _png()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    refs = [
        "imgs/red.png", str(folder / "imgs" / "red.png"), "file://" + str(folder / "imgs" / "red.png"), uri,
        {"bytes": data, "path": None}, {"bytes": None, "path": "imgs/red.png"}, Image.open(io.BytesIO(data)),
        Image.new("RGBA", (4, 3), (255, 0, 0, 255)),
    ]
    images = open_images(refs, base_dir=folder)
    assert [image.mode for image in images] == ["RGB"] * len(refs)
    assert {image.tobytes() for image in images} == {Image.new("RGB", (4, 3), (255, 0, 0)).tobytes()}
    assert open_images(None) == [] and open_images([]) == []


def test_missing_file(folder):
    where = ImageSource("data/train.json", 7)
    with pytest.raises(DataError) as info:
        open_image("imgs/blue.png", folder, where)
    assert str(info.value) == (
        f"data/train.json, row 7: image file {folder}/imgs/blue.png does not exist (relative paths are read from "
        f"{folder}): fix the path in the row or add the file"
    )


def test_corrupt_and_truncated_files(folder):
    where = ImageSource("train.json", 2)
    with pytest.raises(DataError, match=r"^train.json, row 2: image .*/bad.png is corrupt or not a supported image "
                       r"format \(UnidentifiedImageError: cannot identify image file\): replace it with a PNG / JPEG / WebP / GIF / BMP file or drop the row$"):
        open_image("bad.png", folder, where)
    with pytest.raises(DataError, match=r"^train.json, row 2: image .*/cut.png is corrupt"):
        open_image("cut.png", folder, where)
    with pytest.raises(DataError, match=r"^train.json, row 2: image 5 bytes of image data is corrupt"):
        open_image({"bytes": b"\x89PNG\x00", "path": None}, folder, where)


def test_bad_uri_url_and_type():
    where = ImageSource("d.jsonl", 0)
    with pytest.raises(DataError) as info:
        open_image("data:image/png;base64,@@@", where=where)
    assert str(info.value) == "d.jsonl, row 0: image data URI 'data:image/png;base64,@@@...' has invalid base64 data: re-encode the image"
    with pytest.raises(DataError, match=r"^d.jsonl, row 0: image data URI 'data:text/plain,x...' is not of the form"):
        open_image("data:text/plain,x", where=where)
    with pytest.raises(DataError, match=r"^d.jsonl, row 0: image 'https://x/y.png' is a URL; tunelab reads local files only"):
        open_image("https://x/y.png", where=where)
    with pytest.raises(DataError) as info:
        open_image(3, where=where)
    assert str(info.value) == (
        "d.jsonl, row 0: image reference of type int (int) is not a path, a data: URI, "
        "{'bytes': ..., 'path': ...} or a PIL image: give one of those"
    )
