#!/usr/bin/env bash
# Launch meshtrain on this node:  ./run_train.sh [--config FILE] [--mesh ...] [--section.key VALUE ...]
#
#   NGPU=8         processes on this node (default: the GPUs present, or 4 on a CPU-only machine)
#   LOG_RANK=0     local ranks whose output is shown (comma-separated)
#   MAX_RESTARTS=0 torchrun restarts the job this often after a failure; with --checkpoint.enable
#                  each restart resumes from the newest complete checkpoint
#   CONFIG_FILE    the config file, as with --config
#   Multi-node: set NNODES, plus RDZV_ENDPOINT=host:port of one node and a shared RDZV_ID on every
#   node (c10d rendezvous, no NODE_RANK); see README.md ("Multi-node").
#
# The config, the mesh and the data are checked once before any worker starts; SIGTERM and Ctrl-C
# stop the job after the current step with a checkpoint (trainer/entry/launch.py).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"

# torchrun and the workers run with this interpreter and its packages.
source "${here}/scripts/find_python.sh" run_train.sh
exec "$python" -m trainer.entry.launch "$@"
