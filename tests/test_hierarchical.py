"""Hierarchical all-reduce (node-local reduce-scatter, cross-node all-reduce, node-local
all-gather) on emulated node layouts, against a float64 reference."""
import pytest

from mpi_launch import assert_ok, run_mpi

LAYOUTS = [(2, 2), (4, 2), (4, 4), (6, 3), (8, 2)]      # (ranks, ranks per node)


@pytest.mark.parametrize("ranks,per_node", LAYOUTS,
                         ids=[f"{r // p}nodes-x{p}" for r, p in LAYOUTS])
def test_hierarchical_allreduce_matches_reference(ranks, per_node):
    result = run_mpi("hierarchical_worker.py", ranks, per_node, timeout=180)
    assert_ok(result, expect_lines=1)


@pytest.mark.parametrize("ranks,per_node", [(4, 2), (6, 3), (6, 2)],
                         ids=["2nodes-x2", "2nodes-x3", "3nodes-x2"])
def test_sharded_halves_cut_by_node(ranks, per_node):
    """Issue 65 item 2: a sharded bucket's reduce-scatter within the node, then across nodes
    on the node's chunk; the all-gather back (collectives/shard_grid.py)."""
    result = run_mpi("shard_grid_worker.py", ranks, per_node, timeout=180)
    assert_ok(result, expect_lines=1)
