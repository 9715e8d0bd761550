"""Across nodes, on an emulated cluster: network namespaces joined by shaped veth links, MPI
over TCP (scripts/local_cluster.sh, docs/multinode.md). These tests change the machine (root,
namespaces, a bridge), so they run only with MPIDDP_SYSTEM_TESTS=1, and are skipped with the
reason where the cluster cannot be built. Every launch has a timeout and is killed as a
process group; the cluster is torn down at the end."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT, WORKERS, MPIResult, assert_ok, run_command

pytestmark = [pytest.mark.system]
CLUSTER = ROOT / "scripts" / "local_cluster.sh"


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/local_cluster.sh builds network namespaces")
    subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=60)
    up = subprocess.run(["bash", str(CLUSTER), "up", "3", "1gbit"], capture_output=True,
                        text=True, timeout=60)
    if up.returncode != 0:
        pytest.skip("scripts/local_cluster.sh could not build the cluster:\n" + up.stderr)
    try:
        yield
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=60)


def run_on_cluster(layout: str, worker: str, *args, env: dict | None = None,
                   timeout: float = 240) -> MPIResult:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                    PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKERS)]))
    full_env.update(env or {})
    genv = [arg for key, value in (env or {}).items() for arg in ("-genv", key, value)]
    cmd = ["bash", str(CLUSTER), "run", layout, "--", *genv, sys.executable, "-m", "mpi4py",
           str(WORKERS / worker), *map(str, args)]
    return run_command(cmd, full_env, timeout)


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_topology_and_hierarchical_allreduce_across_nodes(cluster, nodes, per_node):
    result = run_on_cluster(f"{nodes}x{per_node}", "multinode_worker.py", nodes, per_node,
                            env={"MPIDDP_HIERARCHICAL_ALLREDUCE": "1"})
    assert_ok(result, expect_lines=2)


def test_every_collective_across_nodes(cluster):
    result = run_on_cluster("2x2", "collectives_worker.py", "check_allreduce",
                            "check_allgather", "check_broadcast", "check_reducescatter",
                            "check_alltoall", "check_process_sets",
                            env={"MPIDDP_FUSION_THRESHOLD": "65536",
                                 "MPIDDP_RING_THRESHOLD": "16384"})
    assert_ok(result, expect_lines=7)


def test_training_equivalence_across_nodes(cluster):
    result = run_on_cluster("2x2", "optimizer_worker.py", "equivalence", timeout=300)
    assert_ok(result)
    assert result.output.count("bitwise-identical-across-ranks") == 8, result.output
