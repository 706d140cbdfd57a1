#!/usr/bin/env bash
# bench/gpu.sh on a lent GPU machine that has a CUDA PyTorch but no network and no venvs (the `device` tool:
# the working tree travels, at most 64 MiB a call, and the machine stays warm 30 s between calls).
#
#   bash bench/gpu_lease.sh pack     # here: .whl/ (the venvs' exact versions, Python 3.12 wheels) and
#                                    # .gpu/part-aa, part-ab (SmolLM2's GGUF in two halves, one per call)
#   bash bench/gpu_lease.sh stash    # there, call 1 and 2: keep the GGUF half that travelled in /tmp
#   bash bench/gpu_lease.sh run      # there, last call: install the wheels into /tmp/site, stand-in venvs
#                                    # for tunelab / TRL / plain HF (the machine's python3), then bench/gpu.sh
#
# LlamaFactory stays out: its venv pins another transformers and pulls far more than a call can carry.
# `run` passes SECTIONS, STEPS, SEEDS... to bench/gpu.sh (defaults below) and tars the results files into
# $OUT/results.tgz; the log comes back by the call's own `| tee $OUT/log`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# What the tunelab and TRL venvs hold (bench/peers/setup.sh), and what they need beyond the machine's image.
WHEELS=(transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 accelerate==1.16.0 peft==0.21.2
        trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 gguf==0.19.0
        liger-kernel==0.8.5 kernels==0.19.1 tomlkit==0.15.3 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
        click==8.5.1 hf-xet==1.8.0 regex==2026.11.19 anyio==4.16.0 typing_extensions==4.16.0)

case "${1:-}" in
  pack)
    cd "$ROOT"
    rm -rf .whl .gpu && mkdir -p .whl .gpu
    platforms=()
    for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
      platforms+=(--platform "$p")
    done
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d .whl "${WHEELS[@]}"
    gguf="${TUNELAB_REAL_DIR:-$HOME/.cache/tunelab/real}/smollm2/$GGUF_NAME"  # scripts/fetch_real.py smollm2
    split -n 2 "$gguf" .gpu/part-
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    du -sh .whl .gpu/*
    ;;
  stash)
    mkdir -p /tmp/gguf-parts
    cp "$ROOT"/.gpu/part-* /tmp/gguf-parts/
    ls -la /tmp/gguf-parts
    ;;
  run)
    cd "$ROOT"
    site=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    # tunelab from this checkout; its console script through a dist-info that points at it
    mkdir -p "$site/tunelab-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: tunelab\nVersion: 0.1.0\n' > "$site/tunelab-0.1.0.dist-info/METADATA"
    printf '[console_scripts]\ntunelab = tunelab.cli:main\n' > "$site/tunelab-0.1.0.dist-info/entry_points.txt"
    export PYTHONPATH="$site:$ROOT/src"
    for venv in tunelab trl; do
      mkdir -p "bench/.venvs/$venv/bin"
      printf '#!/bin/sh\nexec python3 "$@"\n' > "bench/.venvs/$venv/bin/python"
      chmod +x "bench/.venvs/$venv/bin/python"
    done
    printf '#!/bin/sh\nexec python3 -c "import sys; from tunelab.cli import main; sys.argv[0] = \\"tunelab\\"; sys.exit(main())" "$@"\n' \
      > bench/.venvs/tunelab/bin/tunelab
    chmod +x bench/.venvs/tunelab/bin/tunelab
    export TUNELAB_REAL_DIR=/tmp/real
    mkdir -p "$TUNELAB_REAL_DIR/smollm2"
    parts=(/tmp/gguf-parts/part-*)
    cat "${parts[@]}" > "$TUNELAB_REAL_DIR/smollm2/$GGUF_NAME"
    python3 -c "import torch, transformers, peft, trl, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
    out="${OUT:-$ROOT/bench/.results}"
    status=0
    SECTIONS="${SECTIONS:-smollm2,grpo,liger,heldout}" TOOLS="${TOOLS:-tunelab,trl,hf}" SEEDS="${SEEDS:-0}" \
      timeout "${LEASE_SECONDS:-420}" bash bench/gpu.sh || status=$?
    mkdir -p "$out" bench/.results
    (cd bench/.results && tar czf "$out/results.tgz" --ignore-failed-read ./*.json liger-check/*/all_results.json) || true
    echo "bench/gpu.sh exit $status"
    exit "$status"
    ;;
  *)
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
