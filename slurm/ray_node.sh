#!/usr/bin/env bash
# One Ray node of a SLURM job. slurm/ray_cluster.sh runs it with `srun` once per node:
#
#   slurm/ray_node.sh head     start the Ray head here and keep it in the foreground of this job step
#   slurm/ray_node.sh worker   join the head at $RAY_HEAD_IP:$USERRL_RAY_PORT
#   slurm/ray_node.sh ip       print the address this node uses for Ray (see below) and exit
#
# Ray lives in this step's foreground (`ray start --block`), so it ends with the step. On SIGTERM or exit (job
# finished, scancel, time limit) the node stops its own Ray processes (only those: other Ray instances on a
# shared node are not touched, so no `ray stop`) and deletes this job's session directory; the session files
# live under $USERRL_RAY_TMP (per job), never in /tmp/ray, so no later local `ray.init()` can attach to them.
#
# The node's address: the IPv4 address of $USERRL_NET_IF when set (nodes with several interfaces, e.g. Ethernet
# plus InfiniBand), else on a worker the source address of its route to the head, else the non-loopback address
# the host name resolves to, else the first of `hostname -I`.
#
# gloo, NCCL's bootstrap and tensorpipe bind where Ray's address is: GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME and
# TP_SOCKET_IFNAME are exported to `ray start` (so to every Ray worker: actor ranks, engines) as the interface that
# holds that address. Without them gloo binds to what the host name resolves to (127.0.1.1 on stock Ubuntu), and
# its groups across nodes never form. $USERRL_NET_IF, when set, is all three; otherwise a variable already set is
# kept. NCCL gets "=IF", an exact name rather than a prefix (https://docs.nvidia.com/deeplearning/nccl/user-guide/
# docs/env.html#nccl-socket-ifname); gloo takes the name itself (https://pytorch.org/docs/stable/distributed.html,
# "Choosing the network interface to use").
set -uo pipefail

role=${1:?usage: ray_node.sh head|worker|ip}
node=${SLURMD_NODENAME:-$(hostname -s)}

fail() {
  echo "ray_node[$node]: error: $*" >&2
  exit 1
}

node_ip() {
  local ip=""
  if [ -n "${USERRL_NET_IF:-}" ]; then
    ip=$(ip -4 -o addr show dev "$USERRL_NET_IF" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    [ -n "$ip" ] || fail "USERRL_NET_IF=$USERRL_NET_IF has no IPv4 address on $node; interfaces here:" \
      "$(ip -4 -o addr show 2>/dev/null | awk '{printf "%s=%s ", $2, $4}')"
  elif [ "$role" = worker ] && command -v ip >/dev/null; then
    ip=$(ip -4 route get "$RAY_HEAD_IP" 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
  fi
  [ -n "$ip" ] || ip=$(hostname --ip-address 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9.]+$' | grep -v '^127\.' | head -n1)
  [ -n "$ip" ] || ip=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9.]+$' | head -n1)
  [ -n "$ip" ] || fail "no IPv4 address found on $node; set USERRL_NET_IF to the interface the nodes share"
  echo "$ip"
}

# The interface that holds IPv4 address $1 (`ip -o -4 addr show`: "2: eno1    inet 10.0.0.5/24 brd ..."), or nothing.
interface_of() {
  command -v ip >/dev/null || return 0
  ip -o -4 addr show 2>/dev/null | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'
}

# Export the bootstrap interfaces for address $1 (see the top of this file); says so when no interface holds it.
export_interfaces() {
  local ifname
  if [ -n "${USERRL_NET_IF:-}" ]; then
    export GLOO_SOCKET_IFNAME=$USERRL_NET_IF NCCL_SOCKET_IFNAME=$USERRL_NET_IF TP_SOCKET_IFNAME=$USERRL_NET_IF
    return 0
  fi
  ifname=$(interface_of "$1")
  if [ -z "$ifname" ]; then
    echo "ray_node[$node]: no interface here holds $1 (ip -o -4 addr show): GLOO_SOCKET_IFNAME," \
      "NCCL_SOCKET_IFNAME and TP_SOCKET_IFNAME left as they are; set USERRL_NET_IF if gloo or NCCL hang" >&2
    return 0
  fi
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-=$ifname}
  export TP_SOCKET_IFNAME=${TP_SOCKET_IFNAME:-$ifname}
}

if [ "$role" = ip ]; then
  node_ip
  exit 0
fi

: "${USERRL_RAY_TMP:?set by slurm/ray_cluster.sh}" "${USERRL_RAY_PORT:?set by slurm/ray_cluster.sh}"
case "$USERRL_RAY_TMP" in */userrl-ray-*) ;; *) fail "USERRL_RAY_TMP=$USERRL_RAY_TMP is not a job's directory" ;; esac
ip=$(node_ip) || exit 1
export_interfaces "$ip"
args=(--block --disable-usage-stats --temp-dir="$USERRL_RAY_TMP" --node-ip-address="$ip"
  --num-cpus="$USERRL_RAY_CPUS" --dashboard-agent-listen-port=$((USERRL_RAY_PORT + 2)))
# Without a GPU count Ray counts the GPUs Slurm made visible to this step (CUDA_VISIBLE_DEVICES).
[ -z "${USERRL_GPUS_PER_NODE:-}" ] || args+=(--num-gpus="$USERRL_GPUS_PER_NODE")
case "$role" in
  head) args+=(--head --port="$USERRL_RAY_PORT" --ray-client-server-port=$((USERRL_RAY_PORT + 1))
    --include-dashboard=false) ;;
  worker) args+=(--address="$RAY_HEAD_IP:$USERRL_RAY_PORT") ;;
  *) fail "unknown role '$role' (head, worker or ip)" ;;
esac

ray_pid=""
stop() {
  trap - TERM INT EXIT
  local deadline=$((SECONDS + ${USERRL_RAY_STOP_WAIT:-20}))
  if [ -n "$ray_pid" ] && kill -0 "$ray_pid" 2>/dev/null; then
    echo "ray_node[$node]: stopping Ray"
    kill -TERM "$ray_pid" 2>/dev/null  # `ray start --block` stops raylet, GCS and workers on SIGTERM
    # Bounded: Slurm sends SIGKILL KillWait (often 30 s) after SIGTERM, and the files must go before that.
    while kill -0 "$ray_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  fi
  rm -rf "$USERRL_RAY_TMP"
  if [ -n "$ray_pid" ] && kill -0 "$ray_pid" 2>/dev/null; then
    echo "ray_node[$node]: Ray still stopping after ${USERRL_RAY_STOP_WAIT:-20} s (Slurm kills the rest);" \
      "$USERRL_RAY_TMP removed"
  else
    echo "ray_node[$node]: Ray stopped, $USERRL_RAY_TMP removed"
  fi
}
trap stop EXIT
trap 'exit 0' TERM INT  # asked to stop: a clean end of this step

echo "ray_node[$node]: $role at $ip, $USERRL_RAY_CPUS CPUs, GPUs: ${USERRL_GPUS_PER_NODE:-auto (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-none})}"
echo "ray_node[$node]: GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}" \
  "TP_SOCKET_IFNAME=${TP_SOCKET_IFNAME:-}"
rm -rf "$USERRL_RAY_TMP"
# Ray drains a node for 30 s on SIGTERM by default; a job's nodes go down together, nothing to drain to.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
ray start "${args[@]}" &
ray_pid=$!
wait "$ray_pid"
status=$?
ray_pid=""
echo "ray_node[$node]: ray start exited with status $status" >&2
exit "$status"
