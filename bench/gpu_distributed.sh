#!/usr/bin/env bash
# DDP, DeepSpeed ZeRO-3 and FSDP on every GPU of this machine, bf16, through `tunelab train`: throughput and
# peak GPU memory per engine (docs/distributed.md, "On GPUs"). Prepared on a CPU-only machine, not yet run.
#
#   bash bench/gpu_distributed.sh [OUT]       # OUT defaults to /tmp/gpu_distributed
#
# Needs: CUDA GPUs, `pip install -e '.[deepspeed]'`; no network (a random ~0.3B Llama is built locally with the
# embedded tiny tokenizer, so the figures measure the engines, not a model's quality). Writes OUT/results.tsv:
# engine, GPUs, samples/s, steps/s, rank 0's peak allocated GPU MiB, first and last loss.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu_distributed}
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then echo "bench/gpu_distributed.sh: no CUDA GPU here" >&2; exit 1; fi
mkdir -p "$OUT"
export TUNELAB_CACHE="$OUT/cache"

python - "$OUT/model" <<'EOF'
import sys
from pathlib import Path

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import tunelab

tiny = Path(tunelab.__file__).parent / "assets" / "tiny-llama"
tokenizer = AutoTokenizer.from_pretrained(tiny)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                     tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
EOF

cat > "$OUT/cfg.yaml" <<EOF
model_name_or_path: $OUT/model
template: chatml
dataset: demo_sort
max_samples: 4096
cutoff_len: 256
finetuning_type: full
per_device_train_batch_size: 8
learning_rate: 1.0e-4
max_steps: 40
logging_steps: 5
bf16: true
seed: 0
disable_tqdm: true
plot_loss: false
save_strategy: "no"
EOF

# FSDP as examples/fsdp.yaml writes it (TrainingArguments names): the same run plus these keys.
cp "$OUT/cfg.yaml" "$OUT/fsdp.yaml"
cat >> "$OUT/fsdp.yaml" <<EOF
fsdp: full_shard auto_wrap
fsdp_config:
  version: 2
  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]
  reshard_after_forward: true
  state_dict_type: FULL_STATE_DICT
EOF

run() {  # engine, config, extra overrides...
  local engine=$1 cfg=$2; shift 2
  local start=$SECONDS
  if tunelab train "$cfg" "output_dir=$OUT/$engine" "nproc_per_node=$NGPU" "$@" \
      > "$OUT/$engine.log" 2>&1; then
    python - "$OUT/$engine" "$engine" "$NGPU" "$((SECONDS - start))" >> "$OUT/results.tsv" <<'EOF'
import json, sys
from pathlib import Path
out, engine, ngpu, wall = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
r = json.loads((out / "all_results.json").read_text())
losses = [json.loads(l)["loss"] for l in (out / "trainer_log.jsonl").read_text().splitlines() if '"loss"' in l]
print(engine, ngpu, r.get("train_samples_per_second"), r.get("train_steps_per_second"),
      r.get("gpu_peak_allocated_mib"), losses[0], losses[-1], wall, sep="\t")
EOF
  else
    printf '%s\t%s\tFAILED (see %s)\n' "$engine" "$NGPU" "$OUT/$engine.log" >> "$OUT/results.tsv"
  fi
}

printf 'engine\tgpus\tsamples_per_s\tsteps_per_s\tpeak_alloc_mib_rank0\tfirst_loss\tlast_loss\twall_s\n' > "$OUT/results.tsv"
run ddp "$OUT/cfg.yaml"
run zero3 "$OUT/cfg.yaml" deepspeed=examples/deepspeed/ds_z3_config.json
run fsdp "$OUT/fsdp.yaml"
column -t -s $'\t' "$OUT/results.tsv"
