"""scripts/train.py end to end on 4 ranks: a run stopped after 3 of 6 epochs writes a
checkpoint; a second run with --resume goes on from it (epochs 4-6, learning-rate schedule
continued, not restarted) and reaches the accuracy target."""
import math
import re
from pathlib import Path

import torch

from mpi_launch import ROOT, assert_ok, run_mpi

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
    assert saved["scheduler"]["last_epoch"] == 3 * steps_per_epoch
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
    assert saved["scheduler"]["last_epoch"] == 6 * steps_per_epoch
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
        assert saved["scheduler"]["last_epoch"] == 4 * steps_per_epoch
