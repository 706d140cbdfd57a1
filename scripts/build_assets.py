"""Build the embedded tiny tokenizer and base model: src/tunelab/assets/tiny-llama/.

This script is the committed recipe for those files; nothing else writes them. It
  1. trains a byte-level BPE tokenizer (tokenizers library) on synthetic task text plus generic
     English-like prose, digits split one per token, chat-template markers as special tokens;
  2. initialises a small LlamaForCausalLM from a fixed seed (tied embeddings at 1/sqrt(hidden));
  3. optionally (--pretrain-steps, off by default) pretrains it on generic prose, never on task
     answers; off because every prose-pretrained variant tried learned the SFT tasks more slowly
     (full fine-tuning and much more so LoRA) than the seeded random init, and the quickstart must
     show a large jump within minutes on two CPU cores;
  4. saves tokenizer and model (fp32 safetensors) into the asset folder.

If src/tunelab/data/templates/chatml.jinja exists it becomes the tokenizer's chat_template.

Reproducible output: every random source is seeded (random.Random via synthetic.py, torch
manual_seed), torch runs single-threaded with deterministic algorithms, and JSON files are written
with sorted keys, so two runs give byte-identical files on the same library versions. Check with:
    python scripts/build_assets.py && (cd src/tunelab/assets/tiny-llama && sha256sum *) > /tmp/a
    python scripts/build_assets.py && (cd src/tunelab/assets/tiny-llama && sha256sum *) > /tmp/b
    diff /tmp/a /tmp/b && echo identical
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tunelab.data import synthetic

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "src" / "tunelab" / "assets" / "tiny-llama"
CHATML_TEMPLATE = ROOT / "src" / "tunelab" / "data" / "templates" / "chatml.jinja"

SEED = 0
VOCAB_SIZE = 1024  # upper bound: this small corpus runs out of merges first (about 860 tokens)
# Order fixes the ids: <pad>=0, <s>=1, </s>=2, then the chat markers.
CHAT_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|endoftext|>",
]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", *CHAT_TOKENS]

MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
# Tied embeddings drawn at 1/sqrt(hidden) instead of Llama's 0.02: with 0.02 the output logits are so
# small that LoRA (which cannot touch the embeddings) leaves the loss near 4 while accuracy rises, and
# full fine-tuning needs about twice the steps to reach the same exact match.
EMBED_STD = MODEL_SHAPE["hidden_size"] ** -0.5
PRETRAIN = dict(steps=0, batch_size=32, max_length=96, lr=2e-3, warmup=30)  # steps=0: see docstring


def corpus(seed: int) -> list[str]:
    """Tokenizer training text: every task's vocabulary, chat role names and generic prose."""
    lines = synthetic.prose(4000, seed)
    for task in synthetic.TASKS:
        for row in synthetic.generate(task, "train", 1000, seed):
            lines.append(f"{row['instruction']}\n{row['input']}\n{row['output']}")
    for row in synthetic.generate("multiturn", "train", 200, seed):
        lines.append(row["system"])
    # Role names as they appear after a chat marker, so they become single tokens.
    lines += ["system\nuser\nassistant\nhuman\ngpt\n"] * 200
    return lines


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())  # byte-level: every byte is in the alphabet, so no <unk>
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)  # no BOS/EOS added on encode
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=CHAT_TOKENS,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    if CHATML_TEMPLATE.is_file():
        tokenizer.chat_template = CHATML_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, embed_std: float = EMBED_STD) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        use_cache=True,
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, embed_std)
    return model


def pretrain(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int, steps: int, lr: float) -> None:
    """Causal-LM pretraining on generic prose (fixed data order, fixed seed)."""
    if steps <= 0:
        return
    cfg = PRETRAIN
    documents = synthetic.prose(steps * cfg["batch_size"], seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * max(0.0, 1 - s / steps)
    )
    model.train()
    for step in range(steps):
        chunk = documents[step * cfg["batch_size"] : (step + 1) * cfg["batch_size"]]
        texts = [text + tokenizer.eos_token for text in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=cfg["max_length"])
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step:4d} loss {loss.item():.3f}")
    model.eval()


def sort_json(path: Path) -> None:
    # Rewrite with sorted keys so field order never depends on dict insertion history.
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def empty_folder(out_dir: Path) -> None:
    """Start from an empty folder so no stale file (say an old chat template) survives a rebuild; only plain files
    are removed, so a mistyped --out cannot wipe a tree."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(p.is_dir() for p in out_dir.iterdir()):
        raise SystemExit(f"{out_dir} holds folders; pass --out an asset folder or a new path")
    for path in out_dir.iterdir():
        path.unlink()


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    empty_folder(out_dir)
    tokenizer.save_pretrained(out_dir)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if (out_dir / name).is_file():
            sort_json(out_dir / name)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors files arrive 0600; installed package data must be readable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN["steps"])
    parser.add_argument("--pretrain-lr", type=float, default=PRETRAIN["lr"])
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: float sums in a fixed order, so the weights are reproducible
    torch.use_deterministic_algorithms(True)
    start = time.time()
    tokenizer = build_tokenizer(SEED)
    model = build_model(tokenizer, SEED)
    pretrain(model, tokenizer, SEED, args.pretrain_steps, args.pretrain_lr)
    save(model, tokenizer, args.out)
    params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, vocab {len(tokenizer)}, {params:,} params) in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
