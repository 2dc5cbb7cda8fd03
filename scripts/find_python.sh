# Sourced by run_train.sh and scripts/install.sh: sets `python` to the interpreter to use, $PYTHON if
# set, else an active virtual environment's, else `python` or, on a plain PATH without it,
# `python3`; exits 2 naming the calling program ($1) when there is none.
if [[ -n "${PYTHON:-}" ]]; then
  python="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "${VIRTUAL_ENV}/bin/python" ]]; then
  python="${VIRTUAL_ENV}/bin/python"
elif command -v python >/dev/null 2>&1; then
  python=python
elif command -v python3 >/dev/null 2>&1; then
  python=python3
else
  echo "$1: no Python found (neither python nor python3 on PATH); set PYTHON=/path/to/python." >&2
  exit 2
fi
