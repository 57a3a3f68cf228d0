# Ray over the nodes of the current SLURM allocation. Sourced by slurm/train.sbatch after slurm/job_env.sh;
# defines ray_cluster_start and ray_cluster_stop.
#
# Bring-up: the head on the batch host (the allocation's first node), then one worker per other node, each a
# background `srun --overlap` step running slurm/ray_node.sh (Ray in the step's foreground). A node counts as
# joined once its `ray start` reports the runtime started; the GCS must then list every node alive. A node whose
# step exits, or that has not joined by the deadline, stops the job with its name, its state and its log tail.
# Per-node logs: slurm-logs/JOBID/ray-NODE.log.
#
# Variables (all optional):
#   USERRL_RAY_PORT       GCS port; the Ray client server uses +1 and the dashboard agent +2 (default: derived
#                         from the job id in 20000-28999, so jobs sharing a node never collide)
#   USERRL_RAY_CPUS       CPUs Ray may schedule per node (default: the job's CPUs per task on that node)
#   USERRL_GPUS_PER_NODE  GPUs Ray may schedule per node (default: the GPUs Slurm gives the step)
#   USERRL_NET_IF         network interface the nodes reach each other on (see slurm/ray_node.sh)
#   USERRL_RAY_TMPDIR     where each node keeps the job's Ray session directory userrl-ray-JOBID (default /tmp;
#                         keep it short: Ray's socket paths must fit in 107 characters); deleted at the end
#   USERRL_RAY_LOGS       the per-node logs go to USERRL_RAY_LOGS/JOBID/ (default: slurm-logs in the submit dir)
#   USERRL_RAY_JOIN_TIMEOUT   seconds to wait for every node (default 300)
#   USERRL_RAY_STOP_TIMEOUT   seconds to wait for every node to stop at the end (default 60)

declare -A RAY_STEP_PID=()

ray_cluster_start() {
  : "${SLURM_JOB_ID:?run inside a SLURM job}"
  local nodes node
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  RAY_HEAD_NODE=${SLURMD_NODENAME:-${nodes[0]}}
  RAY_WORKER_NODES=()
  for node in "${nodes[@]}"; do [ "$node" = "$RAY_HEAD_NODE" ] || RAY_WORKER_NODES+=("$node"); done

  export USERRL_RAY_PORT=${USERRL_RAY_PORT:-$((20000 + (SLURM_JOB_ID % 3000) * 3))}
  export USERRL_RAY_CPUS=${USERRL_RAY_CPUS:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}}
  # Only ever a directory of this job: every node deletes it at the end.
  export USERRL_RAY_TMP=${USERRL_RAY_TMPDIR:-/tmp}/userrl-ray-$SLURM_JOB_ID
  USERRL_RAY_LOGS=${USERRL_RAY_LOGS:-$PWD/slurm-logs}/$SLURM_JOB_ID
  mkdir -p "$USERRL_RAY_LOGS"
  RAY_HEAD_IP=$(${USERRL_CONTAINER:-} bash slurm/ray_node.sh ip) || die "no address for the Ray head on $RAY_HEAD_NODE"
  export RAY_HEAD_IP RAY_HEAD_NODE RAY_ADDRESS="$RAY_HEAD_IP:$USERRL_RAY_PORT"
  say "Ray: head $RAY_HEAD_NODE at $RAY_ADDRESS, ${#RAY_WORKER_NODES[@]} worker node(s)," \
    "$USERRL_RAY_CPUS CPUs per node, logs in $USERRL_RAY_LOGS"

  _ray_launch head "$RAY_HEAD_NODE"
  _ray_wait_joined "$RAY_HEAD_NODE"
  for node in "${RAY_WORKER_NODES[@]}"; do _ray_launch worker "$node"; done
  _ray_wait_joined "${RAY_WORKER_NODES[@]}"
  _ray_check_gcs $((${#RAY_WORKER_NODES[@]} + 1))
}

_ray_launch() {  # role node
  # All the job's CPUs on the node (SRUN_CPUS_PER_TASK, slurm/job_env.sh): Ray's workers run on the raylet's.
  srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$SRUN_CPUS_PER_TASK" --nodelist="$2" \
    ${USERRL_CONTAINER:-} bash slurm/ray_node.sh "$1" >"$USERRL_RAY_LOGS/ray-$2.log" 2>&1 &
  RAY_STEP_PID[$2]=$!
}

_ray_wait_joined() {  # nodes...
  local timeout=${USERRL_RAY_JOIN_TIMEOUT:-300} pending=("$@") still node rc
  local deadline=$((SECONDS + timeout))
  while ((${#pending[@]})); do
    still=()
    for node in "${pending[@]}"; do
      if grep -q "Ray runtime started" "$USERRL_RAY_LOGS/ray-$node.log" 2>/dev/null; then
        continue
      elif ! kill -0 "${RAY_STEP_PID[$node]}" 2>/dev/null; then
        rc=0
        wait "${RAY_STEP_PID[$node]}" || rc=$?
        _ray_report_missing "$node" "its Ray step exited with status $rc"
        die "Ray did not start on $node"
      fi
      still+=("$node")
    done
    pending=("${still[@]}")
    ((${#pending[@]})) || break
    if ((SECONDS > deadline)); then
      for node in "${pending[@]}"; do _ray_report_missing "$node" "not joined after ${timeout} s"; done
      die "Ray: ${#pending[@]} node(s) missing after ${timeout} s: ${pending[*]}" \
        "(raise USERRL_RAY_JOIN_TIMEOUT, or set USERRL_NET_IF if the nodes cannot reach $RAY_ADDRESS)"
    fi
    sleep 2
  done
}

_ray_report_missing() {  # node reason
  echo "userrl slurm: Ray node $1 missing: $2; last lines of $USERRL_RAY_LOGS/ray-$1.log:" >&2
  tail -n 15 "$USERRL_RAY_LOGS/ray-$1.log" 2>/dev/null | sed 's/^/    /' >&2
}

_ray_check_gcs() {  # expected node count
  ${USERRL_CONTAINER:-} python - "$1" <<'EOF' || die "Ray: the GCS at $RAY_ADDRESS does not list every node"
import os, sys, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
res = ray.cluster_resources()
print(f"userrl slurm: Ray ready: {len(alive)} node(s) {sorted(n['NodeManagerAddress'] for n in alive)}, "
      f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs", flush=True)
sys.exit(0 if len(alive) >= int(sys.argv[1]) else 1)
EOF
}

ray_cluster_stop() {
  ((${#RAY_STEP_PID[@]})) || return 0
  local node pids=() deadline=$((SECONDS + ${USERRL_RAY_STOP_TIMEOUT:-60}))
  say "Ray: stopping on ${#RAY_STEP_PID[@]} node(s)"
  for node in "${!RAY_STEP_PID[@]}"; do pids+=("${RAY_STEP_PID[$node]}"); done
  # SIGTERM to every step of this job (not to this shell): slurm/ray_node.sh then stops Ray and cleans up.
  # Signalling the srun processes instead would make srun cancel its step with SIGKILL, skipping that cleanup.
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM "${pids[@]}" 2>/dev/null || true
  for node in "${!RAY_STEP_PID[@]}"; do
    while kill -0 "${RAY_STEP_PID[$node]}" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    if kill -0 "${RAY_STEP_PID[$node]}" 2>/dev/null; then
      echo "userrl slurm: Ray on $node still stopping; Slurm ends the step with the job" >&2
    else
      grep -h "Ray stopped" "$USERRL_RAY_LOGS/ray-$node.log" 2>/dev/null || true
    fi
  done
  RAY_STEP_PID=()
}
