#!/usr/bin/env bash
# Bring up a Ray cluster over the nodes of the current SLURM allocation: the head on the first node, one worker
# per other node, each as a background `srun` step. Source this from an sbatch script, then run the driver on
# the head with `srun --overlap -w "$RAY_HEAD_NODE" ...` and RAY_ADDRESS exported here.
# Never kills anything it did not start: the steps end with the job.
set -euo pipefail

: "${SLURM_JOB_NODELIST:?run inside a SLURM allocation}"
RAY_PORT=${RAY_PORT:-6379}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}
CPUS_PER_NODE=${CPUS_PER_NODE:-${SLURM_CPUS_PER_TASK:-32}}
mapfile -t RAY_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
RAY_HEAD_NODE=${RAY_NODES[0]}
# Pick the IPv4 address when the node reports several.
RAY_HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$RAY_HEAD_NODE" hostname --ip-address | tr ' ' '\n' | grep -m1 -E '^[0-9.]+$')
export RAY_HEAD_NODE RAY_HEAD_IP RAY_ADDRESS="$RAY_HEAD_IP:$RAY_PORT"

# Set before `ray start`: workers inherit the raylet's environment.
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=true
if [ -n "${NET_IFNAME:-}" ]; then  # multi-NIC nodes: gloo and NCCL must use the routable interface
  export GLOO_SOCKET_IFNAME=$NET_IFNAME NCCL_SOCKET_IFNAME=$NET_IFNAME TP_SOCKET_IFNAME=$NET_IFNAME
fi
RUN=${CONTAINER_RUN:-}  # e.g. "apptainer exec --nv image.sif"

echo "ray: head $RAY_HEAD_NODE ($RAY_ADDRESS), ${#RAY_NODES[@]} nodes x $GPUS_PER_NODE GPUs"
srun --nodes=1 --ntasks=1 -w "$RAY_HEAD_NODE" $RUN ray start --head --node-ip-address="$RAY_HEAD_IP" \
  --port="$RAY_PORT" --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --disable-usage-stats --block &
for node in "${RAY_NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" $RUN ray start --address="$RAY_ADDRESS" \
    --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --disable-usage-stats --block &
done

# Wait (with a deadline) until every node has joined; a worker that never joins is the classic silent hang.
want=$(( ${#RAY_NODES[@]} * GPUS_PER_NODE ))
deadline=$(( SECONDS + ${RAY_JOIN_TIMEOUT:-300} ))
until srun --overlap --nodes=1 --ntasks=1 -w "$RAY_HEAD_NODE" $RUN python3 -c "
import ray, sys; ray.init(address='$RAY_ADDRESS', logging_level='ERROR')
sys.exit(0 if ray.cluster_resources().get('GPU', 0) >= $want else 1)" 2>/dev/null; do
  if (( SECONDS > deadline )); then
    echo "ray: only part of the cluster joined after ${RAY_JOIN_TIMEOUT:-300} s" >&2
    srun --overlap --nodes=1 --ntasks=1 -w "$RAY_HEAD_NODE" $RUN ray status >&2 || true
    exit 1
  fi
  sleep 5
done
srun --overlap --nodes=1 --ntasks=1 -w "$RAY_HEAD_NODE" $RUN ray status
