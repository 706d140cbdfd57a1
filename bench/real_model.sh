#!/usr/bin/env bash
# The real-model comparison (docs/benchmarks.md, "Real model"): SmolLM2-135M-Instruct with real weights, its own
# tokenizer and chat template, against LlamaFactory, TRL and plain HF (bench/run.py --model smollm2), then GRPO
# against TRL's GRPOTrainer (bench/grpo_vs_trl.py), LoRA SFT's time to a held-out accuracy, and LoRA SFT on the
# real-shape Qwen layout at 8 layers (bench/inputs.py real8). Every table in
# fp32, and in bf16 where the CPU has native bf16 (avx512_bf16 / amx_bf16: elsewhere bf16 is emulated and its
# timings say nothing). Run by `make bench`.
#
#   bash bench/real_model.sh                       # ~6 h on 2 cores
#   REPEATS=1 WORKLOADS=sft_lora bash bench/real_model.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-$HERE/.venvs/tunelab/bin/python}"
STEPS="${STEPS:-12}"
REPEATS="${REPEATS:-3}"
WORKLOADS="${WORKLOADS:-sft_lora,sft_lora_packed,sft_full,dpo_lora_mixed,pt}"
# The model folder first, with the development venv (`make setup`): dequantizing the GGUF needs the gguf extra,
# which the tunelab venv the timed runs use (no extras, as a user installs it) does not have.
"$HERE/../.venv/bin/python" "$HERE/inputs.py" --models tiny,small,smollm2,real8 > /dev/null
PRECISIONS="fp32"
if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  PRECISIONS="fp32 bf16"
else
  echo "bench/real_model.sh: this CPU has no native bf16: fp32 only (run it again on one with avx512_bf16 for bf16)"
fi
for precision in $PRECISIONS; do
  flag=(); [ "$precision" = bf16 ] && flag=(--bf16)
  "$PYTHON" "$HERE/run.py" --model smollm2 "${flag[@]}" --steps "$STEPS" --repeats "$REPEATS" --batch-size 4 \
    --cutoff-len 512 --workloads "$WORKLOADS" --label "real model $precision"
  # Time to a held-out token accuracy: longer runs, the probe evaluating every 8 steps (its time not counted).
  "$PYTHON" "$HERE/run.py" --model smollm2 "${flag[@]}" --steps 40 --repeats "$REPEATS" --batch-size 4 \
    --cutoff-len 512 --workloads sft_lora --no-second-launch --heldout-every 8 --tools tunelab,llamafactory,trl \
    --label "real model $precision, held-out accuracy"
  # The second model: the Qwen2.5-0.5B layout (vocabulary 151,936) at 8 layers, random weights (bench/inputs.py real8).
  "$PYTHON" "$HERE/run.py" --model real8 "${flag[@]}" --steps "$STEPS" --repeats "$REPEATS" --batch-size 4 \
    --cutoff-len 512 --workloads sft_lora,sft_lora_packed --no-second-launch --tools tunelab,llamafactory,trl \
    --label "real8 $precision"
  grpo=(); [ "$precision" = fp32 ] && grpo=(--fp32)
  "$PYTHON" "$HERE/grpo_vs_trl.py" "${grpo[@]}" --steps 8 --seeds 0,1,2
done
