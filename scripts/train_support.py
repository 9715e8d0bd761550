"""Job-safety helpers for scripts/train.py: checkpoints that cannot be torn, a sampler that can
start an epoch part-way, and a preemption flag that every rank agrees on.

They are plain code on top of mpiddp's public API; copy them into your own training script.
"""
from __future__ import annotations

import itertools
import os
import signal

import torch
from torch.utils.data import DistributedSampler

import mpiddp
from mpiddp.elastic import write_durably

# sysexits.h EX_TEMPFAIL: "temporary failure, try again". train.py exits with it after a
# preemption checkpoint; the job script requeues the job on it (scripts/slurm.sbatch).
EXIT_PREEMPTED = 75


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` so that ``path`` always holds a whole checkpoint, the old or the new one,
    whatever happens meanwhile (the writer killed, the node losing power): through a
    temporary file, fsync and rename (``mpiddp.elastic.write_durably``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_durably(path, lambda f: torch.save(state, f))


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch can start after its first ``skip`` samples (a job
    resumed part-way through an epoch goes on with the batches it had not seen)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = min(skip, self.num_samples)

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class PreemptionWatch:
    """Turns the scheduler's warning signals into a stop that every rank agrees on.

    A signal handler only sets a flag: the signal may reach some ranks only (or reach them at
    different steps), and a rank that stopped alone would leave the others waiting in a
    collective. At every step the flags are combined with an all-reduce (MAX), submitted before
    the step's compute and collected after it, so it costs no waiting; every rank then sees the
    same answer at the same step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received = 0
        self._handle = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def start_step(self) -> None:
        self._handle = mpiddp.allreduce_async(torch.tensor([float(self.received)]),
                                              op=mpiddp.Max, name="preemption.flag")

    def stop_agreed(self) -> int:
        """The signal number some rank received before this step (0: none); the same on
        every rank."""
        return int(mpiddp.synchronize(self._handle).item())
