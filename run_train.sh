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
# stop the job after the current step with a checkpoint (trainer/runtime/launch.py).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"

# The interpreter: $PYTHON if set, else an active virtual environment's, else `python` or, on a
# plain PATH without it, `python3`; torchrun and the workers run with it and its packages.
if [[ -n "${PYTHON:-}" ]]; then
  python="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "${VIRTUAL_ENV}/bin/python" ]]; then
  python="${VIRTUAL_ENV}/bin/python"
elif command -v python >/dev/null 2>&1; then
  python=python
elif command -v python3 >/dev/null 2>&1; then
  python=python3
else
  echo "run_train.sh: no Python found (neither python nor python3 on PATH); set PYTHON=/path/to/python." >&2
  exit 2
fi
exec "$python" -m trainer.runtime.launch "$@"
