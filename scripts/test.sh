#!/usr/bin/env bash
# Run the whole test suite (sets up the environment first). Extra arguments go to pytest.
# In two parts: first every test but those marked `alone`, in two pytest-xdist workers
# (MPIDDP_TEST_WORKERS): most multi-rank tests wait on timeouts, sleeps and links rather than
# compute, so two share even two cores well, and the tests that change the machine all run in
# one of them, in turn (tests/conftest.py). Then the `alone` ones (they assert on timings or on
# choices made from measured links), one at a time. MPIDDP_TEST_WORKERS=0: one pytest, serial.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
WORKERS="${MPIDDP_TEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then
  exec python -m pytest -q "$@"
fi
# pytest exits 5 when a part selects no test (arguments that pick tests of one part only).
shared=0; alone=0
# (--durations: the slowest tests, to keep the suite within its time as it grows)
MPIDDP_TESTS_ALONE=skip python -m pytest -q -n "$WORKERS" --durations=15 "$@" || shared=$?
echo "[test.sh] the tests that run alone:"
MPIDDP_TESTS_ALONE=only python -m pytest -q "$@" || alone=$?
for rc in "$shared" "$alone"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
[ "$shared" = 5 ] && [ "$alone" = 5 ] && exit 5
exit 0
