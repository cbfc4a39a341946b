#!/usr/bin/env bash
# Entrypoint of the training image: maps AWS Batch (multi-node) variables to torchrun and execs
# the pipeline step. Usage (the job definition's command):
#     entrypoint.sh <step> --run-dir /fsx/runs/<run_id> [flags...]
#
# Exports, on every node (CONTRACTS.md):
#   TORCHRUN_ARGS="--nnodes N --node_rank I --nproc_per_node P --master_addr A --master_port 29500"
#   NEURON_RT_ROOT_COMM_ID=A:<NEURON_RT_ROOT_COMM_PORT, default 46820>
# with N = AWS_BATCH_JOB_NUM_NODES, I = AWS_BATCH_JOB_NODE_INDEX, P = NPROC_PER_NODE (set by the
# job definition from the instance table), A = AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS on child
# nodes. Batch does NOT set that variable on the main node itself, so there A is the node's own
# eth0 address. Without AWS_BATCH_JOB_NUM_NODES (a single-node job) the step runs as one node on
# 127.0.0.1. `sanity` and `train` run under torchrun; every other step as plain python (`compile`
# starts neuron_parallel_compile + torchrun itself from TORCHRUN_ARGS).
#
# Batch parameters cannot be optional: a flag whose value is the empty string is dropped, and an
# argument still containing "Ref::" (a parameter nobody supplied) is refused with exit 78.
# No sysctl: the container is unprivileged.
set -euo pipefail

readonly EX_CONFIG=78  # pipeline_steps.errors BadConfigError
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

export TORCHRUN_ARGS="--nnodes ${nnodes} --node_rank ${node_rank} --nproc_per_node ${nproc} --master_addr ${master_addr} --master_port ${MASTER_PORT}"
export NEURON_RT_ROOT_COMM_ID="${master_addr}:${NEURON_RT_ROOT_COMM_PORT:-46820}"
if [ -z "${PIPELINE_RUN_ID:-}" ] && [ -n "$run_dir" ]; then
  PIPELINE_RUN_ID="$(basename "$run_dir")"
  export PIPELINE_RUN_ID
fi

echo "entrypoint: step=${step} node ${node_rank}/${nnodes} master=${master_addr} nproc=${nproc}" >&2

case "$step" in
  sanity | train)
    read -r -a torchrun_args <<<"$TORCHRUN_ARGS"
    exec torchrun "${torchrun_args[@]}" -m pipeline_steps "$step" "${args[@]}"
    ;;
  *)
    exec python -m pipeline_steps "$step" "${args[@]}"
    ;;
esac
