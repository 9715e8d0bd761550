"""Stage 3 with mixed precision (``DistributedOptimizer(zero_stage=3,
mixed_precision=mpiddp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...))``;
docs/sharding.md): bf16 parameters train as float32 does (losses within 3%), the masters stay
float32, gathers move half the bytes, ``model.state_dict()`` and checkpoints hold the masters.
See tests/workers/zero3_mixed_worker.py."""
from mpi_launch import assert_ok, run_mpi

RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


def test_stage_3_mixed_precision_at_2_ranks():
    result = run_mpi("zero3_mixed_worker.py", 2, timeout=240, env=RING)
    assert_ok(result, expect_lines=8)
