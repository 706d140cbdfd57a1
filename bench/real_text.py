"""Real English text nobody here wrote: the long descriptions (READMEs) in the METADATA of the packages installed
in this venv, split by package into a training part and a held-out part.

Used by bench/qat_vs_ptq.py: the QAT and control fine-tunes read the training documents (stage pt), perplexity is
scored on the held-out ones. The split is by package name (a stable hash), so no held-out README is seen in
training; identical texts (several packages ship the same README) are kept once. Written under bench/.data (ignored
by git): nothing of it is committed.
    python bench/real_text.py            # writes bench/.data/real/text/{dataset_info.json,train.jsonl,heldout.jsonl}
"""
from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from email.parser import HeaderParser
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / ".data" / "real" / "text"
MIN_CHARS = 1500  # shorter descriptions are mostly a link to the project's site
WRITTEN_HERE = {"tunelab"}  # this project's own README is not text from elsewhere


def long_descriptions(site_packages: Path) -> dict[str, str]:
    """package name -> its METADATA long description (the body after the headers), deduplicated by text."""
    texts: dict[str, str] = {}
    seen: set[str] = set()
    for metadata in sorted(site_packages.glob("*.dist-info/METADATA")):
        message = HeaderParser().parsestr(metadata.read_text(encoding="utf-8", errors="replace"))
        body = (message.get_payload() or message.get("Description") or "").strip()
        key = hashlib.sha256(" ".join(body.split()).encode()).hexdigest()
        name = message.get("Name", metadata.parent.name)
        if len(body) >= MIN_CHARS and key not in seen and name.lower() not in WRITTEN_HERE:
            seen.add(key)
            texts[name] = body
    return texts


def is_held_out(name: str) -> bool:
    return int(hashlib.sha256(name.lower().encode()).hexdigest(), 16) % 3 == 0  # about a third


def main() -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    texts = long_descriptions(site_packages)
    OUT.mkdir(parents=True, exist_ok=True)
    parts = {"train": [], "heldout": []}
    for name, text in texts.items():
        parts["heldout" if is_held_out(name) else "train"].append({"package": name, "text": text})
    for part, rows in parts.items():
        with open(OUT / f"{part}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{part}: {len(rows)} documents, {sum(len(r['text']) for r in rows)} characters", file=sys.stderr)
    info = {name: {"file_name": f"{name}.jsonl", "columns": {"prompt": "text"}} for name in parts}
    (OUT / "dataset_info.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
