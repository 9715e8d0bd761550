"""Test switches shared by every test module.

System tests (marker ``system``) change the machine as root: tests/test_slurm.py installs
and starts a one-node Slurm, tests/test_multinode.py builds network namespaces, veth links and
a bridge. They run only with MPIDDP_SYSTEM_TESTS=1
(as .ci/run sets it) and are skipped with the reason otherwise.
"""
import functools
import glob
import json
import os
import re
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

# The order the workers take the tests in, so that neither is left with a long one at the
# end while the other idles: the tests that take longest first (about 15-75 s each in the
# shared part on a 2-core machine; scripts/test.sh prints the slowest), longest first, as
# node id prefixes (a module, a test, or a test's parameters; each stands for all the tests it
# names; a stale entry costs nothing); then the other tests of modules that launch processes,
# in collection order; last the tests that run in pytest's own process (a module that neither
# launches MPI jobs nor starts subprocesses), quick ones that fill the gaps at the end.
LONGEST_FIRST = [
    "tests/test_optimizer.py",
    "tests/test_forward_overlap.py",
    "tests/test_zero_checkpoint.py::test_getting_started_with_zero_stage_2",
    "tests/test_elastic.py::test_a_sharded_optimizer_resizes_without_a_conversion",
    "tests/test_training_example.py::test_resume_on_a_different_number_of_ranks",
    "tests/test_training_example.py::test_preemption_signal_checkpoints_and_resume_is_exact",
    "tests/test_collectives.py::test_every_collective_matches_reference[8ranks",
    "tests/test_data_loader.py::test_data_loader_workers",
    "tests/test_sharded_checkpoint.py::test_sharded_save_at_4_ranks_resumes_at_3",
    "tests/test_powersgd.py::test_matches_the_reference_of_the_paper_at_every_step",
    "tests/test_zero_memory_benchmark.py::test_zero_memory_benchmark_two_ranks",
    "tests/test_elastic.py::test_a_node_listed_again_by_discovery_rejoins",
    "tests/test_elastic.py::test_launcher_relaunches_when_the_watchdog_finds_a_rank_gone",
    "tests/test_training_example.py::test_train_checkpoint_and_resume",
    "tests/test_hierarchical.py::test_hierarchical_allreduce_matches_reference",
    "tests/test_elastic.py::test_resize_from_three_ranks_to_two",
    "tests/test_collectives.py::test_every_collective_matches_reference",
    "tests/test_zero.py::test_one_parameter_buckets_match_unfused_all_reduces_bitwise",
    "tests/test_powersgd.py::test_elastic_state_keeps_steps_and_q",
    "tests/test_zero3.py::test_stage_3_trains_as_the_unsharded_optimizer",
    "tests/test_zero3.py::test_stage_3_state_forms_restore_at_another_rank_count",
    "tests/test_sockets.py::test_ring_and_halving_doubling_over_sockets_match_reference",
    "tests/test_elastic.py::test_launcher_relaunches_without_the_lost_node",
    "tests/test_zero.py::test_sharded_optimizer_trains_as_the_unsharded_one",
    "tests/test_adasum.py::test_adasum_optimizer_matches_its_definition",
    "tests/test_simulated_models.py::test_benchmark_fsdp2_variant_two_ranks",
    "tests/test_examples.py::test_example_runs[sharding",
    "tests/test_examples.py::test_example_runs[sharded_checkpoint",
    "tests/test_protocol.py::test_soak_ten_thousand_cycles",
    "tests/test_simulated_models.py::test_cache_benchmark_compares",
    "tests/test_zero3.py::test_stage_3_builds_a_model_from_the_meta_device",
    "tests/test_errors.py::test_a_coordinator_that_stops_cycling",
    "tests/test_adasum.py::test_adasum_allreduce_matches_the_reference",
    "tests/test_sharded_checkpoint.py::test_a_save_killed_before_its_manifest",
    "tests/test_powersgd_convergence.py::test_convergence_study_two_ranks",
    "tests/test_adasum.py::test_hierarchical_adasum_is_adasum_of_node_averages",
    "tests/test_collectives.py::test_halving_doubling_matches_reference",
    "tests/test_zero.py::test_hybrid_shard_on_one_node",
    "tests/test_autotune.py::test_two_ranks_tune_together_with_exact_results",
    "tests/test_zero3.py::test_a_stage_3_model_owns_its_shards",
]

# A module whose tests share a launch (a fixture of module, class or package scope) runs
# whole in one worker, so that the launch is made once.
SHARED_FIXTURE = re.compile(r"""scope\s*=\s*["'](?:module|class|package|session)["']""")
LAUNCHES = re.compile(r"\b(?:mpi_launch|subprocess|Popen)\b")


@functools.lru_cache(maxsize=None)
def _source(module: str) -> str:
    try:
        return Path(module).read_text()
    except OSError:                     # not a file of ours: whole, and early
        return "scope='module' subprocess"


if LoadScopeScheduling is not None:
    class OneWorkerChangesTheMachine(LoadScopeScheduling):
        """Each test on its own, but the tests of a module that share a launch (a
        module-scoped fixture) together, in one worker, the launch made once; every system
        module in the same worker, one after another: they share the cluster's namespaces
        and Slurm's ports and state. The system tests first, then in the order above.
        (pytest-xdist's own ``loadgroup`` does not group under pytest 9: it renames
        ``item._nodeid``, which pytest 9 no longer reads.)"""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.rootpath = config.rootpath
            self.priorities: dict[str, int] = {}

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if Path(module).stem in CHANGES:
                return "system"
            return module if SHARED_FIXTURE.search(self._source(module)) else nodeid

        def _source(self, module: str) -> str:
            return _source(str(self.rootpath / module))

        def _priority(self, scope: str) -> int:
            if scope not in self.priorities:
                if scope == "system":
                    priority = -1
                else:
                    nodeids = self.workqueue[scope]
                    priority = next((i for i, prefix in enumerate(LONGEST_FIRST)
                                     if any(nodeid.startswith(prefix) for nodeid in nodeids)),
                                    None)
                    if priority is None:
                        in_process = not LAUNCHES.search(self._source(scope.split("::")[0]))
                        priority = len(LONGEST_FIRST) + in_process
                self.priorities[scope] = priority
            return self.priorities[scope]

        def _assign_work_unit(self, node) -> None:
            # The first scope of the highest priority goes next (min keeps queue order).
            scope = min(self.workqueue, key=self._priority)
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False      # collection order after the priorities
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
