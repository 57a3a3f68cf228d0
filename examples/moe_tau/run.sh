#!/usr/bin/env bash
# tau-bench retail training of Qwen3-30B-A3B (mixture of experts, EP8) on one node of 8 x H200.
#   bash examples/moe_tau/run.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
# tau-bench databases, tasks and policies (the task files have no public URL: DATA_FROM=<copy of shared/data>)
userrl data fetch ${DATA_FROM:+--from "$DATA_FROM"} --only taubench
userrl plan --config examples/moe_tau/config.yaml model.path="${MODEL_PATH:-/models/Qwen3-30B-A3B}" "$@"
userrl train --config examples/moe_tau/config.yaml model.path="${MODEL_PATH:-/models/Qwen3-30B-A3B}" "$@"
