"""Optimizer-state memory of each memory-saving optimizer (train/optimizers.py) against AdamW, full fine-tuning.

Each optimizer runs in its own subprocess: the model loads (float32), the peak-RSS mark is reset, then a few
optimizer steps on one fixed batch. Reported per optimizer:
- state: the bytes of every tensor the optimizer keeps after the steps (optimizer.state; for BAdam its block
  optimizer's state and its float32 copy of the training block, for layer-wise GaLore the per-weight optimizers');
- peak increase: VmHWM after the steps minus VmRSS after loading (gradients, states, activations: everything
  but the weights), Linux only;
- the loss before the first and before the last step, to show it trains.

    python bench/optimizer_memory.py                         # SmolLM2-135M if bench/.data/real/smollm2-hf is there
    python bench/optimizer_memory.py --model tiny --steps 3

The model folder is the HF form of SmolLM2-135M-Instruct that bench/pure_bf16.py makes (scripts/fetch_real.py);
without it the embedded tiny model is used. One torch thread: GaLore's SVDs on two threads of a busy two-core
machine run far slower than on one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOLLM2 = HERE / ".data" / "real" / "smollm2-hf"

OPTIMIZERS = {  # name -> FinetuningArguments options (finetuning_type full)
    "adamw": {},
    "galore": {"use_galore": True},
    "galore_layerwise": {"use_galore": True, "galore_layerwise": True},
    "apollo": {"use_apollo": True},
    "apollo_mini": {"use_apollo": True, "apollo_rank": 1, "apollo_scale_type": "tensor", "apollo_scale": 128.0},
    "badam": {"use_badam": True},
    "adam_mini": {"use_adam_mini": True},
    "muon": {"use_muon": True},
}

_CHILD = r"""
import json, sys, tempfile, torch, transformers
from tunelab.config.args import FinetuningArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.train.memory import reset_peak_rss, rss_bytes
from tunelab.train.optimizers import build_optimizer, default_optimizer

model_dir, options, steps, seq = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
args = TrainingArguments(output_dir=tempfile.mkdtemp(), learning_rate=1e-5, use_cpu=True, report_to="none")
vocab = model.config.vocab_size
batch = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
baseline = rss_bytes()["VmRSS"]
reset_peak_rss()
optimizer = build_optimizer(model, args, FinetuningArguments(finetuning_type="full", **options))
optimizer = default_optimizer(model, args) if optimizer is None else optimizer
losses = []
for _ in range(steps):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())

def tensors_bytes(states):
    return sum(v.numel() * v.element_size() for s in states for v in s.values() if torch.is_tensor(v))

inner = getattr(optimizer, "optimizer_dict", None)  # layer-wise: one optimizer per weight
holders = inner.values() if inner else [getattr(optimizer, "base_optimizer", optimizer)]  # BAdam: its block's Adam
state = tensors_bytes(s for o in holders for s in o.state.values())
copies = getattr(optimizer, "param_idx2hp", {})  # BAdam: the float32 copy of the training block
state += sum(p.numel() * p.element_size() for p in copies.values())
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print("RESULT " + json.dumps({"state": state, "weights": weights, "peak_increase": rss_bytes()["VmHWM"] - baseline,
                              "loss_first": losses[0], "loss_last": losses[-1]}))
"""


def measure(model_dir: str, options: dict, steps: int, seq: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, model_dir, json.dumps(options), str(steps), str(seq)],
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{options} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.is_dir() else "tiny",
                        help="a model folder, or 'tiny' (the embedded tiny Llama)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (BAdam's default switch is 50)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row of the 2-row batch")
    parser.add_argument("--only", nargs="*", choices=list(OPTIMIZERS), help="measure these only")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir == "tiny":
        from tunelab.assets import EMBEDDED_MODELS  # noqa: PLC0415 - only for the fallback

        model_dir = str(EMBEDDED_MODELS["tiny"])
    results = {name: measure(model_dir, OPTIMIZERS[name], args.steps, args.seq) for name in args.only or OPTIMIZERS}
    mib = 2**20
    adamw = results.get("adamw", {}).get("state")
    print(f"model {Path(model_dir).name}: weights {next(iter(results.values()))['weights'] / mib:.0f} MiB float32; "
          f"{args.steps} steps, batch 2 x {args.seq}")
    print("| optimizer | state MiB | vs AdamW | peak RSS increase MiB | loss first → last |")
    print("|---|---:|---:|---:|---|")
    for name, r in results.items():
        share = f"{100 * r['state'] / adamw:.0f}%" if adamw else "-"
        print(f"| {name} | {r['state'] / mib:.1f} | {share} | {r['peak_increase'] / mib:.0f} | "
              f"{r['loss_first']:.3f} → {r['loss_last']:.3f} |")


if __name__ == "__main__":
    main()
