#!/usr/bin/env bash
# Launch meshtrain on this node with torchrun:  ./run_train.sh [--config FILE] [--section.key VALUE ...]
#
#   NGPU=8         processes on this node (default: the GPUs present, or 4 on a CPU-only machine)
#   LOG_RANK=0     local ranks whose output is shown (comma-separated)
#   MAX_RESTARTS=0 torchrun restarts the job this often after a failure; with --checkpoint.enable
#                  each restart resumes from the newest complete checkpoint
#   Multi-node: set NNODES, NODE_RANK is not needed (c10d rendezvous), and RDZV_ENDPOINT=host:port of
#   one node plus a shared RDZV_ID on every node; see README.md ("Multi-node").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"

for arg in "$@"; do
  if [[ "$arg" == "--help" || "$arg" == "-h" ]]; then
    exec python -m trainer.train --help
  fi
done

if [[ -z "${NGPU:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L | grep -c '^GPU')
  else
    NGPU=4
  fi
fi
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
RDZV_ID=${RDZV_ID:-meshtrain}

# `python -m torch.distributed.run` is torchrun from the python on PATH, so the trainer runs
# with the same interpreter and packages.
exec python -m torch.distributed.run \
  --nnodes="${NNODES}" \
  --nproc_per_node="${NGPU}" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="${RDZV_ENDPOINT}" \
  --rdzv_id="${RDZV_ID}" \
  --max-restarts="${MAX_RESTARTS}" \
  --local-ranks-filter="${LOG_RANK}" \
  --role=rank \
  --tee=3 \
  -m trainer.train "$@"
