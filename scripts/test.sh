#!/usr/bin/env bash
# Run the whole test suite (sets up the environment first). Extra arguments go to pytest.
# In two parts: first every test but those marked `alone`, in two pytest-xdist workers
# (MPIDDP_TEST_WORKERS): most multi-rank tests wait on timeouts, sleeps and links rather than
# compute, so two share even two cores well, and the tests that change the machine all run in
# one of them, in turn (tests/conftest.py). Then the `alone` ones (they assert on timings or on
# choices made from measured links), one at a time. MPIDDP_TEST_WORKERS=0: one pytest, serial.
# Ends with the skipped tests' reasons, each part's counts and one line for the whole run,
# "total: N passed, N failed, N skipped" (errors count as failures); the status is pytest's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
WORKERS="${MPIDDP_TEST_WORKERS:-2}"
# Each part's counts and skip reasons (tests/conftest.py writes them), summed at the end.
COUNTS="$(mktemp -d)"
trap 'rm -rf "$COUNTS"' EXIT
# summarize PART:STATUS...: the skips by reason, each part's counts, then the last line,
# "total: N passed, N failed, N skipped" (a part that failed with no test failed counts as 1:
# a usage or collection error, an interruption).
summarize() {
  python - "$COUNTS" "$@" <<'EOF'
import json, os, sys
from collections import Counter
directory, parts = sys.argv[1], [arg.rsplit(":", 1) for arg in sys.argv[2:]]
totals, reasons, shown = Counter(), Counter(), []
for name, status in parts:
    path = os.path.join(directory, name.split()[0] + ".json")
    counts = json.load(open(path)) if os.path.exists(path) else \
        {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": {}}
    note = ""
    if status not in ("0", "5") and not counts["failed"]:
        counts["failed"], note = 1, f" (pytest exited with status {status})"
    shown.append(f"{name}: {counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['skipped']} skipped{note}")
    reasons.update(counts["skip_reasons"])
    totals.update({key: counts[key] for key in ("passed", "failed", "skipped")})
if reasons:
    print("[test.sh] skipped, by reason:")
    for reason, n in reasons.most_common():
        print(f"  {n:4d} x {reason}")
print("[test.sh] " + "; ".join(shown))
print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
EOF
}
if [ "$WORKERS" = 0 ]; then
  status=0
  MPIDDP_TEST_COUNTS="$COUNTS/all.json" python -m pytest -q "$@" || status=$?
  summarize "all:$status"
  exit "$status"
fi
# pytest exits 5 when a part selects no test (arguments that pick tests of one part only).
shared=0; alone=0
# (--durations: the slowest tests, to keep the suite within its time as it grows)
MPIDDP_TEST_COUNTS="$COUNTS/shared.json" MPIDDP_TESTS_ALONE=skip \
  python -m pytest -q -n "$WORKERS" --durations=15 "$@" || shared=$?
echo "[test.sh] the tests that run alone:"
MPIDDP_TEST_COUNTS="$COUNTS/alone.json" MPIDDP_TESTS_ALONE=only python -m pytest -q "$@" || alone=$?
summarize "shared part:$shared" "alone:$alone"
for rc in "$shared" "$alone"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
[ "$shared" = 5 ] && [ "$alone" = 5 ] && exit 5
exit 0
