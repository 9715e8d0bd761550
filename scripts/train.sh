#!/usr/bin/env bash
# The main job: 8-rank data-parallel training of scripts/train.py on scikit-learn's digits.
# Sets up the environment first (scripts/ensure_env.sh). Extra arguments go to train.py,
# e.g. `bash scripts/train.sh --resume` or `bash scripts/train.sh --epochs 20`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
exec mpiexec -n 8 python scripts/train.py --min-accuracy 0.95 "$@"
