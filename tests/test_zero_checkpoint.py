"""A working script with ``zero_stage=2`` added to its DistributedOptimizer call runs unchanged:
docs/getting-started.md's complete script (examples/getting_started.py, its text changed here
at run time) trains, stops on SIGTERM with status 75 and a checkpoint, and resumes, bitwise as
the unsharded script at the same rank count and at another one. And tests/workers/
zero_checkpoint_worker.py: broadcast_optimizer_state of a sharded optimizer, consolidate_state_dict
at stage 0, Checkpoint files of either stage, a 2-rank checkpoint restored on 3 ranks."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import torch

from mpi_launch import ROOT, Job, MPIResult, assert_ok, mpi_command, rank_pid, run_mpi

EXAMPLE = ROOT / "examples" / "getting_started.py"
CALL = "named_parameters=model.named_parameters())"
# The sharded reduce-scatter sums in the ring all-reduce's order (docs/sharding.md).
RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}
EPOCHS = ["--epochs", "3"]


def sharded_example(tmp_path: Path) -> Path:
    """examples/getting_started.py with ``zero_stage=2`` added to its DistributedOptimizer
    call, and nothing else changed."""
    text = EXAMPLE.read_text()
    line = next(line for line in text.splitlines() if "mpiddp.DistributedOptimizer(" in line)
    assert CALL in line and text.count(CALL) == 1, line
    script = tmp_path / "getting_started_zero2.py"
    script.write_text(text.replace(CALL, CALL[:-1] + ", zero_stage=2)"))
    return script


def launch(script: Path, ranks: int, *args) -> Job:
    cmd, env = mpi_command(str(script), ranks, *map(str, args), env=RING)
    return Job(cmd, dict(env, PYTHONPATH=str(ROOT)))     # only the package, as a user has it


def handler_installed(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def signal_rank_once_caught(job: Job, marker: str, rank: int, signum: int,
                            timeout: float = 90) -> None:
    """Send ``signum`` to the rank ``rank`` of the job (hydra gives each rank PMI_RANK; the
    ranks' command lines hold ``marker``) as soon as it has a handler for it: here,
    ``mpiddp.Checkpoint`` installed it, before training began."""
    pid = rank_pid(marker, rank, timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.running():
        try:
            if handler_installed(pid, signum):
                os.kill(pid, signum)
                return
        except OSError:
            break
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never caught {signum}:\n{job.wait(5).output}")


def same_checkpoints(expected: Path, got: Path) -> None:
    a, b = torch.load(expected, weights_only=False), torch.load(got, weights_only=False)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert sorted(a["optimizer"]["state"]) == sorted(b["optimizer"]["state"])
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][index]["momentum_buffer"]), index


def finished(result: MPIResult, ranks: int) -> None:
    assert_ok(result)
    assert "final test accuracy" in result.output and f"on {ranks} rank(s)" in result.output, \
        result.output


def test_getting_started_with_zero_stage_2_trains_stops_and_resumes(tmp_path: Path):
    """Unchanged but for zero_stage=2: the script trains; SIGTERM on one rank stops every rank
    at a step boundary with status 75 and a mid-epoch checkpoint; run again, it resumes and
    ends bitwise as the unsharded script run without a stop; run on 3 ranks instead, it
    resumes the 2-rank checkpoint and finishes."""
    reference = tmp_path / "reference.pt"
    finished(launch(EXAMPLE, 2, *EPOCHS, "--checkpoint", reference).wait(120), 2)

    script = sharded_example(tmp_path)
    checkpoint, for_three = tmp_path / "sharded.pt", tmp_path / "sharded-3.pt"
    job = launch(script, 2, *EPOCHS, "--checkpoint", checkpoint)
    signal_rank_once_caught(job, str(script), rank=1, signum=signal.SIGTERM)
    stopped = job.wait(120)
    assert stopped.returncode == 75, stopped.output
    assert "SIGTERM received: stopped at step" in stopped.output, stopped.output
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["step"] > 0 and saved["ranks"] == 2 and len(saved["rng"]) == 2, saved["step"]
    shutil.copy(checkpoint, for_three)

    resumed = launch(script, 2, *EPOCHS, "--checkpoint", checkpoint).wait(120)
    finished(resumed, 2)
    assert f"{saved['step']} step(s) done (written by 2 rank(s))" in resumed.output, \
        resumed.output
    same_checkpoints(reference, checkpoint)

    on_three = launch(script, 3, *EPOCHS, "--checkpoint", for_three, "--min-accuracy", "0.8")
    result = on_three.wait(120)
    finished(result, 3)
    assert "done (written by 2 rank(s))" in result.output, result.output
    final = torch.load(for_three, weights_only=False)
    assert final["epoch"] == 3 and final["ranks"] == 3
    assert sorted(final["optimizer"]["state"]) == sorted(saved["optimizer"]["state"])


def test_sharded_checkpoints_broadcasts_and_another_rank_count(tmp_path: Path):
    """tests/workers/zero_checkpoint_worker.py: checks at 2 ranks, then the 2-rank checkpoint
    restored at 3."""
    saved = run_mpi("zero_checkpoint_worker.py", 2, "save", str(tmp_path), timeout=240,
                    env=RING)
    assert_ok(saved, expect_lines=3)
    restored = run_mpi("zero_checkpoint_worker.py", 3, "restore", str(tmp_path), timeout=240,
                       env=RING)
    assert_ok(restored, expect_lines=1)
