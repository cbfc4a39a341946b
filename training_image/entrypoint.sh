#!/usr/bin/env bash
# Entrypoint of the training image: maps AWS Batch (multi-node) variables to torchrun and runs
# the pipeline step. Usage (the job definition's command):
#     entrypoint.sh <step> --run-dir /fsx/runs/<run_id> [flags...]
#
# Exports, on every node:
#   TORCHRUN_ARGS="--nnodes N --node_rank I --nproc_per_node P --master_addr A --master_port 29500"
#                  [+ " --rdzv_conf timeout=T" when TORCHRUN_RDZV_TIMEOUT_SECONDS=T is set]
#   NEURON_RT_ROOT_COMM_ID=A:<NEURON_RT_ROOT_COMM_PORT, default 46820>
# with N = AWS_BATCH_JOB_NUM_NODES, I = AWS_BATCH_JOB_NODE_INDEX, P = NPROC_PER_NODE (set by the
# job definition from the instance table), A = AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS on child
# nodes. Batch does NOT set that variable on the main node itself, so there A is the node's own
# eth0 address. Without AWS_BATCH_JOB_NUM_NODES (a single-node job) the step runs as one node on
# 127.0.0.1. `sanity` and `train` run under torchrun (`python -m pipeline_steps.launch`: torchrun,
# with a rendezvous that never completed ending in 75); every other step as plain python
# (`compile` starts neuron_parallel_compile + the same launcher itself from TORCHRUN_ARGS).
#
# Batch parameters cannot be optional: a flag whose value is the empty string is dropped, and an
# argument still containing "Ref::" (a parameter nobody supplied) is refused with exit 78.
# No sysctl: the container is unprivileged.
#
# Exit-code contract (AWS Batch retries exit code 75 through the job definitions' evaluateOnExit):
# the container exits with the step's own exit code (pipeline_steps/contract.py ExitCode).
# - Plain python steps are exec'd: their code is the container's.
# - torchrun exits 1 whenever a worker fails, whatever the worker's code. So for `sanity` and
#   `train` this script exports PIPELINE_EXIT_CODE_FILE (a fresh node-local path), where the first
#   failing rank records its code (pipeline_steps.errors.record_exit_code; the stall watchdog
#   records 75 before it exits; the launcher records 75 for a rendezvous that never completed),
#   runs torchrun as a child and, when torchrun fails, exits with the recorded code if there is
#   one, else with torchrun's. torchrun success = 0.
# - SIGTERM/SIGINT (Batch TerminateJob, attempt timeouts; docker-init delivers them to this script)
#   are forwarded to torchrun as SIGTERM, which stops its workers; this script then waits for it and
#   exits as above.
set -euo pipefail

readonly EX_CONFIG=78  # ExitCode.BAD_CONFIG in pipeline_steps/contract.py (a test pins the copy)
readonly MASTER_PORT=29500

die() {
  echo "entrypoint: $*" >&2
  exit "$EX_CONFIG"
}

[ "$#" -ge 1 ] || die "usage: entrypoint.sh <step> [flags...]"
step="$1"
shift

# -- Arguments: drop empty optional flags, refuse unsubstituted parameters ----------------------
args=()
run_dir=""
while [ "$#" -gt 0 ]; do
  arg="$1"
  shift
  if [[ "$arg" == --* && "$#" -gt 0 && -z "$1" ]]; then
    shift
    continue
  fi
  [ -n "$arg" ] || continue
  [[ "$arg" != *Ref::* ]] || die "unsubstituted Batch parameter in '$arg': pass it in the job's parameters"
  if [ "$arg" = "--run-dir" ] && [ "$#" -gt 0 ]; then
    run_dir="$1"
  fi
  args+=("$arg")
done

# -- Topology ------------------------------------------------------------------------------------
eth0_address() {
  local address
  address="$(ip -4 -o addr show dev eth0 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')" || true
  if [ -z "$address" ]; then
    address="$(hostname -I 2>/dev/null | awk '{print $1}')" || true
  fi
  [ -n "$address" ] || die "cannot determine this node's eth0 IPv4 address"
  echo "$address"
}

nproc="${NPROC_PER_NODE:-}"
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE='${nproc}' must be a positive integer (NeuronCores per node)"

if [ -n "${AWS_BATCH_JOB_NUM_NODES:-}" ]; then
  nnodes="$AWS_BATCH_JOB_NUM_NODES"
  node_rank="${AWS_BATCH_JOB_NODE_INDEX:?AWS_BATCH_JOB_NODE_INDEX missing in a multi-node job}"
  if [ -n "${AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS:-}" ]; then
    master_addr="$AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"
  else
    master_addr="$(eth0_address)"
  fi
else
  nnodes=1
  node_rank=0
  master_addr="127.0.0.1"
fi

TORCHRUN_ARGS="--nnodes ${nnodes} --node_rank ${node_rank} --nproc_per_node ${nproc} --master_addr ${master_addr} --master_port ${MASTER_PORT}"
# Rendezvous bound: the main node starts first, and torchrun's static rendezvous waits 600 s by
# default for the others, less than a child node needs to boot and pull the image. The job
# definitions set the bound from the stage's startup budget (PipelineConfig.startup_minutes).
rdzv_timeout="${TORCHRUN_RDZV_TIMEOUT_SECONDS:-}"
if [ -n "$rdzv_timeout" ]; then
  [[ "$rdzv_timeout" =~ ^[1-9][0-9]*$ ]] || die "TORCHRUN_RDZV_TIMEOUT_SECONDS='${rdzv_timeout}' must be a positive integer (seconds)"
  TORCHRUN_ARGS="${TORCHRUN_ARGS} --rdzv_conf timeout=${rdzv_timeout}"
fi
export TORCHRUN_ARGS
export NEURON_RT_ROOT_COMM_ID="${master_addr}:${NEURON_RT_ROOT_COMM_PORT:-46820}"
# The run id (heartbeat RunId, MLflow run name): the run dir below /fsx/runs, which is the Batch
# parameter run_id (a team's run is <team>/<name>: two teams' runs of one name stay apart).
if [ -z "${PIPELINE_RUN_ID:-}" ] && [ -n "$run_dir" ]; then
  case "$run_dir" in
    /fsx/runs/?*) PIPELINE_RUN_ID="${run_dir#/fsx/runs/}" ;;
    *) PIPELINE_RUN_ID="$(basename "$run_dir")" ;;
  esac
  export PIPELINE_RUN_ID
fi

echo "entrypoint: step=${step} node ${node_rank}/${nnodes} master=${master_addr} nproc=${nproc}" >&2

# -- torchrun steps: run as a child, forward signals, exit with the recorded step code ----------
run_torchrun() {
  local code_dir status recorded
  # A fresh directory per launch: the exit-code file must not exist yet (the first rank to fail
  # creates it with O_EXCL), and node-local so ranks of other nodes never see it.
  code_dir="$(mktemp -d "${TMPDIR:-/tmp}/pipeline-exit.XXXXXX")"
  export PIPELINE_EXIT_CODE_FILE="${code_dir}/exit_code"
  rm -f "$PIPELINE_EXIT_CODE_FILE"
  read -r -a torchrun_args <<<"$TORCHRUN_ARGS"

  # Background children of a non-interactive shell ignore SIGINT, so both signals go on as TERM
  # (torchrun stops its workers on TERM).
  child=""
  trap 'if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; fi' TERM INT
  python -m pipeline_steps.launch "${torchrun_args[@]}" -m pipeline_steps "$step" "$@" &
  child=$!
  # `wait` returns early (status > 128) when a trapped signal arrives: keep waiting until the
  # child has really exited, then take its status.
  while :; do
    if wait "$child"; then status=0; else status=$?; fi
    kill -0 "$child" 2>/dev/null || break
  done
  trap - TERM INT

  if [ "$status" -ne 0 ] && [ -s "$PIPELINE_EXIT_CODE_FILE" ]; then
    recorded="$(head -n 1 "$PIPELINE_EXIT_CODE_FILE" | tr -cd '0-9')"
    if [[ "$recorded" =~ ^[0-9]{1,3}$ ]] && [ "$recorded" -ge 1 ] && [ "$recorded" -le 255 ]; then
      echo "entrypoint: torchrun exited ${status}; a worker recorded exit code ${recorded}" >&2
      status="$recorded"
    fi
  fi
  rm -rf "$code_dir"
  return "$status"
}

case "$step" in
  sanity | train)
    if run_torchrun "${args[@]}"; then exit 0; else exit $?; fi
    ;;
  *)
    exec python -m pipeline_steps "$step" "${args[@]}"
    ;;
esac
