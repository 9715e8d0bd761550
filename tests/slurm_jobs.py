"""Jobs on a Slurm that scripts/cluster/local_slurm.sh started: on this machine
(tests/test_slurm.py) or across the emulated nodes of scripts/cluster/local_cluster.sh
(tests/test_multinode.py), where Slurm's commands run inside a node (``where``: the command
prefix that gets them there)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest

from mpi_launch import ROOT


LOCAL_SLURM = ROOT / "scripts" / "cluster" / "local_slurm.sh"


@contextmanager
def slurm_on_cluster_nodes(nodes: int, state_dir, **extra_env):
    """Slurm on the first ``nodes`` nodes of the emulated cluster (scripts/cluster/local_slurm.sh:
    slurmctld in node 0, a slurmd in each node under its own name and address); yields the
    environment for its commands (over the shaped links, as between real nodes), stops it at
    the end. Skips where Slurm is not installed and cannot be."""
    env = dict(os.environ, LOCAL_SLURM_NODES=str(nodes), LOCAL_SLURM_DIR=str(state_dir))
    start = subprocess.run(["bash", str(LOCAL_SLURM), "start"], env=env, capture_output=True,
                           text=True, timeout=600)
    if "apt-get could not install" in start.stderr:
        pytest.skip("Slurm is not installed and could not be:\n" + start.stderr[-2000:])
    assert start.returncode == 0, start.stderr[-3000:]
    conf = re.search(r"export SLURM_CONF=(\S+)", start.stdout).group(1)
    try:
        yield dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                   UCX_TLS="tcp,self", **extra_env)
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], env=env, timeout=180)


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
