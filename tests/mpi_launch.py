"""Launch multi-rank workers under mpiexec with a hard timeout.

Every launch runs in its own process session; on timeout the whole process group (mpiexec
and every rank) is killed, so a hang is a test failure and never an orphaned rank. Before
that, every Python process of the group prints the stack of each of its threads (Python's
fault handler on SIGABRT), so a hang says where every rank was.
Workers run under ``python -m mpi4py`` so an exception on one rank aborts the whole job.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
    return Job(*mpi_command(worker, nprocs, *args, env=env, mpi4py_run=mpi4py_run)) \
        .wait(timeout)


def mpi_command(worker: str, nprocs: int, *args: str, env: dict | None = None,
                mpi4py_run: bool = True) -> tuple[list, dict]:
    """(command, environment) that runs ``tests/workers/<worker>`` on ``nprocs`` ranks."""
    script = str(WORKERS / worker) if not os.path.isabs(worker) else worker
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(WORKERS),
                                                                 os.environ.get("PYTHONPATH")]))})
    # Waiting ranks yield the core when the ranks outnumber the cores, counting the ranks of
    # the launches the other pytest-xdist workers may be running meanwhile.
    if nprocs * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)) > (os.cpu_count() or 1):
        full_env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    full_env.update(env or {})
    runner = [sys.executable, "-m", "mpi4py"] if mpi4py_run else [sys.executable]
    return [mpiexec_path(), "-n", str(nprocs), *runner, script, *map(str, args)], full_env


def run_command(cmd: list, env: dict, timeout: float) -> MPIResult:
    """Run ``cmd`` in a new process session; on timeout kill the whole session's process
    group (the launcher and every rank it started)."""
    return Job(cmd, env).wait(timeout)


class Job:
    """A launch in a process session of its own, running while the test acts on it (freezes
    a rank, cuts a link); ``wait`` collects it, killing the whole group on timeout."""

    def __init__(self, cmd: list, env: dict):
        env = {**env, "PYTHONFAULTHANDLER": "1"}     # SIGABRT prints every thread's stack
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True, cwd=str(ROOT))

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> MPIResult:
        try:
            output, _ = self.proc.communicate(timeout=timeout)
            return MPIResult(self.proc.returncode, output, False)
        except subprocess.TimeoutExpired:
            dump_python_stacks(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            output, _ = self.proc.communicate()
            return MPIResult(-9, output, True)


def dump_python_stacks(root: int, grace: float = 3.0) -> None:
    """Make every Python process started under ``root`` print its threads' stacks (the
    fault handler, on SIGABRT) before the job is killed. The launcher and MPI's proxies (found
    by parentage, as Hydra starts each rank in a session of its own) are stopped meanwhile:
    otherwise the first rank to die makes them kill the others before those print. The
    stacks wait in the pipes until the proxies continue and forward them."""
    pythons, others = [], []
    for pid in [root] + descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0")[0].decode(errors="replace"))
        except OSError:
            continue                    # gone already
        (pythons if program.startswith("python") else others).append(pid)
    stopped, aborted = signal_each(others, signal.SIGSTOP), signal_each(pythons, signal.SIGABRT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(process_gone(pid) for pid in aborted):
        time.sleep(0.1)
    signal_each(stopped, signal.SIGCONT)
    time.sleep(1.0)         # the proxies forward what the ranks printed


def signal_each(pids: list[int], signum: int) -> list[int]:
    """Send ``signum`` to each process; return those that got it."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except OSError:
            pass
    return sent


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(stat_fields(int(entry))[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def assert_ok(result: MPIResult, expect_lines: int | None = None, prefix: str = "OK ") -> None:
    """Fail with the job's output unless it exited 0 in time (and printed the OK lines)."""
    assert not result.timed_out, f"MPI job timed out (every rank killed). Output:\n{result.output}"
    assert result.returncode == 0, f"MPI job failed (rc={result.returncode}):\n{result.output}"
    if expect_lines is not None:
        # Count occurrences, not lines: output of different ranks can share a line.
        got = result.output.count(prefix)
        assert got == expect_lines, (f"expected {expect_lines} '{prefix}' lines, got {got}:\n"
                                     f"{result.output}")


def reported(result: MPIResult, *fragments: str) -> list[dict]:
    """The values of every ``OK`` line whose check contains all ``fragments`` (the workers'
    ``checks.ok``: ``OK <check> | {json}``), each with its ``check`` text."""
    found = []
    # Two reports on one line (a rank's newline came after another rank's report) are split
    # where a report's JSON ends and the next begins. Intel MPI's mpiexec may also cut a line
    # in the middle to forward another rank's output: such a report cannot be read.
    lines = [part for line in result.output.splitlines()
             for part in re.split(r"(?<=\})(?=OK )", line)]
    for line in lines:
        if not line.startswith("OK "):
            continue
        check, _, values = line[3:].partition(" | ")
        if all(f in check for f in fragments):
            found.append({"check": check, **(json.loads(values) if values else {})})
    return found


def wait_for_files(*paths: Path, job: Job, timeout: float = 90) -> None:
    """Wait until every path exists (the job got going); fail at once if the job ended."""
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if not job.running():
            raise AssertionError("the job ended early:\n" + job.wait(5).output)
        if time.monotonic() > deadline:
            raise AssertionError("the job did not get going:\n" + job.wait(0.1).output)
        time.sleep(0.2)


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (in a container nobody may reap it)."""
    try:
        return stat_fields(pid)[0] == "Z"
    except FileNotFoundError:
        return True


def rank_pid(marker: str, rank: int, timeout: float = 30) -> int:
    """The pid of the process of ``rank`` whose command line contains ``marker`` (hydra gives
    each rank PMI_RANK in its environment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"PMI_RANK={rank}".encode() in f.read().split(b"\0"):
                        return int(entry)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} with {marker!r} in its command line")
