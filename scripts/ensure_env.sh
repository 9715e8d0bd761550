#!/usr/bin/env bash
# Create (or reuse) the virtual environment with everything mpiddp needs, then put it first on
# PATH. Run it, or source it (`source scripts/ensure_env.sh`) to keep the PATH in your shell:
# sourcing leaves your shell's options as they were and never closes it (a failure returns its
# status). Safe to run again: it reinstalls only when requirements-dev.txt or setup.cfg
# changed. MPIDDP_VENV picks another location.
# MPIDDP_NO_INSTALL=1 uses the environment at MPIDDP_VENV as it is and never installs (a
# machine with no package index, e.g. a cluster's compute node or a GPU machine prepared with
# scripts/gpu_check.sh's wheels): it only checks that the environment has what mpiddp needs.

# The work runs in a subshell, so that its strict options stay there.
_mpiddp_ensure_env() (
  set -euo pipefail
  ROOT="$1"
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
)

_mpiddp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Not in an `if` or `||`: bash ignores `set -e` in a subshell called there. A caller with
# `set -e` (scripts/test.sh) stops here on a failure; any other caller reads the status.
_mpiddp_ensure_env "$_mpiddp_root"
_mpiddp_status=$?
if [ "$_mpiddp_status" = 0 ]; then
  export PATH="${MPIDDP_VENV:-$_mpiddp_root/.venv}/bin:$PATH"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
unset -f _mpiddp_ensure_env
unset _mpiddp_root
# `return` when sourced, `exit` when run.
return "$_mpiddp_status" 2>/dev/null || exit "$_mpiddp_status"
