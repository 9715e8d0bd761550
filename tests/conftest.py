"""Test switches shared by every test module."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--soak-cycles", type=int, default=10_000,
                     help="engine cycles of tests/test_protocol.py's seeded soak (default 10000)")


@pytest.fixture
def soak_cycles(request) -> int:
    return request.config.getoption("--soak-cycles")
