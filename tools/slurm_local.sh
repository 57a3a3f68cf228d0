#!/usr/bin/env bash
# A real single-node Slurm on this machine, from Debian's packages, for the Slurm end-to-end test (CI) and for
# trying slurm/*.sbatch by hand. Needs root and apt-get.
#
#   tools/slurm_local.sh          install (once), write slurm.conf, start munged/slurmctld/slurmd, wait until idle
#   tools/slurm_local.sh status   exit 0 when the node is up and accepting jobs, 1 otherwise
#   tools/slurm_local.sh stop     stop the three daemons this script started
#
# Starting is idempotent: on a Slurm that is already up it changes nothing. The daemons run without systemd:
# process tracking by parent process id (proctrack/linuxproc), no cgroups, no accounting, no GPUs (no gres).
# A slurm.conf this script did not write is never overwritten.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
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

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not touching it"
  fi
  # `slurmd -C` prints this machine's NodeName line (CPUs, sockets, cores, memory) exactly as slurmd will see
  # it, so the node never drains for a resource mismatch.
  local hw
  hw=$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$NODE/")
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGS"
  cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=userrl-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
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
  mv "$CONF.tmp" "$CONF"
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

stop_daemons() {
  for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
    if running "$pidfile"; then
      say "stopping $(basename "$pidfile" .pid)"
      kill "$(cat "$pidfile")"
    fi
  done
}

case "${1:-start}" in
  start)
    if command -v sinfo >/dev/null && is_up; then
      say "already up: node $NODE is $(node_state)"
      exit 0
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
  stop) stop_daemons ;;
  *) die "usage: $0 [start|status|stop]" ;;
esac
