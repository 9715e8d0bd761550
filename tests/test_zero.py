"""DistributedOptimizer(zero_stage=1|2) (docs/sharding.md): bitwise equal to zero_stage=0
with the ring all-reduce (one fused bucket, and one parameter per bucket with the unsharded
run unfused), equal to one process on the concatenated batch, AMP, clipping, state dicts at
other rank counts, param groups, errors. See tests/workers/zero_worker.py for each check."""
import pytest

from mpi_launch import assert_ok, run_mpi

CHECKS = 11                     # 'OK' lines of zero_worker.py at 2 ranks (one more from 3)
RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_optimizer_trains_as_the_unsharded_one(ranks):
    result = run_mpi("zero_worker.py", ranks, timeout=300, env=RING)
    assert_ok(result, expect_lines=CHECKS + (ranks >= 3))


def test_one_parameter_buckets_match_unfused_all_reduces_bitwise():
    result = run_mpi("zero_worker.py", 4, "per-tensor", timeout=400,
                     env={**RING, "MPIDDP_FUSION_THRESHOLD": "0"})
    assert_ok(result, expect_lines=CHECKS + 1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_halves_fuse_with_the_bits_of_their_own_passes(ranks):
    """Issue 65: reduce-scatters and all-gathers of sharded buckets ready together run as one
    ring pass, each bucket's result bitwise that of a pass of its own."""
    assert_ok(run_mpi("ring_halves_worker.py", ranks, timeout=120), expect_lines=2)


@pytest.mark.parametrize("ranks", [2, 3])
def test_hybrid_shard_on_one_node(ranks):
    """Issue 65 item 3: hybrid_shard=True on one node shards over the node's ranks (bitwise
    to zero_stage=0 at 2 ranks); across nodes tests/test_multinode.py runs it on 2 x 2."""
    assert_ok(run_mpi("zero_hybrid_worker.py", ranks, timeout=240), expect_lines=5)
