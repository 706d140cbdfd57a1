"""tunelab data stats / verify with images: images and image tokens per sample, and every placeholder's image."""

from __future__ import annotations

import json

import yaml

from tests.e2e.test_vision_sft import image_dataset
from tunelab.cli import main
from tunelab.data.verify import verify_images
from tunelab.preflight import plan_run
from tunelab.train.recipe import recipe_for


def _config(tmp_path, model_dir) -> str:
    config = {
        "model_name_or_path": str(model_dir), "template": "model", "stage": "sft",
        "dataset": "colours,colours_openai", "dataset_dir": str(image_dataset(tmp_path / "data")), "cutoff_len": 96,
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
        "tokenized_cache_dir": str(tmp_path / "cache"),
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "cfg.yaml")


def test_stats_and_verify_count_and_check_images(tmp_path, capsys, tiny_vlm_dirs):
    config = _config(tmp_path, tiny_vlm_dirs["llava"])
    assert main(["data", "stats", config, "--out", str(tmp_path / "stats")]) == 0
    out = capsys.readouterr().out
    # 13 samples: 12 with one 32x32 image (16 LLaVA tokens each), one text-only row.
    assert "images: 12 in 12 of 13 samples (0-1 per sample)\n" in out
    stats = json.loads((tmp_path / "stats" / "stats.json").read_text())["images"]
    assert (stats["images"], stats["image_tokens"], stats["image_tokens_per_image_sample_mean"]) == (12, 192, 16.0)
    assert f"image tokens: 192 ({100 * stats['image_token_share']:.1f}% of all tokens)" in out

    assert main(["data", "verify", config]) == 0
    out = capsys.readouterr().out
    assert ("images: 12 images in 13 samples: each placeholder holds exactly its image's tokens (the processor's "
            "expansion), none supervised\n") in out


def test_verify_finds_a_placeholder_without_its_image(tmp_path, tiny_vlm_dirs):
    data = recipe_for(plan_run(_config(tmp_path, tiny_vlm_dirs["llava"]), [], purpose="data")).inspection()
    first_with_image = next(i for i, images in enumerate(data.train["images"]) if images)
    data.train = data.train.map(lambda row, i: {"images": [] if i == first_with_image else row["images"]},
                                with_indices=True)
    problem, _ = verify_images(data, max_rows=len(data.train))
    assert problem == (f"train sample {first_with_image}: 16 image tokens for its 0 images, whose expansions hold 0: "
                       "a placeholder without its image (or the reverse)")
