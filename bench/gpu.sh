#!/usr/bin/env bash
# The real-shape comparison on a lent GPU (docs/benchmarks.md, "Real model shapes"): the Qwen2.5-0.5B
# layout at full depth (bench/inputs.py model-real24: vocab 151,936, 24 layers, 494M parameters, random
# init), bf16, against LlamaFactory and TRL (and plain HF), through bench/run.py, with MFU against the
# GPU's nominal dense bf16 peak. Four configurations of every workload:
#
#   sdpa               padded (peers) / padding-free by position ids (tunelab)
#   fa2                flash-attention 2: varlen padding-free batches (tunelab, TRL padding_free) and
#                      neat_packing's varlen rows (LlamaFactory, packed workload)
#   sdpa + liger, fa2 + liger   the same with Liger kernels (fused linear cross-entropy in the peers;
#                      tunelab computes its loss itself, so it gets Liger's other kernels and keeps its
#                      own logits-at-labels-only loss)
#
# Then the real model, SmolLM2-135M-Instruct (sft/dpo against every peer, GRPO against TRL; step 5, inside the
# warm-up the timing drops, is profiled: kernels launched and the GPU's busy share of the step), and the Liger check: tunelab trains the embedded tiny model 20 steps in bf16 with LlamaFactory's key
# `enable_liger_kernel: true` (transformers' use_liger_kernel) and without it: the two final training losses must
# agree within 5% (Liger's kernels change rounding, not the maths).
#
#   bash bench/gpu.sh --dry-run      # print what it would run (no GPU, no venvs needed)
#   bash bench/gpu.sh                # run: needs a CUDA torch in bench/.venvs/* (see below)
#   STEPS=20 WORKLOADS=sft_long_lora bash bench/gpu.sh
#   SECTIONS=smollm2,grpo TOOLS=tunelab,trl,hf SEEDS=0 bash bench/gpu.sh   # a part (bench/gpu_lease.sh)
#
# SECTIONS (default all, in this order): shapes (model-real24, four attention configurations), smollm2 (one
# run.py per workload, so each leaves its own results file), grpo, liger, heldout. A failed command is
# reported and the rest still run; the exit status is 1 then. TOOLS drops peers whose
# venv is absent; SEEDS are the GRPO seeds.
#
# Needs: nvidia-smi; bench/.venvs/{tunelab,llamafactory,trl} made with a CUDA torch
# (TUNELAB_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash bench/peers/setup.sh),
# flash-attn and liger-kernel in each venv (pip install flash-attn liger-kernel). PEAK_TFLOPS overrides the
# peak looked up from the GPU's name (dense bf16, datasheet).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN=0
STEPS="${STEPS:-30}"
REPEATS="${REPEATS:-1}"
CUTOFF="${CUTOFF:-2048}"
BATCH="${BATCH:-4}"
WORKLOADS="${WORKLOADS:-sft_long_lora,sft_lora,sft_lora_packed,sft_full,pt,dpo_lora}"
TOOLS="${TOOLS:-tunelab,llamafactory,trl,hf}"
SECTIONS="${SECTIONS:-shapes,smollm2,grpo,liger,heldout}"
SEEDS="${SEEDS:-0,1,2}"
has() { [[ ",$1," == *",$2,"* ]]; }  # has LIST ITEM
for section in ${SECTIONS//,/ }; do
  has shapes,smollm2,grpo,liger,heldout "$section" || { echo "bench/gpu.sh: unknown section '$section'" >&2; exit 2; }
done
PYTHON="${PYTHON:-$HERE/.venvs/tunelab/bin/python}"

for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/gpu.sh: unknown argument '$arg' (--dry-run, --help)" >&2; exit 2 ;;
  esac
done

peak_for() {  # GPU name -> nominal dense bf16 TFLOP/s (datasheet, SXM where both exist)
  case "$1" in
    *H200*|*H100*) echo 989 ;;
    *A100*) echo 312 ;;
    *L40S*) echo 362 ;;
    *A10G*|*A10*) echo 125 ;;
    *L4*) echo 121 ;;
    *4090*) echo 165 ;;
    *) echo "" ;;
  esac
}

if command -v nvidia-smi >/dev/null 2>&1; then
  GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
else
  GPU="none"
  if [ "$DRY_RUN" -eq 0 ]; then
    echo "bench/gpu.sh: no nvidia-smi: this script needs a GPU machine (--dry-run prints the plan)" >&2
    exit 1
  fi
fi
PEAK="${PEAK_TFLOPS:-$(peak_for "$GPU")}"
if [ -z "$PEAK" ]; then
  if [ "$DRY_RUN" -eq 0 ]; then
    echo "bench/gpu.sh: unknown GPU '$GPU': set PEAK_TFLOPS to its dense bf16 TFLOP/s" >&2
    exit 1
  fi
  PEAK=989  # the dry run shows an H100/H200's figure
fi
echo "GPU: $GPU; MFU against $PEAK TFLOP/s (dense bf16); $STEPS steps x $REPEATS, cutoff $CUTOFF, batch $BATCH"

run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$DRY_RUN" -eq 0 ]; then
    "$@" || { status=$?; echo "bench/gpu.sh: exit $status from the command above; going on" >&2; FAILED=1; }
  fi
}
FAILED=0

if [ "$DRY_RUN" -eq 0 ]; then
  for venv in tunelab llamafactory trl; do
    [ "$venv" = tunelab ] || has "$TOOLS" "$venv" || continue
    if [ ! -x "$HERE/.venvs/$venv/bin/python" ]; then
      echo "bench/gpu.sh: $HERE/.venvs/$venv is missing: make the venvs with a CUDA torch first (see the header)" >&2
      exit 1
    fi
  done
  "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA here'; print('torch', torch.__version__, torch.version.cuda)"
fi

common=(--model real24 --device cuda --bf16 --peak-tflops "$PEAK" --steps "$STEPS" --repeats "$REPEATS"
        --cutoff-len "$CUTOFF" --batch-size "$BATCH" --workloads "$WORKLOADS" --tools "$TOOLS" --no-second-launch)
if has "$SECTIONS" shapes; then
  for attn in sdpa fa2; do
    run "$PYTHON" "$HERE/run.py" "${common[@]}" --attn "$attn" --label "gpu $GPU $attn"
    run "$PYTHON" "$HERE/run.py" "${common[@]}" --attn "$attn" --liger --label "gpu $GPU $attn liger"
  done
fi

# The real model (docs/benchmarks.md, "Real model"): SmolLM2-135M-Instruct, its own template, every SFT/DPO
# workload at bf16 against every peer, then GRPO against TRL's GRPOTrainer (3 seeds).
if has "$SECTIONS" smollm2; then
  for workload in sft_lora sft_lora_packed sft_full dpo_lora_mixed; do
    run "$PYTHON" "$HERE/run.py" --model smollm2 --device cuda --bf16 --peak-tflops "$PEAK" --steps "$STEPS" \
      --repeats "$REPEATS" --cutoff-len 1024 --batch-size "$BATCH" --workloads "$workload" --tools "$TOOLS" \
      --no-second-launch --count-ops 5 --label "gpu $GPU smollm2"
  done
fi
if has "$SECTIONS" grpo; then
  # tunelab-unmerged: the same run sampling through the adapter, to see what merged sampling saves on a GPU
  run "$PYTHON" "$HERE/grpo_vs_trl.py" --device cuda --steps 8 --seeds "$SEEDS" --tools tunelab,tunelab-unmerged,trl
fi
if has "$SECTIONS" liger; then
  LIGER_OUT="$HERE/.results/liger-check"
  for liger in false true; do
    run "$(dirname "$PYTHON")/tunelab" train model_name_or_path=tiny template=chatml dataset=demo_reverse \
      max_samples=320 max_steps=20 per_device_train_batch_size=16 learning_rate=1e-3 seed=0 bf16=true \
      logging_steps=5 plot_loss=false overwrite_output_dir=true enable_liger_kernel="$liger" \
      output_dir="$LIGER_OUT/$liger"
  done
  run "$PYTHON" - "$LIGER_OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
loss = {name: json.loads((out / name / "all_results.json").read_text())["train_loss"] for name in ("false", "true")}
print(f"liger check: train_loss {loss['false']:.4f} without, {loss['true']:.4f} with enable_liger_kernel")
assert abs(loss["true"] - loss["false"]) <= 0.05 * loss["false"], "the losses with and without Liger differ by > 5%"
PY
fi
# Time to a held-out accuracy and the held-out loss (the probe scores every tool's model on the same rows).
if has "$SECTIONS" heldout; then
  run "$PYTHON" "$HERE/run.py" --model smollm2 --device cuda --bf16 --peak-tflops "$PEAK" --steps 40 \
    --repeats "$REPEATS" --cutoff-len 512 --batch-size "$BATCH" --workloads sft_lora --heldout-every 8 \
    --tools "$TOOLS" --no-second-launch --label "gpu $GPU smollm2 held-out"
fi
exit "$FAILED"
