"""Identical inputs for every tool of the peer comparison (bench/run.py), written to bench/.data/peers/.

What it writes (deterministic: the same files on every run and machine):

    model/              the embedded tiny Llama (tokenizer, chat_template.jinja, weights), copied as is
    model-small/        the same tokenizer on a randomly initialised Llama of real layer widths (hidden 512,
                        8 layers, 27M non-embedding parameters), for MFU where matmuls are not tiny
                        (`run.py --model small`)
    sft.json            mixed-length SFT rows, alpaca {"instruction", "input", "output"}
    sft_chat.json       the same rows as prompt/completion messages (TRL, plain HF): user content is
                        instruction + "\\n" + input, as alpaca is rendered by tunelab and LlamaFactory
    pref.json           preference rows, alpaca ranking {"instruction", "input", "chosen", "rejected"}
    pref_chat.json      the same rows as TRL's conversational preference format
    pref_mixed.json     mixed-length pairs: the first SFT rows' prompts, chosen = the row's own answer,
                        rejected = another row's answer (seeded), so the two sides differ in length as
                        real preference data does (pref.json's answers are all 21-37 tokens long)
    pref_mixed_chat.json  the same rows for TRL
    corpus.json         plain-text documents {"text"} for the pt workload
    dataset_info.json   tunelab's registry of the files (bench_sft, bench_pref, bench_pref_mixed, bench_corpus)
    lf/dataset_info.json  LlamaFactory's registry of the same files (pt text: alpaca with prompt=text)
    manifest.json       row counts, token lengths (min/median/max) and a content hash

The SFT set mixes tunelab's short checkable tasks (sort, add, reverse: ~25 tokens) with prose
passages of 1-40 sentences to copy or continue (up to ~600 tokens, some truncated at cutoff_len 512),
so padding waste is large unpacked and packing matters. The template is ChatML for every tool:
tunelab `chatml`, LlamaFactory its ChatML-shaped template, TRL and plain HF the tokenizer's own
chat_template.jinja (the same ChatML text).

    python bench/inputs.py                 # 4000 SFT rows, 2000 pairs, 8000 documents
    python bench/inputs.py --sft-rows 1000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
from pathlib import Path

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data import corpus, synthetic

DATA_DIR = Path(__file__).resolve().parent / ".data" / "peers"
PROSE_INSTRUCTIONS = (
    "Copy the passage exactly.",
    "Continue the story with one more passage.",
    "Repeat the last sentence of the passage.",
)


def _prose_row(rng: random.Random, pool: list[str]) -> dict:
    """A prose prompt of 1-40 sentences; the answer is a copy, a continuation or the last sentence."""
    sentences = [s.strip() + "." for doc in rng.sample(pool, 12) for s in doc.split(".") if s.strip()]
    n = min(len(sentences), max(1, int(rng.expovariate(1 / 10))))
    passage = " ".join(sentences[:n])
    kind = rng.randrange(len(PROSE_INSTRUCTIONS))
    if kind == 0:
        answer = passage
    elif kind == 1:
        answer = " ".join(sentences[n : n + rng.randint(1, 8)]) or sentences[0]
    else:
        answer = sentences[n - 1]
    return {"instruction": PROSE_INSTRUCTIONS[kind], "input": passage, "output": answer}


def sft_rows(num_rows: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pool = synthetic.prose(2000, seed=seed)
    short = [r for task in ("sort", "add", "reverse") for r in synthetic.generate(task, "train", num_rows // 2, seed)]
    rng.shuffle(short)
    rows = [short.pop() if rng.random() < 0.5 else _prose_row(rng, pool) for _ in range(num_rows)]
    return rows


def chat_sft(rows: list[dict]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": _user(r)}], "completion": [{"role": "assistant", "content": r["output"]}]}
        for r in rows
    ]


def chat_pref(rows: list[dict]) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": _user(r)}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in rows
    ]


def mixed_pairs(rows: list[dict]) -> list[dict]:
    """Ranking rows whose sides differ in length: the row's answer is chosen, another row's is rejected."""
    others = list(range(len(rows)))
    random.Random(0).shuffle(others)
    return [
        {"instruction": r["instruction"], "input": r["input"], "chosen": r["output"], "rejected": rows[j]["output"]}
        for r, j in zip(rows, others)
    ]


def _user(row: dict) -> str:
    return f"{row['instruction']}\n{row['input']}" if row["input"] else row["instruction"]


def _write(path: Path, rows: list[dict]) -> str:
    text = json.dumps(rows, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(out: Path = DATA_DIR, sft_rows_n: int = 4000, pref_rows_n: int = 2000, docs_n: int = 8000) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(TINY_MODEL_DIR, model_dir)

    small_model(model_dir, out / "model-small")

    sft = sft_rows(sft_rows_n)
    pref = synthetic.generate("preference", "train", pref_rows_n, seed=0)
    pref_mixed = mixed_pairs(sft[:pref_rows_n])
    docs = corpus.generate("corpus", "train", docs_n, seed=0)
    hashes = {
        "sft.json": _write(out / "sft.json", sft),
        "sft_chat.json": _write(out / "sft_chat.json", chat_sft(sft)),
        "pref.json": _write(out / "pref.json", pref),
        "pref_chat.json": _write(out / "pref_chat.json", chat_pref(pref)),
        "pref_mixed.json": _write(out / "pref_mixed.json", pref_mixed),
        "pref_mixed_chat.json": _write(out / "pref_mixed_chat.json", chat_pref(pref_mixed)),
        "corpus.json": _write(out / "corpus.json", [{"text": d["text"]} for d in docs]),
    }
    info = {
        "bench_sft": {"file_name": "sft.json", "formatting": "alpaca",
                      "columns": {"prompt": "instruction", "query": "input", "response": "output"}},
        "bench_pref": {"file_name": "pref.json", "formatting": "alpaca", "ranking": True,
                       "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
        "bench_pref_mixed": {"file_name": "pref_mixed.json", "formatting": "alpaca", "ranking": True,
                             "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                         "rejected": "rejected"}},
        "bench_corpus": {"file_name": "corpus.json", "formatting": "text"},
    }
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2))
    lf_info = {name: {**spec, "file_name": f"../{spec['file_name']}"} for name, spec in info.items()}
    lf_info["bench_corpus"] = {"file_name": "../corpus.json", "columns": {"prompt": "text"}}
    (out / "lf").mkdir(exist_ok=True)
    (out / "lf" / "dataset_info.json").write_text(json.dumps(lf_info, indent=2))

    from transformers import AutoTokenizer  # noqa: PLC0415 (slow import, only for the manifest)

    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True)["input_ids"]) for r in chat_sft(sft)]
    doc_tokens = sum(len(tok(d["text"])["input_ids"]) for d in docs)
    manifest = {
        "rows": {"sft": len(sft), "pref": len(pref), "pref_mixed": len(pref_mixed), "corpus_docs": len(docs)},
        "sft_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                       "total": sum(lengths), "over_512": sum(n > 512 for n in lengths)},
        "corpus_tokens": doc_tokens,
        "sha256_16": hashes,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 8, "head_dim": 64}


def small_model(tiny_dir: Path, out: Path) -> None:
    """The tiny model's tokenizer and config with SMALL's widths, weights drawn with a fixed seed."""
    import torch  # noqa: PLC0415 (slow imports, only when building inputs)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    config = AutoConfig.from_pretrained(tiny_dir)
    for key, value in SMALL.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    shutil.copy(tiny_dir / "chat_template.jinja", out / "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    parser.add_argument("--sft-rows", type=int, default=4000)
    parser.add_argument("--pref-rows", type=int, default=2000)
    parser.add_argument("--docs", type=int, default=8000)
    args = parser.parse_args()
    print(json.dumps(build(args.out, args.sft_rows, args.pref_rows, args.docs), indent=2))


if __name__ == "__main__":
    main()
