#!/usr/bin/env bash
# A real single-node Slurm on this machine, from Debian's packages, for the Slurm end-to-end test (CI) and for
# trying slurm/*.sbatch by hand. Needs root and apt-get.
#
#   tools/slurm_local.sh          install (once), write slurm.conf, start munged/slurmctld/slurmd, wait until idle
#   tools/slurm_local.sh status   exit 0 when the node is up and accepting jobs, 1 otherwise
#   tools/slurm_local.sh stop     stop the three daemons this script started
#
# Starting is idempotent: on a Slurm that is already up with the configuration this script writes, it changes
# nothing; a configuration it wrote earlier that differs is rewritten and slurmctld and slurmd restarted. The
# daemons run without systemd, with no accounting and no GPUs (no gres).
#
# Tasks are bound to cores, as on a GPU cluster: task/affinity with TaskPluginParam=Cores, so a step gets the
# CPUs it asks for (one per task unless `--cpus-per-task` or SRUN_CPUS_PER_TASK says more). Memory is a
# consumable resource (CR_Core_Memory): `--mem` is allocated and SLURM_MEM_PER_NODE set. Where the cgroup v1
# memory, cpuset and freezer hierarchies are mounted and writable, Slurm's cgroups enforce both (task/cgroup,
# proctrack/cgroup; cgroup.conf: ConstrainCores, ConstrainRAMSpace). Elsewhere processes are tracked by parent
# process id (proctrack/linuxproc) and `--mem` is booked but not enforced. A slurm.conf or cgroup.conf this
# script did not write is never overwritten.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
CGROUP_CONF=/etc/slurm/cgroup.conf
CGROUP_ROOT=/sys/fs/cgroup
MARK="# written by userrl_megatron tools/slurm_local.sh"
NODE=$(hostname -s)
LOGS=/var/log/slurm
WAIT_S=${SLURM_LOCAL_WAIT_S:-120}

say() { echo "slurm_local: $*"; }
die() {
  echo "slurm_local: error: $*" >&2
  exit 1
}

node_state() { timeout 10 sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n1 || true; }

is_up() {
  case "$(node_state)" in
    idle | mixed | allocated | completing) return 0 ;;
    *) return 1 ;;
  esac
}

install_packages() {
  local missing=()
  for pkg in slurmctld slurmd slurm-client munge; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "no apt-get on this machine: install ${missing[*]} by hand"
  say "installing ${missing[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

# Whether Slurm's cgroup/v1 plugin can constrain jobs here: the memory, cpuset and freezer hierarchies mounted at
# /sys/fs/cgroup/<controller> and writable (Slurm creates its tree below their roots). cgroup v2 is not tried:
# without systemd, Slurm 22.05's cgroup/v2 needs IgnoreSystemd, which cgroup.conf(5) reserves for development.
cgroup_v1_usable() {
  local controller probe
  for controller in memory cpuset freezer; do
    [ -f "$CGROUP_ROOT/$controller/cgroup.procs" ] || return 1
    probe="$CGROUP_ROOT/$controller/userrl-slurm-local-probe.$$"
    mkdir "$probe" 2>/dev/null || return 1
    rmdir "$probe"
  done
}

# How limits are applied on this machine: "cgroup" (binding and memory by cgroups) or "affinity" (binding only).
enforcement() { if cgroup_v1_usable; then echo cgroup; else echo affinity; fi; }

render_conf() {  # enforcement
  # `slurmd -C` prints this machine's NodeName line (CPUs, sockets, cores, memory) exactly as slurmd will see
  # it, so the node never drains for a resource mismatch.
  local hw proctrack=proctrack/linuxproc tasks=task/affinity
  hw=$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$NODE/")
  if [ "$1" = cgroup ]; then
    proctrack=proctrack/cgroup
    tasks=task/affinity,task/cgroup
  fi
  cat <<EOF
$MARK
ClusterName=userrl-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=$proctrack
TaskPlugin=$tasks
TaskPluginParam=Cores
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
KillWait=30
$hw NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

render_cgroup_conf() {
  cat <<EOF
$MARK
CgroupPlugin=cgroup/v1
ConstrainCores=yes
ConstrainRAMSpace=yes
EOF
}

ours() { [ ! -e "$1" ] || grep -qF "$MARK" "$1"; }  # absent, or written by this script

# Whether the files on disk are what this script would write on this machine now.
conf_current() {
  local mode
  mode=$(enforcement)
  [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$(render_conf "$mode")" ] || return 1
  if [ "$mode" = cgroup ]; then
    [ -f "$CGROUP_CONF" ] && [ "$(cat "$CGROUP_CONF")" = "$(render_cgroup_conf)" ]
  else
    [ ! -e "$CGROUP_CONF" ] || ! grep -qF "$MARK" "$CGROUP_CONF"
  fi
}

check_ours() {  # before anything is stopped or written
  ours "$CONF" || die "$CONF exists and was not written by this script; not touching it"
  [ "$(enforcement)" != cgroup ] || ours "$CGROUP_CONF" ||
    die "$CGROUP_CONF exists and was not written by this script; not touching it"
}

write_conf() {
  check_ours
  local mode
  mode=$(enforcement)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGS"
  render_conf "$mode" >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  if [ "$mode" = cgroup ]; then
    render_cgroup_conf >"$CGROUP_CONF.tmp"
    mv "$CGROUP_CONF.tmp" "$CGROUP_CONF"
    say "tasks bound to cores, memory limited: task/affinity,task/cgroup on cgroup v1 (ConstrainRAMSpace)"
  else
    if [ -e "$CGROUP_CONF" ] && grep -qF "$MARK" "$CGROUP_CONF"; then rm -f "$CGROUP_CONF"; fi
    say "tasks bound to cores (task/affinity); memory booked, not enforced: no writable cgroup v1" \
      "memory/cpuset/freezer hierarchies under $CGROUP_ROOT"
  fi
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  if ! running /run/munge/munged.pid; then
    [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall munge)"
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
  fi
  if ! running /run/slurmctld.pid; then
    say "starting slurmctld"
    /usr/sbin/slurmctld
  fi
  if ! running /run/slurmd.pid; then
    say "starting slurmd"
    /usr/sbin/slurmd
  fi
}

wait_up() {
  local deadline=$((SECONDS + WAIT_S)) state
  until is_up; do
    state=$(node_state)
    # A node left down/drained by an earlier crash comes back once the daemons answer again.
    case "$state" in down* | drain* | fail*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;; esac
    if ((SECONDS > deadline)); then
      echo "slurm_local: error: node $NODE is '${state:-unknown}' after ${WAIT_S} s; daemon logs:" >&2
      tail -n 20 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" /var/log/munge/munged.log >&2 2>/dev/null || true
      exit 1
    fi
    sleep 1
  done
}

stop_daemons() {  # pidfiles... : each daemon is signalled, then waited for (30 s at most)
  local pidfile deadline
  for pidfile in "$@"; do
    if running "$pidfile"; then
      say "stopping $(basename "$pidfile" .pid)"
      kill "$(cat "$pidfile")"
      deadline=$((SECONDS + 30))
      while running "$pidfile" && ((SECONDS < deadline)); do sleep 0.2; done
    fi
  done
}

case "${1:-start}" in
  start)
    if command -v sinfo >/dev/null && is_up; then
      if ! grep -qsF "$MARK" "$CONF" || conf_current; then
        say "already up: node $NODE is $(node_state)"
        exit 0
      fi
      [ "$(id -u)" = 0 ] || die "needs root: $CONF, written by an earlier version of this script, is outdated"
      check_ours
      say "$CONF was written by an earlier version of this script: rewriting it, restarting slurmctld and slurmd"
      stop_daemons /run/slurmd.pid /run/slurmctld.pid
    fi
    [ "$(id -u)" = 0 ] || die "needs root (apt-get, daemons)"
    install_packages
    write_conf
    start_daemons
    wait_up
    say "up: node $NODE is $(node_state)"
    sinfo
    ;;
  status) command -v sinfo >/dev/null && is_up ;;
  stop) stop_daemons /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid ;;
  *) die "usage: $0 [start|status|stop]" ;;
esac
