#!/usr/bin/env bash
# Run the whole test suite (sets up the environment first). Extra arguments go to pytest.
# Two pytest-xdist workers (MPIDDP_TEST_WORKERS; 0: one process): most multi-rank tests wait on
# timeouts, sleeps and links rather than compute, so two share even two cores well. The tests
# that change the machine all run in one of them, in turn (tests/conftest.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
exec python -m pytest -q -n "${MPIDDP_TEST_WORKERS:-2}" "$@"
