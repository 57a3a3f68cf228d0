#!/usr/bin/env bash
# MUA-RL-style tau-bench training, Qwen3-32B on 4 nodes x 8 H200: submit with SLURM (Ray across the nodes).
#   bash examples/mua_tau/run.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
# tau-bench databases, tasks and policies (the task files have no public URL: DATA_FROM=<copy of shared/data>)
userrl data fetch ${DATA_FROM:+--from "$DATA_FROM"} --only taubench
sbatch --nodes=4 slurm/train.sbatch --config examples/mua_tau/config.yaml \
  model.path="${MODEL_PATH:-/models/Qwen3-32B}" \
  "$@"
