#!/usr/bin/env bash
# Create (or reuse) the virtual environment with everything mpiddp needs, then put it first on
# PATH. Sourced by the other scripts; safe to run again: it reinstalls only when
# requirements-dev.txt or setup.cfg changed. MPIDDP_VENV picks another location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MPIDDP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.mpiddp-stamp"
want="$(cat "$ROOT/requirements-dev.txt" "$ROOT/setup.cfg" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[ensure_env] installing into $VENV" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
