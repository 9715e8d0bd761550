#!/usr/bin/env bash
# The tests where MPI families differ (scripts/dev/mpi_family_tests.sh), under Intel MPI (the PyPI
# `impi-rt` wheel, 2021.14) instead of the bundled MPICH, and Intel MPI's own: GPU switches
# that would crash MPI_Init refused with the reason, and (with MPIDDP_SYSTEM_TESTS=1, as root)
# srun on the local Slurm through Slurm's PMI-2 library. Extra arguments go to pytest.
#
# The Intel MPI environment is a small virtual environment of its own (.venv-impi, or
# MPIDDP_INTELMPI_VENV) holding only `impi-rt` and mpi4py; everything else comes from the
# main one (scripts/ensure_env.sh) through a .pth file. impi-rt 2021.19 needs a libfabric the
# package index does not serve: 2021.14 is the newest that installs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
source "$ROOT/scripts/dev/mpi_family_tests.sh"
IVENV="${MPIDDP_INTELMPI_VENV:-$ROOT/.venv-impi}"
family_venv "$IVENV" "impi-rt==2021.14.0"
# Intel MPI pins each rank to a core of its own choosing; the tests run more ranks than this
# machine has cores, two jobs at a time, and pinned ranks then queue for the same core (a
# 3-rank loop took 1.1-6.3 s pinned, 0.8-0.9 s unpinned, on 2 cores).
export I_MPI_PIN=0
family_tests "$IVENV" "Intel(R) MPI" \
  tests/test_cuda_aware.py::test_intel_mpi_with_offload_and_no_cuda_driver_stops_with_the_reason \
  tests/test_slurm.py::test_srun_starts_intel_mpi_ranks_through_slurms_pmi2 "$@"
