#!/usr/bin/env bash
# Install meshtrain and a supported torch into the active Python environment (or that of python3).
#
#   ./scripts/install.sh            # picks the torch build for this machine, then `pip install -e ".[test]"`
#
# pip's default torch wheel on Linux is the CUDA build (about 3 GB with its NVIDIA packages), which
# a CPU-only machine does not need. So: a supported torch that is already installed is kept; on a
# machine with an NVIDIA driver (nvidia-smi answers) pip's default CUDA build is installed; on any
# other machine the CPU build comes from PyTorch's CPU wheel index (about 200 MB).
# TORCH_SPEC overrides what is installed (e.g. TORCH_SPEC=torch==2.11.0), TORCH_INDEX_URL where from.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

supported=">=2.11,<2.16"   # keep in sync with pyproject.toml's dependency and the check below (tests/test_torch_private.py)
source scripts/find_python.sh install.sh  # the working directory is the repository root

if "$python" - <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
major_minor = tuple(int(part) for part in version("torch").split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= major_minor < (2, 16) else 1)
PY
  echo "install.sh: keeping the installed torch $("$python" -c 'import torch; print(torch.__version__)')"
elif [[ -n "${TORCH_SPEC:-}" ]]; then
  "$python" -m pip install "${TORCH_SPEC}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$python" -m pip install "torch${supported}"
else
  "$python" -m pip install "torch${supported}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
"$python" -m pip install -e ".[test]"
