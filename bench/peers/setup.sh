#!/usr/bin/env bash
# Create the peers' virtual environments under bench/.venvs/ (git-ignored):
#   bench/.venvs/llamafactory   LlamaFactory 0.9.5 (its own caps: transformers<=5.6, peft<=0.18.1, ...)
#   bench/.venvs/trl            TRL, latest from the package registry, with peft
#   bench/.venvs/tunelab        tunelab as a user installs it (`pip install -e .`, no extras) — plain HF
#                               runs here too. The development venv holds the test extras, and one of
#                               them, bitsandbytes, is imported by peft at start-up (~1.2 s a launch).
# torch==2.13.0 goes in first in each, so the peers' requirements resolve against the same (CPU) torch
# tunelab uses; the script stops if a CUDA build of torch ended up installed.
#
# LlamaFactory 0.9.5 pulls torchvision and torchaudio builds that do not load beside the CPU torch
# ("operator torchvision::nms does not exist", then torchaudio's compiled library). Neither is needed
# for text training, so torchvision is uninstalled and torchaudio's compiled libraries are deleted
# (LlamaFactory imports torchaudio unconditionally; without the .so files torchaudio imports and
# reports its extension unavailable). `llamafactory-cli train` is then checked to import.
#
#   bash bench/peers/setup.sh            # all three (idempotent: an existing venv is only topped up)
#   bash bench/peers/setup.sh trl        # one
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENVS="${BENCH_VENVS:-$HERE/../.venvs}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TUNELAB_TORCH:-torch==2.13.0}"
LLAMAFACTORY_SPEC="${LLAMAFACTORY_SPEC:-llamafactory==0.9.5}"
TRL_SPEC="${TRL_SPEC:-trl}"
mkdir -p "$VENVS"

make_venv() {  # name -> path of its python, torch installed and checked
  local dir="$VENVS/$1"
  [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip wheel >&2
  "$dir/bin/pip" install -q $TORCH_SPEC >&2
  "$dir/bin/python" - <<'PY' >&2
import torch
assert torch.version.cuda is None or torch.cuda.is_available(), (
    f"torch {torch.__version__} is a CUDA build on a machine without a GPU: install the CPU build "
    "(TUNELAB_TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu')")
print("torch", torch.__version__)
PY
  echo "$dir/bin/python"
}

setup_llamafactory() {
  local py; py="$(make_venv llamafactory)"
  local pip="${py%/python}/pip"
  "$pip" install -q "$LLAMAFACTORY_SPEC" "$TORCH_SPEC" psutil
  # CUDA builds of the vision/audio companions crash the import beside the CPU torch; text needs neither.
  "$pip" uninstall -q -y torchvision 2>/dev/null || true
  "$pip" install -q --no-deps torchaudio
  local site; site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -f "$site"/torchaudio/lib/*.so
  "${py%/python}/llamafactory-cli" version
  "$py" -c "import llamafactory.train.tuner" && echo "llamafactory: train imports"
}

setup_trl() {
  local py; py="$(make_venv trl)"
  local pip="${py%/python}/pip"
  "$pip" install -q "$TRL_SPEC" peft "$TORCH_SPEC" psutil
  "$py" -c "import trl, peft, transformers; print('trl', trl.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)"
}

setup_tunelab() {
  local py; py="$(make_venv tunelab)"
  local pip="${py%/python}/pip"
  "$pip" install -q -e "$HERE/../.." "$TORCH_SPEC" psutil
  "$py" -c "import tunelab.train.run; import importlib.util as u; print('tunelab: train imports; bitsandbytes', 'present' if u.find_spec('bitsandbytes') else 'absent')"
}

for tool in "${@:-llamafactory trl tunelab}"; do
  for t in $tool; do
    echo "== $t"; "setup_$t"
  done
done
echo "== versions"
for v in "$VENVS"/*/; do
  echo "-- $(basename "$v")"
  "$v/bin/pip" list 2>/dev/null | grep -i -E '^(torch|transformers|peft|trl|datasets|accelerate|llamafactory|tokenizers) ' || true
done
