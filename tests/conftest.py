"""Test switches shared by every test module.

System tests (marker ``system``) change the machine as root: tests/test_slurm.py installs
and starts a one-node Slurm, tests/test_multinode.py builds network namespaces, veth links and
a bridge. They run only with MPIDDP_SYSTEM_TESTS=1
(as .ci/run sets it) and are skipped with the reason otherwise.
"""
import glob
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

SYSTEM_TESTS = os.environ.get("MPIDDP_SYSTEM_TESTS") == "1"
# What each module's system tests do to the machine (the skip reason says it).
CHANGES = {"test_slurm": "installs and starts Slurm on this machine as root",
           "test_multinode": "builds network namespaces, veth links and a bridge, and runs "
                             "Slurm across them, as root",
           "test_elastic_system": "builds network namespaces, veth links and a bridge, kills "
                                  "a node's ranks and sets its link down, as root"}


# scripts/test.sh runs the suite in two parts: "skip", every test but those marked ``alone``
# (in pytest-xdist workers, side by side), then "only", those alone. Unset: every test.
ALONE = os.environ.get("MPIDDP_TESTS_ALONE", "")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "system: changes the machine as root (packages, daemons, network namespaces); "
                   "runs only with MPIDDP_SYSTEM_TESTS=1")
    config.addinivalue_line(
        "markers", "alone: asserts on timings or on choices made from measured links, which "
                   "other tests running beside it would change: scripts/test.sh runs these "
                   "after the others, one at a time")


def pytest_collection_modifyitems(config, items):
    if ALONE in ("skip", "only"):
        parts = {True: [], False: []}          # kept, left to the other part
        for item in items:
            parts[("alone" in item.keywords) == (ALONE == "only")].append(item)
        config.hook.pytest_deselected(items=parts[False])
        items[:] = parts[True]
    if SYSTEM_TESTS:
        # First, so that under pytest-xdist their worker starts on them at once (below).
        items.sort(key=lambda item: "system" not in item.keywords)
        return
    for item in items:
        if "system" in item.keywords:
            what = CHANGES.get(item.module.__name__, "changes this machine as root")
            item.add_marker(pytest.mark.skip(
                reason=f"system test: {what}; set MPIDDP_SYSTEM_TESTS=1 to run it"))


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:                     # pytest-xdist is optional: the tests run serially
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class OneWorkerChangesTheMachine(LoadScopeScheduling):
        """Each module to one worker (its module-scoped launches made once), and every
        system module to the same worker, one after another: they share the cluster's
        namespaces and Slurm's ports and state. (pytest-xdist's own ``loadgroup`` does not
        group under pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)"""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "system" if Path(module).stem in CHANGES else module

    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False      # collection order: system modules first
        return OneWorkerChangesTheMachine(config, log)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With MPIDDP_TEST_COUNTS=FILE (scripts/test.sh), write this run's counts and its skips
    by reason to FILE as JSON: errors count as failures, xfails as skips, xpasses as passes."""
    path = os.environ.get("MPIDDP_TEST_COUNTS")
    if not path or hasattr(config, "workerinput"):      # a pytest-xdist worker: the
        return                                          # controller has every report
    stats = terminalreporter.stats

    def count(*keys) -> int:
        return sum(len(stats.get(key, [])) for key in keys)

    reasons = Counter()
    for report in stats.get("skipped", []) + stats.get("xfailed", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else \
            getattr(report, "wasxfail", "") or str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ") or "(no reason given)"] += 1
    with open(path, "w") as f:
        json.dump({"passed": count("passed", "xpassed"), "failed": count("failed", "error"),
                   "skipped": count("skipped", "xfailed"), "exit_status": int(exitstatus),
                   "skip_reasons": dict(reasons)}, f)


def pytest_addoption(parser):
    parser.addoption("--soak-cycles", type=int, default=10_000,
                     help="engine cycles of tests/test_protocol.py's seeded soak (default 10000)")


@pytest.fixture
def soak_cycles(request) -> int:
    return request.config.getoption("--soak-cycles")


@pytest.fixture(scope="module")
def cluster(request):
    """Emulated nodes on 1 Gbit/s links (scripts/cluster/local_cluster.sh) for a system-test module,
    three or the module's ``CLUSTER_NODES``, torn down after it; skipped with the reason
    where they cannot be built."""
    nodes = getattr(request.module, "CLUSTER_NODES", 3)
    script = str(Path(__file__).parent.parent / "scripts" / "cluster" / "local_cluster.sh")
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/cluster/local_cluster.sh builds network namespaces")
    subprocess.run(["bash", script, "down"], capture_output=True, timeout=60)
    up = subprocess.run(["bash", script, "up", str(nodes), "1gbit"], capture_output=True, text=True,
                        timeout=60)
    if up.returncode != 0:
        pytest.skip("scripts/cluster/local_cluster.sh could not build the cluster:\n" + up.stderr)
    try:
        yield
    finally:
        subprocess.run(["bash", script, "down"], capture_output=True, timeout=60)


def _mapped_shm() -> set[str]:
    """/dev/shm files some live process has mapped or open."""
    held = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                held.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:                      # the process ended meanwhile
            pass
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            held.add(target)
    return held


# Shared-memory segments a rank SIGKILLed leaves in /dev/shm: MPICH's (its node's segment,
# mpich_shm_*), and Intel MPI's (one of 16 MiB, sparse, per rank, named after its pid:
# "<pid>:0:0"; scripts/dev/test_intelmpi.sh).
LEAKED_SEGMENTS = ("/dev/shm/mpich_*", "/dev/shm/[0-9]*:[0-9]*:[0-9]*")


def _segments() -> set[str]:
    return {path for pattern in LEAKED_SEGMENTS for path in glob.glob(pattern)}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_mpi_segments():
    """Remove the MPI shared-memory segments that ranks the tests killed on purpose left in
    /dev/shm (a rank SIGKILLed never unlinks them): only those that appeared during this run
    and that no live process holds, so the machine is left as it was."""
    before = _segments()
    yield
    leaked = _segments() - before
    if leaked:
        for path in leaked - _mapped_shm():
            try:
                os.unlink(path)
            except OSError:
                pass
