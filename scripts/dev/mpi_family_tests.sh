# Sourced by scripts/dev/test_openmpi.sh and scripts/dev/test_intelmpi.sh (after
# scripts/ensure_env.sh): what both do to run, under another MPI library than the bundled
# MPICH, the tests where MPI families differ.
#
#   family_venv DIR SPEC...    a small virtual environment at DIR holding only SPEC... and the
#                              main environment's mpi4py version, installed only when
#                              DIR/bin/mpiexec is missing; everything else (torch, numpy,
#                              pytest) comes from the main environment through a .pth file
#   family_tests DIR NAME ARG...   check that DIR's mpi4py uses the library called NAME, then
#                              run FAMILY_TESTS and ARG... (more tests, pytest options) with
#                              DIR's python, in MPIDDP_TEST_WORKERS (default 2) workers
#
# The tests: the elastic launcher (mpiexec's options and its reports of a killed rank), the
# node-local ranks a launcher gives (the GPU chosen at import), the fake-GPU engine, the
# watchdog's roll call, a collective on reordered local ranks.
FAMILY_TESTS=(
  tests/test_elastic.py
  tests/test_gpu_streams.py::test_three_ranks_on_fake_gpus_touch_only_their_own
  tests/test_collectives.py::test_local_ranks_follow_the_launchers_numbering
  "tests/test_collectives.py::test_every_collective_matches_reference[4ranks-ring]"
  tests/test_errors.py::test_roll_calls_among_healthy_ranks_find_no_rank_missing
  tests/test_errors.py::test_a_frozen_rank_ends_the_job_naming_it
)

family_venv() {  # family_venv DIR SPEC...
  local venv="$1" site main_site tag
  shift
  tag="[$(basename "$0" .sh)]"
  if [ ! -x "$venv/bin/mpiexec" ]; then
    echo "$tag installing $* into $venv" >&2
    python -m venv --without-pip "$venv"
    python -m pip install -q --disable-pip-version-check --prefix "$venv" --ignore-installed \
      "$@" "mpi4py==$(python -c 'import mpi4py; print(mpi4py.__version__)')"
  fi
  main_site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$main_site" > "$site/zz-mpiddp-main-venv.pth"     # after the venv's own mpi4py
}

family_tests() {  # family_tests DIR NAME [ARG...]
  local venv="$1" name="$2"
  shift 2
  cd "$ROOT"
  "$venv/bin/python" -c 'import sys; from mpi4py import MPI; v = MPI.Get_library_version()
assert sys.argv[1] in v, v; print(sys.argv[2], v.splitlines()[0])' "$name" "[$(basename "$0" .sh)]"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${MPIDDP_TEST_WORKERS:-2}" \
    "${FAMILY_TESTS[@]}" "$@"
}
