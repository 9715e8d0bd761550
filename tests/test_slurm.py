"""The job script and the launch rules on a real Slurm.

``scripts/cluster/local_slurm.sh`` runs munged, slurmctld and slurmd on this machine (installing
slurm-wlm and munge if needed, as root); these tests submit to it. They change the machine, so
they run only with MPIDDP_SYSTEM_TESTS=1 (tests/conftest.py), and are skipped with the reason
where Slurm cannot start (not root, no packages). Every job gets a unique name and a time
limit, and is cancelled when its test ends, whether it passed, failed or timed out.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from mpi_launch import ROOT
from slurm_jobs import job, srun, wait_for_job

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]   # the first one may install Slurm
LOCAL_SLURM = ROOT / "scripts" / "cluster" / "local_slurm.sh"
SINGLETON_ERROR = "srun started 2 tasks but MPI sees 1 process per task: each would train alone"


@pytest.fixture(scope="session")
def slurm_env():
    """The environment for Slurm commands; Slurm is started for the session (and stopped after
    it) unless it was already running."""
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/cluster/local_slurm.sh installs Slurm and runs it as root")
    status = subprocess.run(["bash", str(LOCAL_SLURM), "status"], capture_output=True, text=True,
                            timeout=60)
    started_here = status.returncode != 0
    if started_here:
        status = subprocess.run(["bash", str(LOCAL_SLURM), "start"], capture_output=True,
                                text=True, timeout=600)
        if status.returncode != 0:
            pytest.skip("scripts/cluster/local_slurm.sh could not start Slurm:\n"
                        + status.stderr[-3000:])
    conf = re.search(r"export SLURM_CONF=(\S+)", status.stdout).group(1)
    env = dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        yield env
    finally:
        if started_here:
            subprocess.run(["bash", str(LOCAL_SLURM), "stop"], timeout=180)


def test_sbatch_job_script_trains_on_two_ranks(slurm_env, tmp_path):
    env = dict(slurm_env)
    if sys.prefix != sys.base_prefix:
        env["MPIDDP_VENV"] = sys.prefix       # the job script activates it, as users do
    out = tmp_path / "job.out"
    with job(env) as name:
        # Command-line options override the script's #SBATCH lines (2 nodes x 8 ranks).
        submit = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks=2",
             "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", "--no-requeue",
             f"--output={out}", "scripts/cluster/slurm.sbatch",
             "--epochs", "8", "--min-accuracy", "0.95", "--no-progress",
             "--checkpoint", str(tmp_path / "digits.pt")],
            env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        fields = wait_for_job(env, submit.stdout.strip().split(";")[0], timeout=300)
    text = out.read_text() if out.exists() else "(no output file)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "MPICH" in text                              # the library line of the job script
    assert "training on 2 rank(s)" in text
    assert "target accuracy 0.95: reached" in text
    assert "unknown setting MPIDDP_VENV" not in text and "LaunchError" not in text, text
    assert (tmp_path / "digits.pt").exists()


def test_sbatch_job_script_runs_a_users_script(slurm_env, tmp_path):
    """``sbatch scripts/cluster/slurm.sbatch my_train.py args``: the job runs that script instead of
    the example."""
    env = dict(slurm_env)
    if sys.prefix != sys.base_prefix:
        env["MPIDDP_VENV"] = sys.prefix
    out = tmp_path / "job.out"
    with job(env) as name:
        submit = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks=2",
             "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", "--no-requeue",
             f"--output={out}", "scripts/cluster/slurm.sbatch", "examples/readme_example.py"],
            env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        fields = wait_for_job(env, submit.stdout.strip().split(";")[0], timeout=300)
    text = out.read_text() if out.exists() else "(no output file)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "training on 2 rank(s)" not in text, text            # not scripts/train.py


def test_srun_with_pmi2_makes_one_mpi_job(slurm_env):
    code = ("import mpiddp, torch; mpiddp.init(); total = mpiddp.allreduce(torch.ones(1), "
            "op=mpiddp.Sum); print(f'rank {mpiddp.rank()} of {mpiddp.size()}: sum "
            "{int(total)}', flush=True)")
    with job(slurm_env) as name:
        result = srun(slurm_env, name, "--mpi=pmi2", "-n", "2", sys.executable, "-c", code)
    assert result.returncode == 0, result.stdout
    assert "rank 0 of 2: sum 2" in result.stdout and "rank 1 of 2: sum 2" in result.stdout


def test_srun_without_pmi_fails_on_every_task(slurm_env):
    code = "import mpiddp; mpiddp.init(); print('TRAINING ALONE', flush=True)"
    with job(slurm_env) as name:
        result = srun(slurm_env, name, "--mpi=none", "-n", "2", sys.executable, "-c", code)
    assert result.returncode != 0, result.stdout
    assert result.stdout.count(SINGLETON_ERROR) == 2, result.stdout
    assert "srun --mpi=pmi2" in result.stdout and "TRAINING ALONE" not in result.stdout


def test_warning_signal_checkpoints_requeues_and_resumes(slurm_env, tmp_path):
    """The scheduler's warning signal (here sent at once with ``scancel --signal=USR1``, as
    ``#SBATCH --signal=USR1@120`` sends it before the time limit): every rank stops at the same
    step, the checkpoint is written, train.py exits 75, the job script requeues the job
    (``scontrol requeue``), and the requeued job resumes from the checkpoint and completes."""
    env = dict(slurm_env)
    if sys.prefix != sys.base_prefix:
        env["MPIDDP_VENV"] = sys.prefix
    out, checkpoint = tmp_path / "job.out", tmp_path / "digits.pt"
    with job(env) as name:
        submit = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks=2",
             "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", f"--output={out}",
             "scripts/cluster/slurm.sbatch", "--epochs", "40", "--batch-size", "8",
             "--min-accuracy", "0.95", "--no-progress", "--checkpoint", str(checkpoint)],
            env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 120
        while "epoch   1/40" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job_id], env=env, check=True, timeout=60)
        fields = wait_for_requeued_job(env, job_id, timeout=300)
    text = out.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert fields["Restarts"] == "1", fields
    assert "SIGUSR1 received: stopped at step" in text, text
    assert "checkpoint written after a stop signal; requeueing" in text, text
    resumed = re.search(r"resuming from .*: (\d+) epoch\(s\) and (\d+) step\(s\) done on 2", text)
    assert resumed, text
    assert "target accuracy 0.95: reached" in text, text


def wait_for_requeued_job(env, job_id: str, timeout: float) -> dict:
    """Like ``wait_for_job``, past the requeue (the job is PENDING again in between)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = wait_for_job(env, job_id, max(1.0, deadline - time.monotonic()))
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        assert time.monotonic() < deadline, f"job {job_id} still {fields.get('JobState')}"
        time.sleep(1)


def submit_gpu_probe(env, tmp_path, *resources: str) -> tuple[dict, str, list]:
    """scripts/cluster/slurm_gpu.sbatch with ``resources`` on the local Slurm's fake GPUs, running
    tests/workers/slurm_gpu_probe.py as its training script: (job fields, output, probes)."""
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "workers"), str(ROOT)]))
    if sys.prefix != sys.base_prefix:
        env["MPIDDP_VENV"] = sys.prefix
    out = tmp_path / "job.out"
    with job(env) as name:
        submit = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", *resources,
             "--cpus-per-task=1", "--time=10", "--no-requeue", f"--output={out}",
             "scripts/cluster/slurm_gpu.sbatch", "tests/workers/slurm_gpu_probe.py"],
            env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        fields = wait_for_job(env, submit.stdout.strip().split(";")[0], timeout=300)
    text = out.read_text() if out.exists() else "(no output file)"
    probes = [json.loads(line[len("PROBE "):]) for line in text.splitlines()
              if line.startswith("PROBE ")]
    return fields, text, sorted(probes, key=lambda probe: probe["rank"])


def test_gpu_job_script_gives_each_rank_its_own_gpu(slurm_env, tmp_path):
    """One rank per GPU: Slurm makes the node's GPUs visible to every rank and mpiddp makes
    GPU <local rank> current, so the ranks use distinct physical GPUs, with no warning."""
    fields, text, probes = submit_gpu_probe(slurm_env, tmp_path, "--gpus-per-node=2",
                                            "--ntasks-per-node=2")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "MPICH" in text and "CUDA-aware MPI: no: GPU buffers are staged" in text, text
    assert [probe["local_rank"] for probe in probes] == [0, 1], text
    assert all(probe["visible"] == ["0", "1"] and probe["sum"] == 2 for probe in probes), text
    assert [probe["physical"] for probe in probes] == [0, 1], text
    assert "share" not in text and "warning" not in text.lower(), text


def test_gpu_job_with_more_ranks_than_gpus_names_the_sharing_ranks(slurm_env, tmp_path):
    """Two ranks on one GPU: they share it, and both the job script and mpiddp.init() say so,
    naming the ranks, instead of piling up silently."""
    fields, text, probes = submit_gpu_probe(slurm_env, tmp_path, "--gpus-per-node=1",
                                            "--ntasks-per-node=2")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert [probe["physical"] for probe in probes] == [0, 0], text
    assert "warning: 2 tasks but 1 GPUs per node: ranks will share GPUs" in text, text
    assert text.count("[mpiddp WARNING]") == 1, text               # rank 0, once
    assert re.search(r"several ranks share a GPU: ranks 0(-|, )1 on \S+ use one GPU "
                     r"\(cuda:0, GPU-fake-000000000000\)", text), text


INTEL_CODE = ("import os, mpiddp, torch; mpiddp.init(); total = mpiddp.allreduce(torch.ones(1), "
              "op=mpiddp.Sum); print(f'rank {mpiddp.rank()} of {mpiddp.size()}, local "
              "{mpiddp.local_rank()} of {mpiddp.local_size()}: sum {int(total)}', flush=True)")


def test_srun_starts_intel_mpi_ranks_through_slurms_pmi2(slurm_env):
    """Intel MPI (scripts/dev/test_intelmpi.sh) under ``srun --mpi=pmi2``: one job, through Slurm's
    PMI-2 library (``I_MPI_PMI_LIBRARY``, Debian's libpmi2-0, installed here if missing; the
    PyPI wheel also needs ``I_MPI_ROOT``, which mpiddp sets) and through Intel MPI's own PMI
    client (no library); without a PMI, the launch check stops every task."""
    from mpi4py import MPI
    if "Intel(R) MPI" not in MPI.Get_library_version():
        pytest.skip("needs Intel MPI (scripts/dev/test_intelmpi.sh)")
    found = subprocess.run(["bash", str(LOCAL_SLURM), "pmi2-library"], capture_output=True,
                           text=True, timeout=300)
    if found.returncode != 0:
        pytest.skip("Slurm's PMI-2 library (libpmi2-0) is missing and could not be installed:\n"
                    + found.stderr[-2000:])
    library = found.stdout.strip().splitlines()[-1]
    env = {name: value for name, value in slurm_env.items() if name != "I_MPI_ROOT"}
    for extra in ({"I_MPI_PMI_LIBRARY": library}, {}):
        with job(env) as name:
            result = srun(dict(env, **extra), name, "--mpi=pmi2", "-n", "2", sys.executable,
                          "-c", INTEL_CODE, timeout=120)
        assert result.returncode == 0, (extra, result.stdout)
        for rank in (0, 1):
            assert f"rank {rank} of 2, local {rank} of 2: sum 2" in result.stdout, \
                (extra, result.stdout)
    with job(env) as name:
        result = srun(env, name, "--mpi=none", "-n", "2", sys.executable, "-c", INTEL_CODE,
                      timeout=120)
    assert result.returncode != 0, result.stdout
    assert result.stdout.count(SINGLETON_ERROR) == 2, result.stdout
