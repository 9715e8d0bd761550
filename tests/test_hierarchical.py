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
