#!/usr/bin/env bash
# Run the whole test suite (sets up the environment first). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
