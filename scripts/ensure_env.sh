#!/usr/bin/env bash
# Create (or reuse) the virtual environment with everything mpiddp needs, then put it first on
# PATH. Run it, or source it (`source scripts/ensure_env.sh`) to keep the PATH in your shell:
# sourcing leaves your shell's options as they were and never closes it (a failure returns its
# status). Safe to run again: it reinstalls only when requirements-dev.txt or setup.cfg
# changed, and reinstalls mpiddp itself (an editable install, `pip install --no-deps -e`) when
# the environment's mpiddp is not this checkout's: a checkout copied with its .venv, whose
# editable install still points at the old tree. MPIDDP_VENV picks another location.
# MPIDDP_NO_INSTALL=1 uses the environment at MPIDDP_VENV as it is and never installs (a
# machine with no package index, e.g. a cluster's compute node or a GPU machine prepared with
# scripts/gpu/gpu_check.sh's wheels): it only checks that the environment has what mpiddp needs,
# and warns when its mpiddp is another checkout's.

# The work runs in a subshell, so that its strict options stay there.
_mpiddp_ensure_env() (
  set -euo pipefail
  ROOT="$1"
  VENV="${MPIDDP_VENV:-$ROOT/.venv}"
  PY="${PYTHON:-python3}"
  STAMP="$VENV/.mpiddp-stamp"
  want="$(cat "$ROOT/requirements-dev.txt" "$ROOT/setup.cfg" | sha256sum | cut -c1-16)"
  # The mpiddp the environment's python imports, as a real path: its own install only (-I: not
  # the current directory, nor PYTHONPATH); found without importing it (no torch to load).
  installed_mpiddp() {
    "$VENV/bin/python" -I -c 'import importlib.util as u, os
s = u.find_spec("mpiddp")
print(os.path.realpath(os.path.dirname(s.origin)) if s and s.origin else "")' 2>/dev/null || true
  }
  ours="$(cd "$ROOT/mpiddp" && pwd -P)"
  if [ "${MPIDDP_NO_INSTALL:-0}" = 1 ]; then
    [ -x "$VENV/bin/python" ] ||
      { echo "[ensure_env] MPIDDP_NO_INSTALL=1: no environment at $VENV (MPIDDP_VENV)" >&2; exit 1; }
    missing="$("$VENV/bin/python" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "mpi4py", "numpy") if u.find_spec(m) is None))')"
    [ -z "$missing" ] || { echo "[ensure_env] MPIDDP_NO_INSTALL=1: $VENV lacks $missing" >&2; exit 1; }
    found="$(installed_mpiddp)"
    if [ -n "$found" ] && [ "$found" != "$ours" ]; then
      echo "[ensure_env] warning: $VENV's mpiddp is $found, not this checkout's ($ours);" \
        "put this checkout first (PYTHONPATH=$ROOT), or reinstall it:" \
        "$VENV/bin/python -m pip install --no-deps -e $ROOT" >&2
    fi
  elif [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "[ensure_env] installing into $VENV" >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
    echo "$want" > "$STAMP"
  else
    found="$(installed_mpiddp)"
    if [ "$found" != "$ours" ]; then
      echo "[ensure_env] $VENV's mpiddp is ${found:-missing}, not this checkout's ($ours)" \
        "(a copied checkout?): reinstalling it from $ROOT" >&2
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
    fi
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
