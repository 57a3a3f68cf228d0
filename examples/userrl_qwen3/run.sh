#!/usr/bin/env bash
# UserRL's multi-turn GRPO recipe on one 8 x H100 node. Multi-node: `sbatch slurm/train.sbatch --config ...`.
# The user simulator must be up first (e.g. `sglang.launch_server --model Qwen/Qwen3-32B --port 8000` on other
# GPUs, or set USER_SIM_URL to an OpenAI-compatible endpoint). Relaunching resumes from the latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
# UserRL parquets and gym data, tau-bench databases, sha256-checked. The tau-bench task files have no public URL:
# point DATA_FROM at a copy of the data folder (e.g. shared/data) to copy them from there.
userrl data fetch ${DATA_FROM:+--from "$DATA_FROM"}
userrl train --config examples/userrl_qwen3/config.yaml \
  model.path="${MODEL_PATH:-/models/Qwen3-8B}" \
  user_sim.base_url="${USER_SIM_URL:-http://127.0.0.1:8000/v1}" \
  algo.turn_level="${TURN_LEVEL:-Equalized}" \
  algo.trajectory_score="${TRAJECTORY_SCORE:-Sum}" \
  "$@"
