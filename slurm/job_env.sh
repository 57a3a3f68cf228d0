# Sourced first by every slurm/*.sbatch script, in the submit directory (the repository root): finds and
# activates the project's Python environment, or stops the job at once naming what is missing.
#
#   USERRL_VENV=DIR        the virtual environment to use (default: .venv in the submit directory, what
#                          `make install` creates); it must be on a filesystem every node of the job can read
#   USERRL_CONTAINER=CMD   a prefix that runs commands inside a container instead, e.g.
#                          "apptainer exec --nv /images/userrl.sif"; the container's own environment is used
#                          (set USERRL_VENV as well to activate a venv that lives inside it)
#
# Everything exported here reaches every `srun` step of the job (srun passes the batch script's environment on).

say() { echo "userrl slurm: $*"; }
die() {
  echo "userrl slurm: error: $*" >&2
  exit 2
}

activate_env() {
  if [ -n "${USERRL_CONTAINER:-}" ]; then
    # Paths inside the image are not checkable from here: the first srun step fails if they are wrong.
    [ -z "${USERRL_VENV:-}" ] || export VIRTUAL_ENV=$USERRL_VENV PATH="$USERRL_VENV/bin:$PATH"
    say "environment: inside the container (${USERRL_CONTAINER})${USERRL_VENV:+, venv $USERRL_VENV}"
    return 0
  fi
  local venv=${USERRL_VENV:-$PWD/.venv} tool
  if [ ! -d "$venv" ]; then
    [ -z "${USERRL_VENV:-}" ] || die "USERRL_VENV=$venv does not exist on $(hostname -s)"
    die "no Python environment: $venv does not exist and USERRL_VENV is not set; run \`make install\` in" \
      "$PWD (on a filesystem all nodes see) or export USERRL_VENV=/path/to/venv before sbatch"
  fi
  for tool in python userrl ray; do
    [ -x "$venv/bin/$tool" ] || die "$venv/bin/$tool is missing: the environment is incomplete (run \`make install\`)"
  done
  export VIRTUAL_ENV=$venv PATH="$venv/bin:$PATH"
  unset PYTHONHOME
  say "environment: $venv ($("$venv/bin/python" --version 2>&1))"
}

# Every `srun` step gets the job's CPUs per task. Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task
# (https://slurm.schedmd.com/sbatch.html#OPT_cpus-per-task): a step asks for one CPU per task, and where tasks are
# bound to cores (TaskPluginParam=Cores, --cpu-bind=cores) the raylet, every Ray worker of the node and the driver
# share that one core. srun reads SRUN_CPUS_PER_TASK as its --cpus-per-task (srun(1), "INPUT ENVIRONMENT
# VARIABLES"); the scripts' own srun lines also pass it.
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}

# Multi-node runs need the same environment on every node: threads and output buffering set here travel with
# each srun step (Ray workers inherit them from the raylet).
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=true
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Ray workers at the priority of `ray start`, not 15 nice levels below it (fleet/placement.py, RAY_ENVIRONMENT).
export RAY_worker_niceness=${RAY_worker_niceness:-0}
activate_env
