"""Test switches shared by every test module.

System tests (marker ``system``) change the machine: they install packages and start daemons
as root (tests/test_slurm.py runs a one-node Slurm). They run only with MPIDDP_SYSTEM_TESTS=1
(as .ci/run sets it) and are skipped with the reason otherwise.
"""
import os

import pytest

SYSTEM_TESTS = os.environ.get("MPIDDP_SYSTEM_TESTS") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "system: changes the machine (installs packages, starts daemons as root); "
                   "runs only with MPIDDP_SYSTEM_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if SYSTEM_TESTS:
        return
    skip = pytest.mark.skip(reason="system test: installs and starts Slurm on this machine as "
                                   "root; set MPIDDP_SYSTEM_TESTS=1 to run it")
    for item in items:
        if "system" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--soak-cycles", type=int, default=10_000,
                     help="engine cycles of tests/test_protocol.py's seeded soak (default 10000)")


@pytest.fixture
def soak_cycles(request) -> int:
    return request.config.getoption("--soak-cycles")
