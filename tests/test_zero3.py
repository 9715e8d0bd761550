"""Stage 3 (``DistributedOptimizer(zero_stage=3, model=model)``; docs/sharding.md): parameters
after every step equal to ``zero_stage=0`` (bitwise at 2 ranks), evaluation, activation
checkpointing, memory released, the state forms across rank counts. See
tests/workers/zero3_worker.py."""
import pytest

from mpi_launch import assert_ok, run_mpi

RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


@pytest.mark.parametrize("ranks", [2, 3])
def test_stage_3_trains_as_the_unsharded_optimizer(ranks):
    result = run_mpi("zero3_worker.py", ranks, timeout=240, env=RING)
    assert_ok(result, expect_lines=7)


def test_stage_3_state_forms_restore_at_another_rank_count(tmp_path):
    saved = run_mpi("zero3_worker.py", 2, "save", tmp_path, timeout=120, env=RING)
    assert_ok(saved, expect_lines=1)
    restored = run_mpi("zero3_worker.py", 3, "restore", tmp_path, timeout=120, env=RING)
    assert_ok(restored, expect_lines=1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_stage_3_model_owns_its_shards(ranks):
    """Issue 63: the model outlives its optimizer, a new optimizer takes it over, what cannot
    work is refused, saves leave state_dict() alone, and shutdown() with the model alive ends
    normally (no rank crashes)."""
    result = run_mpi("zero3_ownership_worker.py", ranks, timeout=180, env=RING)
    assert_ok(result, expect_lines=4 + ranks)


@pytest.mark.parametrize("ranks", [2, 3])
def test_stage_3_builds_a_model_from_the_meta_device(ranks):
    """Issue 66: a model built on the meta device is given memory a bucket at a time; every
    rank ends with the first rank's initialisation and trains as zero_stage=0."""
    result = run_mpi("zero3_meta_worker.py", ranks, timeout=150, env=RING)
    assert_ok(result, expect_lines=2)
