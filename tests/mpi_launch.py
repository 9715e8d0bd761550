"""Launch multi-rank workers under mpiexec with a hard timeout.

Every launch runs in its own process session; on timeout the whole process group (mpiexec
and every rank) is killed, so a hang is a test failure and never an orphaned rank.
Workers run under ``python -m mpi4py`` so an exception on one rank aborts the whole job.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).parent.parent


def mpiexec_path() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    return str(candidate) if candidate.exists() else "mpiexec"


@dataclass
class MPIResult:
    returncode: int
    output: str
    timed_out: bool


def run_mpi(worker: str, nprocs: int, *args: str, timeout: float = 120,
            env: dict | None = None, mpi4py_run: bool = True) -> MPIResult:
    """Run ``tests/workers/<worker>`` on ``nprocs`` ranks; return its combined output."""
    script = str(WORKERS / worker) if not os.path.isabs(worker) else worker
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(WORKERS),
                                                                 os.environ.get("PYTHONPATH")]))})
    if nprocs > (os.cpu_count() or 1):
        full_env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"   # waiting ranks yield the core
    full_env.update(env or {})
    runner = [sys.executable, "-m", "mpi4py"] if mpi4py_run else [sys.executable]
    cmd = [mpiexec_path(), "-n", str(nprocs), *runner, script, *map(str, args)]
    return run_command(cmd, full_env, timeout)


def run_command(cmd: list, env: dict, timeout: float) -> MPIResult:
    """Run ``cmd`` in a new process session; on timeout kill the whole session's process
    group (the launcher and every rank it started)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=str(ROOT))
    try:
        output, _ = proc.communicate(timeout=timeout)
        return MPIResult(proc.returncode, output, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return MPIResult(-9, output, True)


def assert_ok(result: MPIResult, expect_lines: int | None = None, prefix: str = "OK ") -> None:
    """Fail with the job's output unless it exited 0 in time (and printed the OK lines)."""
    assert not result.timed_out, f"MPI job timed out (every rank killed). Output:\n{result.output}"
    assert result.returncode == 0, f"MPI job failed (rc={result.returncode}):\n{result.output}"
    if expect_lines is not None:
        # Count occurrences, not lines: output of different ranks can share a line.
        got = result.output.count(prefix)
        assert got == expect_lines, (f"expected {expect_lines} '{prefix}' lines, got {got}:\n"
                                     f"{result.output}")
