#!/usr/bin/env bash
# Create (or reuse) the virtual environment with everything mpiddp needs, then put it first on
# PATH. Sourced by the other scripts; safe to run again: it reinstalls only when
# requirements-dev.txt or setup.cfg changed. MPIDDP_VENV picks another location.
# MPIDDP_NO_INSTALL=1 uses the environment at MPIDDP_VENV as it is and never installs (a
# machine with no package index, e.g. a cluster's compute node or a GPU machine prepared with
# scripts/gpu_check.sh's wheels): it only checks that the environment has what mpiddp needs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MPIDDP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.mpiddp-stamp"
want="$(cat "$ROOT/requirements-dev.txt" "$ROOT/setup.cfg" | sha256sum | cut -c1-16)"
if [ "${MPIDDP_NO_INSTALL:-0}" = 1 ]; then
  [ -x "$VENV/bin/python" ] ||
    { echo "[ensure_env] MPIDDP_NO_INSTALL=1: no environment at $VENV (MPIDDP_VENV)" >&2; exit 1; }
  missing="$("$VENV/bin/python" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "mpi4py", "numpy") if u.find_spec(m) is None))')"
  [ -z "$missing" ] || { echo "[ensure_env] MPIDDP_NO_INSTALL=1: $VENV lacks $missing" >&2; exit 1; }
elif [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[ensure_env] installing into $VENV" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
