"""Test switches shared by every test module.

System tests (marker ``system``) change the machine as root: tests/test_slurm.py installs
and starts a one-node Slurm, tests/test_multinode.py builds network namespaces, veth links and
a bridge. They run only with MPIDDP_SYSTEM_TESTS=1
(as .ci/run sets it) and are skipped with the reason otherwise.
"""
import os

import pytest

SYSTEM_TESTS = os.environ.get("MPIDDP_SYSTEM_TESTS") == "1"
# What each module's system tests do to the machine (the skip reason says it).
CHANGES = {"test_slurm": "installs and starts Slurm on this machine as root",
           "test_multinode": "builds network namespaces, veth links and a bridge, and runs "
                             "Slurm across them, as root",
           "test_elastic_system": "builds network namespaces, veth links and a bridge, kills "
                                  "a node's ranks and sets its link down, as root"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "system: changes the machine as root (packages, daemons, network namespaces); "
                   "runs only with MPIDDP_SYSTEM_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if SYSTEM_TESTS:
        return
    for item in items:
        if "system" in item.keywords:
            what = CHANGES.get(item.module.__name__, "changes this machine as root")
            item.add_marker(pytest.mark.skip(
                reason=f"system test: {what}; set MPIDDP_SYSTEM_TESTS=1 to run it"))


def pytest_addoption(parser):
    parser.addoption("--soak-cycles", type=int, default=10_000,
                     help="engine cycles of tests/test_protocol.py's seeded soak (default 10000)")


@pytest.fixture
def soak_cycles(request) -> int:
    return request.config.getoption("--soak-cycles")
