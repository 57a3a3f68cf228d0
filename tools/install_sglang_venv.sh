#!/usr/bin/env bash
# Create or update .venv-sglang, the real SGLang server's own interpreter (the trainer's venv cannot hold sglang:
# it pins a CUDA-only torch). Idempotent; the Makefile calls it only when an input changed.
#   1. torch: kept when the venv already has one, else the CPU 2.13.0 wheel (preinstalled on these machines);
#   2. sglang, sglang-router, torchvision, triton without their declared dependencies (requirements/sglang-nodeps.txt);
#   3. the runtime packages SGLang needs, pinned, under a constraints file holding that exact torch;
#   4. this project's CPU compatibility code (tools/sglang_cpu/), put on the venv's path by a .pth file.
set -euo pipefail
VENV=${1:-.venv-sglang}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
source "$(dirname "$0")/venv_torch.sh"

pip_install -c "$VENV/constraints.txt" -r "$ROOT/requirements/sglang-cpu.txt"
pip_install --no-deps -r "$ROOT/requirements/sglang-nodeps.txt"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A path line (the stand-in sgl_kernel; appended after site-packages, so a real one wins) and an import line that
# installs the torchvision hook at interpreter start (tools/sglang_cpu/userrl_sglang_cpu.py says why).
printf '%s\nimport userrl_sglang_cpu\n' "$ROOT/tools/sglang_cpu" > "$SITE/userrl_sglang_cpu.pth"
check_torch_kept
