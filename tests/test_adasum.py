"""op=Adasum (docs/adasum.md): the collective against a float64 reference of its definition
(per tensor, the pairing tree, powers of two and not), the hierarchical form on emulated
nodes, and DistributedOptimizer(op=Adasum)'s delta semantics, GradScaler and accumulation.
See the workers for what each launch checks."""
import pytest

from mpi_launch import assert_ok, run_mpi

COLLECTIVE_CHECKS = 5          # 'OK' lines of adasum_worker.py at 2 ranks (more above)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_adasum_allreduce_matches_the_reference(ranks):
    result = run_mpi("adasum_worker.py", ranks, timeout=240)
    assert_ok(result, expect_lines=COLLECTIVE_CHECKS + (ranks >= 3))


@pytest.mark.parametrize("ranks,per_node", [(4, 2), (6, 2)],
                         ids=["2nodes-x2", "3nodes-x2"])
def test_hierarchical_adasum_is_adasum_of_node_averages(ranks, per_node):
    result = run_mpi("adasum_hierarchical_worker.py", ranks, per_node, timeout=240)
    assert_ok(result, expect_lines=1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_adasum_optimizer_matches_its_definition(ranks):
    result = run_mpi("adasum_optimizer_worker.py", ranks, timeout=240)
    assert_ok(result, expect_lines=5)
