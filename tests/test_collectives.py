"""Every collective x dtype x op on 1, 2, 3, 4 and 8 ranks against a float64 reference,
with each all-reduce algorithm, fusion across the (shrunk) fusion threshold and the cache."""
import pytest

from mpi_launch import assert_ok, reported, run_mpi
from mpiddp.config import ALGORITHMS

CHECKS = 17   # 'OK' lines collectives_worker.py prints on rank 0

# (ranks, algorithm): every rank count; each algorithm on more than one of them.
CASES = [(1, "auto"), (2, "ring"), (3, "auto"), (4, "native"), (4, "ring"), (8, "auto"),
         (3, "halving_doubling"), (4, "halving_doubling")]


@pytest.mark.parametrize("nprocs,algorithm", CASES, ids=[f"{n}ranks-{a}" for n, a in CASES])
def test_every_collective_matches_reference(nprocs, algorithm):
    # Small all-reduces in the negotiation are on by default only across nodes over the
    # engine's sockets; here over MPI, as a user may set them (test_multinode: the sockets).
    env = {"MPIDDP_FUSION_THRESHOLD": "65536", "MPIDDP_ALLREDUCE_ALGORITHM": algorithm,
           "MPIDDP_SPECULATION_BYTES": "16384"}
    result = run_mpi("collectives_worker.py", nprocs, timeout=150, env=env)
    assert_ok(result, expect_lines=CHECKS)
    if nprocs > 1:
        spec, = reported(result, "finished in the negotiation")
        assert spec["speculated"] > 0 and spec["budget"] == 16384, spec
    assert "DONE" in result.output
    batches, = reported(result, "allreduce every op x dtype x size")
    if nprocs > 1 and algorithm != "auto":      # a forced algorithm carries every batch
        assert batches[f"{algorithm}_batches"] > 0 and batches["fused_batches"] > 0, batches
        others = set(ALGORITHMS) - {"auto", algorithm}
        assert all(batches[f"{other}_batches"] == 0 for other in others), batches


def test_local_ranks_follow_the_launchers_numbering():
    # The launcher numbers the node's ranks backwards (as Open MPI may, in its mapping's
    # order): local_rank() follows it, and every collective still matches the reference.
    result = run_mpi("collectives_worker.py", 3, "check_topology", "check_allreduce",
                     "check_reducescatter", timeout=120, env={"REVERSE_LOCAL_RANKS": "1"})
    assert_ok(result, expect_lines=4)       # check_allreduce prints two


@pytest.mark.parametrize("nprocs", [2, 3, 5, 6, 8])
def test_halving_doubling_matches_reference(nprocs):
    # Powers of two and the fold of 1, 2 and 3 extra ranks, every op, dtype and odd size.
    result = run_mpi("halving_doubling_worker.py", nprocs, timeout=150)
    assert_ok(result, expect_lines=1)


def test_the_links_probe_ends_alike_on_every_rank_when_pairs_differ():
    # A node with a local rank no other node has measures nothing, yet joins every start.
    result = run_mpi("link_probe_worker.py", 3, timeout=60)
    assert_ok(result, expect_lines=1)


def test_auto_algorithm_uses_both_ring_and_native():
    # A 16 KiB ring threshold: the 40k-element tensors take the ring, small batches native.
    env = {"MPIDDP_FUSION_THRESHOLD": "65536", "MPIDDP_RING_THRESHOLD": "16384"}
    result = run_mpi("collectives_worker.py", 2, "check_fusion_and_cache", "check_allreduce",
                     timeout=120, env=env)
    assert_ok(result)
    assert "OK fusion and response cache" in result.output
    batches, = reported(result, "allreduce every op x dtype x size")
    assert batches["ring_batches"] > 0 and batches["native_batches"] > 0, batches


def test_tiny_cache_evicts_and_stays_correct():
    env = {"MPIDDP_CACHE_CAPACITY": "4", "MPIDDP_FUSION_THRESHOLD": "65536"}
    result = run_mpi("collectives_worker.py", 3, "check_out_of_order", "check_allreduce_variants",
                     timeout=120, env=env)
    assert_ok(result, expect_lines=2)


def test_more_names_than_the_response_cache_holds_grow_it():
    # 1,500 names a step against the default 1,024 places (set explicitly, the capacity
    # stays: the tiny-cache test above; tests/test_protocol.py).
    result = run_mpi("collectives_worker.py", 3, "check_cache_grows", timeout=120)
    assert_ok(result, expect_lines=1)


def test_engine_start_orders_its_collectives_and_its_stop_frees_its_communicators():
    # The host names and the watchdog's communicator are collectives on the engine's own
    # communicator: made after the coordinator started, they could fall between its cycles on
    # one rank and not on another (the main thread held up 0.2 s in each, as on a busy node).
    # At its stop, every communicator it made is freed (process sets added and removed).
    # And a timed wait for work that waits past its deadline (CPython 3.11-3.12's
    # SimpleQueue.get on a busy node) does not hang it.
    result = run_mpi("engine_start_worker.py", 2, timeout=60)
    assert_ok(result, expect_lines=6)
