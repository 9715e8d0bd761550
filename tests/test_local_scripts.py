"""The parts of scripts/cluster/local_cluster.sh and scripts/cluster/local_slurm.sh that run
without root and change nothing: their usage text, and the check that Slurm's ports are free
before ``start``.
(What they build, namespaces and daemons, is tested by the system tests: tests/conftest.py.)"""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster" / "local_cluster.sh"
LOCAL_SLURM = ROOT / "scripts" / "cluster" / "local_slurm.sh"


def run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **env))


def test_local_cluster_help_prints_its_usage():
    for flag in ("--help", "-h", "help"):
        result = run(CLUSTER, flag)
        assert result.returncode == 0, (flag, result.stderr)
        assert result.stdout.startswith("usage:") and "up K [RATE]" in result.stdout, flag
        assert result.stderr == "", (flag, result.stderr)


def test_local_cluster_refuses_an_unknown_command_with_its_usage():
    """Not taken for a launcher's ssh call (``-x 10.211.7.2 command``: a node's address)."""
    for args in (("frobnicate",), ("--verbose",), ("-x", "somehost", "true"), ()):
        result = run(CLUSTER, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "usage:" in result.stderr and "up K [RATE]" in result.stderr, args
        assert "no host" not in result.stderr and "unbound variable" not in result.stderr, args
    assert "unknown command: frobnicate" in run(CLUSTER, "frobnicate").stderr


def listening(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, port))
    sock.listen()
    return sock


def free_port_pair() -> int:
    """A port P with P and P + 1 free just now."""
    for _ in range(50):
        with listening() as first:
            port = first.getsockname()[1]
            try:
                with listening(port=port + 1):
                    return port
            except OSError:
                continue
    raise AssertionError("no two free ports in a row")


def test_local_slurm_names_the_program_holding_its_ports():
    """``start`` runs this check before it installs or starts anything: a port that another
    program holds (another Slurm's daemons, say) is named with that program and the way out
    (LOCAL_SLURM_PORT), instead of slurmctld failing later with "Address already in use"."""
    port = free_port_pair()
    assert run(LOCAL_SLURM, "check-ports", LOCAL_SLURM_PORT=str(port)).returncode == 0
    for held, daemon in ((port, "slurmctld"), (port + 1, "slurmd")):
        with listening(port=held):
            result = run(LOCAL_SLURM, "check-ports", LOCAL_SLURM_PORT=str(port))
        assert result.returncode == 1, result.stderr
        assert f"port {held}, which {daemon} needs, is in use by" in result.stderr
        assert f"(pid {os.getpid()})" in result.stderr, result.stderr      # this test's process
        assert "LOCAL_SLURM_PORT=P" in result.stderr
        other = "slurmd" if daemon == "slurmctld" else "slurmctld"
        assert f"which {other} needs" not in result.stderr, result.stderr
    bad = run(LOCAL_SLURM, "check-ports", LOCAL_SLURM_PORT="80x")
    assert bad.returncode == 1 and "LOCAL_SLURM_PORT must be a port number" in bad.stderr
