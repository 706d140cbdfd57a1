"""Identical inputs for every tool of the peer comparison (bench/run.py), written to bench/.data/peers/.

What it writes (deterministic: the same files on every run and machine):

    model/              the embedded tiny Llama (tokenizer, chat_template.jinja, weights), copied as is
    model-small/        the same tokenizer on a randomly initialised Llama of real layer widths (hidden 512,
                        8 layers, 27M non-embedding parameters), for MFU where matmuls are not tiny
                        (`run.py --model small`)
    model-real/         a real model's shapes: the Qwen2.5-0.5B layout (vocab 151,936, hidden 896,
                        intermediate 4,864, 14 heads, 2 KV heads, tied head) cut to 2 layers, random init
                        (`run.py --model real`; built only when asked: `--models tiny,small,real`). Token ids
                        come from the embedded tokenizer (8,192 of them); the vocabulary size is what costs:
                        the head alone is 136M parameters, fp32 logits of 2,048 tokens 1.2 GB
    model-real8/        the same at 8 layers (a depth a 2-core CPU can time; the output head's share nearer a real model's)
    model-real24/       the same at full depth (24 layers, 494M parameters): bench/gpu.sh
    model-smollm2/      a real pretrained model: SmolLM2-135M-Instruct (30 layers, tied vocabulary of 49,152),
                        its own tokenizer and chat template; a link to bench/.data/real/smollm2-hf, the plain HF
                        folder dequantized from the registry's GGUF (scripts/fetch_real.py; `--models smollm2`)
    model-smollm2-thin/ SmolLM2's layout, tokenizer and template at its full depth (30 layers) and vocabulary but
                        widths of 48-128 (random weights): a step costs little arithmetic and as many operator
                        launches as SmolLM2's, so on a CPU it times the per-operator overhead a GPU step of the
                        real model waits on (`--models smollm2-thin`)
    model-qwen0.5b/     Qwen2.5-Coder-0.5B-Instruct's real weights (24 layers, vocabulary 151,936, untied head as the
                        GGUF stores it) with its tokenizer and template, as model-smollm2 (`--models qwen0.5b`;
                        scripts/fetch_real.py qwen2.5-coder-0.5b first)
    sft.json            mixed-length SFT rows, alpaca {"instruction", "input", "output"}
    sft_chat.json       the same rows as prompt/completion messages (TRL, plain HF): user content is
                        instruction + "\\n" + input, as alpaca is rendered by tunelab and LlamaFactory
    heldout_chat.json   64 held-out rows of sft.json's kinds (the tasks' test split, prose from another pool),
                        as messages: the probe's token accuracy for t→acc (run.py --heldout-every)
    pref.json           preference rows, alpaca ranking {"instruction", "input", "chosen", "rejected"}
    pref_chat.json      the same rows as TRL's conversational preference format
    pref_mixed.json     mixed-length pairs: the first SFT rows' prompts, chosen = the row's own answer,
                        rejected = another row's answer (seeded), so the two sides differ in length as
                        real preference data does (pref.json's answers are all 21-37 tokens long)
    pref_mixed_chat.json  the same rows for TRL
    sft_long.json       long-prompt SFT: a document of ~300-1,700 tokens and a question whose answer is a copy
                        of 1-12 of its sentences or their count (prompts are 94% of the tokens, see the
                        manifest: the common SFT case where most positions have no label)
    sft_long_chat.json  the same rows for TRL and plain HF
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


def sft_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Half short task rows (sort, add, reverse) of `split`, half prose rows drawn from a pool seeded by `seed`."""
    rng = random.Random(seed)
    pool = synthetic.prose(2000, seed=seed)
    short = [r for task in ("sort", "add", "reverse") for r in synthetic.generate(task, split, num_rows // 2, seed)]
    rng.shuffle(short)
    rows = [short.pop() if rng.random() < 0.5 else _prose_row(rng, pool) for _ in range(num_rows)]
    return rows


LONG_QUESTIONS = (
    "Copy the last {k} sentences of the document.",
    "Copy the first {k} sentences of the document.",
    "How many sentences does the document have?",
)


def heldout_rows(num_rows: int) -> list[dict]:
    """Rows of sft.json's kinds that it cannot hold: the tasks' test split, prose from another pool (seed 1)."""
    return sft_rows(num_rows, seed=1, split="test")


def long_prompt_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """Long documents (20-110 sentences) and a short answer: a copy of 1-12 of its sentences, or their count."""
    rng = random.Random(seed)
    pool = synthetic.prose(2000, seed=seed + 1)
    rows = []
    for _ in range(num_rows):
        sentences = [s.strip() + "." for doc in rng.sample(pool, 40) for s in doc.split(".") if s.strip()]
        n = min(len(sentences), rng.randint(20, 110))
        kind, k = rng.randrange(len(LONG_QUESTIONS)), rng.randint(1, 12)
        answer = (" ".join(sentences[n - k : n]), " ".join(sentences[:k]), str(n))[kind]
        rows.append({"instruction": LONG_QUESTIONS[kind].format(k=k), "input": " ".join(sentences[:n]), "output": answer})
    return rows


def chat_sft(rows: list[dict]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": user_text(r)}], "completion": [{"role": "assistant", "content": r["output"]}]}
        for r in rows
    ]


def chat_pref(rows: list[dict]) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": user_text(r)}],
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


def user_text(row: dict) -> str:
    """An alpaca row's user message, as tunelab and LlamaFactory render alpaca: instruction, newline, input."""
    return f"{row['instruction']}\n{row['input']}" if row["input"] else row["instruction"]


def _write(path: Path, rows: list[dict]) -> str:
    text = json.dumps(rows, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(out: Path = DATA_DIR, sft_rows_n: int = 4000, pref_rows_n: int = 2000, docs_n: int = 8000,
          long_rows_n: int = 400, heldout_rows_n: int = 64, models: tuple[str, ...] = ("tiny", "small")) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(TINY_MODEL_DIR, model_dir)

    small_model(model_dir, out / "model-small")
    for name in models:
        if name in REAL:
            real_model(model_dir, out / f"model-{name}", REAL[name])
        elif name == "smollm2":
            smollm2_model(out / "model-smollm2")
        elif name == "smollm2-thin":
            thin_model(out / "model-smollm2-thin")
        elif name == "qwen0.5b":
            registry_model(out / "model-qwen0.5b", "qwen2.5-coder-0.5b")

    sft = sft_rows(sft_rows_n)
    long_rows = long_prompt_rows(long_rows_n)
    pref = synthetic.generate("preference", "train", pref_rows_n, seed=0)
    pref_mixed = mixed_pairs(sft[:pref_rows_n])
    docs = corpus.generate("corpus", "train", docs_n, seed=0)
    hashes = {
        "sft.json": _write(out / "sft.json", sft),
        "sft_chat.json": _write(out / "sft_chat.json", chat_sft(sft)),
        "heldout_chat.json": _write(out / "heldout_chat.json", chat_sft(heldout_rows(heldout_rows_n))),
        "pref.json": _write(out / "pref.json", pref),
        "pref_chat.json": _write(out / "pref_chat.json", chat_pref(pref)),
        "pref_mixed.json": _write(out / "pref_mixed.json", pref_mixed),
        "pref_mixed_chat.json": _write(out / "pref_mixed_chat.json", chat_pref(pref_mixed)),
        "corpus.json": _write(out / "corpus.json", [{"text": d["text"]} for d in docs]),
        "sft_long.json": _write(out / "sft_long.json", long_rows),
        "sft_long_chat.json": _write(out / "sft_long_chat.json", chat_sft(long_rows)),
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
        "bench_sft_long": {"file_name": "sft_long.json", "formatting": "alpaca",
                           "columns": {"prompt": "instruction", "query": "input", "response": "output"}},
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
    long_total, long_prompt = [], []
    for r in chat_sft(long_rows):
        long_prompt.append(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]))
        long_total.append(len(tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True)["input_ids"]))
    manifest = {
        "rows": {"sft": len(sft), "pref": len(pref), "pref_mixed": len(pref_mixed), "corpus_docs": len(docs),
                 "sft_long": len(long_rows)},
        "sft_long_tokens": {"min": min(long_total), "median": statistics.median(long_total), "max": max(long_total),
                            "total": sum(long_total), "prompt_share": sum(long_prompt) / sum(long_total),
                            "over_2048": sum(n > 2048 for n in long_total)},
        "sft_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                       "total": sum(lengths), "over_512": sum(n > 512 for n in lengths)},
        "corpus_tokens": doc_tokens,
        "sha256_16": hashes,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 8, "head_dim": 64}


# The Qwen2.5-0.5B layout (its config.json), random weights; "real" is cut to 2 layers for CPU runs.
QWEN05 = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
          "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
          "tie_word_embeddings": True, "use_sliding_window": False}
REAL = {"real": {**QWEN05, "num_hidden_layers": 2}, "real8": {**QWEN05, "num_hidden_layers": 8},
        "real24": {**QWEN05, "num_hidden_layers": 24}}


def smollm2_model(link: Path) -> None:
    """model-smollm2 -> the HF folder of SmolLM2-135M-Instruct, built once from its GGUF (bench/pure_bf16.py)."""
    registry_model(link, "smollm2")


def registry_model(link: Path, name: str) -> None:
    """link -> the plain HF folder of scripts/fetch_real.py's `name`, built once from its GGUF (bench/pure_bf16.py)."""
    import sys  # noqa: PLC0415
    bench = Path(__file__).resolve().parent
    sys.path[:0] = [str(bench), str(bench.parent / "scripts")]
    import pure_bf16  # noqa: PLC0415 (imports torch and transformers: only when asked for)

    folder = pure_bf16.hf_folder(bench / ".data" / "real" / f"{name}-hf", name)
    if not link.exists():
        link.symlink_to(folder.resolve(), target_is_directory=True)


# Every width of SmolLM2-135M cut to 48-128 (its depth, vocabulary, GQA ratio and tied head kept): a step's arithmetic is
# a few percent of the real model's, its operator count the same.
THIN = {"hidden_size": 48, "intermediate_size": 128, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}


def thin_model(out: Path) -> None:
    """model-smollm2-thin: SmolLM2's config with THIN's widths, seeded random weights, its tokenizer and template."""
    import torch  # noqa: PLC0415 (slow imports, only when building inputs)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    smollm2_model(out.parent / "model-smollm2")
    source = (out.parent / "model-smollm2").resolve()
    config = AutoConfig.from_pretrained(source)
    for key, value in THIN.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)


def real_model(tiny_dir: Path, out: Path, shape: dict) -> None:
    """A Qwen2ForCausalLM of `shape` with the tiny model's tokenizer and special-token ids, seeded random weights."""
    import torch  # noqa: PLC0415 (slow imports, only when building inputs)
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    if (out / "config.json").exists() and all(
        json.loads((out / "config.json").read_text()).get(k) == v for k, v in shape.items()
    ):
        return  # seeded and deterministic: an existing copy is the same model (hundreds of MB to rewrite)
    tiny = AutoConfig.from_pretrained(tiny_dir)
    config = Qwen2Config(**shape, bos_token_id=tiny.bos_token_id, eos_token_id=tiny.eos_token_id,
                         pad_token_id=getattr(tiny, "pad_token_id", None))
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    shutil.copy(tiny_dir / "chat_template.jinja", out / "chat_template.jinja")


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
    parser.add_argument("--long-rows", type=int, default=400)
    parser.add_argument("--models", default="tiny,small", help="also real (2 layers), real8, real24 (full depth), smollm2 and qwen0.5b (real weights) and smollm2-thin")
    args = parser.parse_args()
    manifest = build(args.out, args.sft_rows, args.pref_rows, args.docs, args.long_rows,
                     models=tuple(args.models.split(",")))
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
