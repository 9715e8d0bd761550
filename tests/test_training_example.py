"""scripts/train.py end to end: stop and --resume (same and other rank counts), a preemption
signal on one rank with an exact resume, and checkpoints that survive a killed writer."""
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from mpi_launch import ROOT, assert_ok, mpiexec_path, rank_pid, run_mpi

TRAIN = str(ROOT / "scripts" / "train.py")
RANKS, EPOCHS, BATCH = 4, 6, 16


def epoch_lines(output: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^epoch +(\d+)/\d+: train loss", output,
                                                 re.MULTILINE)]


def test_train_checkpoint_and_resume(tmp_path: Path):
    checkpoint = tmp_path / "digits.pt"
    common = ["--epochs", EPOCHS, "--batch-size", BATCH, "--checkpoint", checkpoint,
              "--no-progress"]

    first = run_mpi(TRAIN, RANKS, *common, "--stop-after", 3, timeout=90)
    assert_ok(first, expect_lines=0)
    assert epoch_lines(first.output) == [1, 2, 3], first.output     # rank 0 logs only
    assert "stopping after epoch 3 of 6" in first.output, first.output
    saved = torch.load(checkpoint, weights_only=False)
    steps_per_epoch = math.ceil(math.ceil(1437 / RANKS) / BATCH)   # DistributedSampler pads
    assert saved["epoch"] == 3 and saved["ranks"] == RANKS
    assert saved["extra"]["scheduler"]["last_epoch"] == 3 * steps_per_epoch
    assert float(saved["optimizer"]["state"][0]["momentum_buffer"].abs().sum()) > 0

    second = run_mpi(TRAIN, RANKS, *common, "--resume", "--min-accuracy", 0.93, timeout=90)
    assert_ok(second, expect_lines=0)
    assert "resuming from" in second.output and "3 epoch(s) done" in second.output
    assert epoch_lines(second.output) == [4, 5, 6], second.output
    final = re.search(r"final test accuracy ([\d.]+) after 6 epochs on 4 rank", second.output)
    assert final and float(final.group(1)) >= 0.93, second.output
    assert "target accuracy 0.93: reached" in second.output
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["epoch"] == 6
    # The schedule went on where it stopped: 6 epochs of steps, ending at lr 0 (cosine).
    assert saved["extra"]["scheduler"]["last_epoch"] == 6 * steps_per_epoch
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.0
    print(second.output)


def epoch_lrs(output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^epoch +(\d+)/\d+: train loss .* lr (\S+) ", output, re.MULTILINE)}


def test_resume_on_a_different_number_of_ranks(tmp_path: Path):
    """Half of a 4-epoch run on one rank count, the rest on another: the learning rate is
    rescaled to the new rank count and the cosine schedule continues where the epochs say
    (at the end of epoch 3 of 4 its factor is 0.25), in both directions."""
    for before, after in ((1, 2), (2, 1)):
        checkpoint = tmp_path / f"digits-{before}-{after}.pt"
        common = ["--epochs", 4, "--batch-size", BATCH, "--checkpoint", checkpoint,
                  "--no-progress"]
        assert_ok(run_mpi(TRAIN, before, *common, "--stop-after", 2, timeout=90))
        resumed = run_mpi(TRAIN, after, *common, "--resume", "--min-accuracy", 0.93,
                          timeout=90)
        assert_ok(resumed)
        out = resumed.output
        assert f"written on {before} rank(s), this run has {after}" in out, out
        lrs = epoch_lrs(out)
        assert sorted(lrs) == [3, 4], out
        assert float(lrs[3]) == 0.02 * after * 0.25, out       # base lr x ranks x cosine
        assert float(lrs[4]) == 0.0, out
        assert "target accuracy 0.93: reached" in out, out
        steps_per_epoch = math.ceil(math.ceil(1437 / after) / BATCH)
        saved = torch.load(checkpoint, weights_only=False)
        assert saved["epoch"] == 4 and saved["ranks"] == after
        assert saved["extra"]["scheduler"]["last_epoch"] == 4 * steps_per_epoch


def run_until_signalled(args: list, marker: str, signal_rank: int, after_line: str,
                        timeout: float = 90):
    """Run train.py on 2 ranks and send SIGUSR1 to one rank once ``after_line`` is printed
    (``marker``: an argument that only this run has)."""
    cmd = [mpiexec_path(), "-n", "2", sys.executable, TRAIN, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=str(ROOT))
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if after_line in line:
                os.kill(rank_pid(marker, signal_rank), signal.SIGUSR1)
                break
        lines.extend(proc.stdout)
        return proc.wait(), "".join(lines)
    finally:
        killer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_preemption_signal_checkpoints_and_resume_is_exact(tmp_path: Path):
    """SIGUSR1 on rank 1 only: every rank stops at the same step, rank 0 writes a mid-epoch
    checkpoint and the job exits 75; --resume then ends with parameters bitwise equal to a run
    that was never interrupted (same seed, 2 ranks). Three epochs of 180 steps (batch 4): the
    signal goes once the first is logged, so the stop falls mid-epoch in a later one."""
    common = ["--epochs", 3, "--batch-size", 4, "--no-progress", "--seed", 3]
    whole = tmp_path / "whole.pt"
    assert_ok(run_mpi(TRAIN, 2, *common, "--checkpoint", whole, timeout=120))

    interrupted = tmp_path / "interrupted.pt"
    rc, out = run_until_signalled([*common, "--checkpoint", interrupted], str(interrupted),
                                  signal_rank=1, after_line="epoch   1/3")
    assert rc == 75, out
    assert "SIGUSR1 received: stopped at step" in out, out
    saved = torch.load(interrupted, weights_only=False)
    assert 1 <= saved["epoch"] < 3 and saved["step"] > 0, (saved["epoch"], saved["step"])
    assert len(saved["rng"]) == 2

    resumed = run_mpi(TRAIN, 2, *common, "--checkpoint", interrupted, "--resume", timeout=120)
    assert_ok(resumed)
    assert f"{saved['step']} step(s) done on 2 rank(s)" in resumed.output, resumed.output
    expected = torch.load(whole, weights_only=False)
    got = torch.load(interrupted, weights_only=False)
    assert got["epoch"] == 3 and got["step"] == 0
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), f"{name} differs after resume"
    for key, state in expected["optimizer"]["state"].items():
        assert torch.equal(got["optimizer"]["state"][key]["momentum_buffer"],
                           state["momentum_buffer"])


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    code = f"""
import sys, torch
from mpiddp.checkpoint import save_durably
save_durably({str(path)!r}, {{"generation": 1, "w": torch.arange(1000.0)}})
print("FIRST", flush=True)
save_durably({str(path)!r}, {{"generation": 2, "w": torch.ones(150_000_000)}})
print("SECOND", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "FIRST"
        tmp = Path(f"{path}.tmp{proc.pid}")     # write_durably's temporary name
        deadline = time.monotonic() + 60
        while not (tmp.exists() and tmp.stat().st_size > 1 << 20):
            assert time.monotonic() < deadline and proc.poll() is None, "never caught mid-write"
            time.sleep(0.001)
        proc.kill()                       # mid-write: the new file is partial
    finally:
        proc.kill()
        proc.wait()
    assert tmp.stat().st_size < 600_000_000          # it really was cut short
    state = torch.load(path, weights_only=False)
    assert state["generation"] == 1 and torch.equal(state["w"], torch.arange(1000.0))
