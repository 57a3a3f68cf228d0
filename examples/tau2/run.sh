#!/usr/bin/env bash
# tau2-bench training: Qwen3-8B on this 8 x H100 node, or Qwen3-32B on three nodes through SLURM (SIZE=32b).
#   DATA_FROM=<data folder holding tau2/> [SIZE=32b] [MODEL_PATH=...] bash examples/tau2/run.sh [key=value ...]
# The run serves its own user simulator (the starting checkpoint). Relaunching resumes from the latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The tau2 data has no `userrl data fetch` group: point DATA_FROM at a copy of the data folder (e.g. shared/data).
: "${DATA_FROM:?set DATA_FROM to a copy of the data folder that holds tau2/ (e.g. shared/data)}"
data=$(realpath "$DATA_FROM")  # absolute: every node of a SLURM run reads it from the same path
test -f "$data/tau2/SPEC.md" || { echo "no tau2/ in $data" >&2; exit 2; }
if [ "${SIZE:-8b}" = 32b ]; then
  model=${MODEL_PATH:-/models/Qwen3-32B}
  sbatch --nodes=3 slurm/train.sbatch --config examples/tau2/config-32b.yaml \
    gyms.data_dir="$data" model.path="$model" user_sim.engines.model="$model" "$@"
else
  model=${MODEL_PATH:-/models/Qwen3-8B}
  userrl train --config examples/tau2/config.yaml \
    gyms.data_dir="$data" model.path="$model" user_sim.engines.model="$model" "$@"
fi
