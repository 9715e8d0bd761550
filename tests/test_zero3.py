"""Stage 3, the preview (``DistributedOptimizer(zero_stage=3)`` while
``mpiddp.torch.sharding.param_gathers.PREVIEW`` is set; docs/dev/zero3.md): parameters after
every step equal to ``zero_stage=0`` (bitwise at 2 ranks), evaluation, activation
checkpointing, memory released. See tests/workers/zero3_worker.py."""
import pytest

from mpi_launch import assert_ok, run_mpi

RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


@pytest.mark.parametrize("ranks", [2, 3])
def test_stage_3_trains_as_the_unsharded_optimizer(ranks):
    result = run_mpi("zero3_worker.py", ranks, timeout=240, env=RING)
    assert_ok(result, expect_lines=6)


def test_stage_3_is_not_offered_yet():
    import mpiddp
    import torch
    from mpiddp.torch.sharding import param_gathers
    assert not param_gathers.PREVIEW
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
        mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), zero_stage=3)


def test_stage_3_checkpoint_restores_at_another_rank_count(tmp_path):
    saved = run_mpi("zero3_worker.py", 2, "save", tmp_path, timeout=120, env=RING)
    assert_ok(saved, expect_lines=1)
    restored = run_mpi("zero3_worker.py", 3, "restore", tmp_path, timeout=120, env=RING)
    assert_ok(restored, expect_lines=1)
