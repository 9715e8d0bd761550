"""Jobs on a Slurm that scripts/local_slurm.sh started: on this machine (tests/test_slurm.py)
or across the emulated nodes of scripts/local_cluster.sh (tests/test_multinode.py), where
Slurm's commands run inside a node (``where``: the command prefix that gets them there)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager

import pytest

from mpi_launch import ROOT


@contextmanager
def job(env, where: tuple = ()):
    """A unique job name; whatever still runs under it is cancelled at the end."""
    name = f"mpiddp-test-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        subprocess.run([*where, "scancel", f"--name={name}"], env=env, timeout=60)


def srun(env, name: str, *args: str, timeout: float = 180,
         where: tuple = ()) -> subprocess.CompletedProcess:
    """Run srun (its own allocation, a 5-minute limit); kill it and fail on timeout."""
    cmd = [*where, "srun", f"--job-name={name}", "--time=5", "--kill-on-bad-exit=0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=str(ROOT), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"srun timed out after {timeout} s:\n{output}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output)


def wait_for_job(env, job_id: str, timeout: float, where: tuple = ()) -> dict:
    """The job's fields from ``scontrol show job`` once it has ended (accounting is off)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run([*where, "scontrol", "show", "job", "-o", job_id], env=env,
                               capture_output=True, text=True, timeout=60).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", shown))
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING",
                                          "COMPLETING"):
            return fields
        assert time.monotonic() < deadline, f"job {job_id} did not end in {timeout} s:\n{shown}"
        time.sleep(1)
