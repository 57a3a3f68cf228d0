# Sourced by tools/install_venv.sh and tools/install_sglang_venv.sh: the steps both venvs share.
# Defines PY and pip_install, installs torch unless the venv already has one, and pins that exact torch in
# $VENV/constraints.txt so that no later install swaps it; `check_torch_kept` verifies that at the end.
# Needs VENV set and the venv created.
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check --no-input -q "$@"; }

if ! "$PY" -c 'import torch' 2>/dev/null; then
  pip_install torch==2.13.0
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
echo "install: torch $TORCH_VERSION (pinned in $VENV/constraints.txt)"

check_torch_kept() {
  "$PY" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v == sys.argv[1] else f"torch changed to {v}")' \
    "$TORCH_VERSION"
  echo "install: done ($VENV)"
}
