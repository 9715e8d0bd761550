"""Checkpoints that survive preemption, and resuming part-way through an epoch
(docs/checkpointing.md).

    ckpt = mpiddp.Checkpoint("checkpoints/run.pt", model=model, optimizer=optimizer,
                             sampler=sampler)       # sampler: a ResumableSampler
    ckpt.restore()                                  # collective: resume if the file exists
    for epoch in ckpt.epochs(num_epochs):
        for step, (x, y) in ckpt.batches(loader, epoch):
            ...                                     # one training step
        ckpt.save(epoch + 1)                        # collective: rank 0 writes

A scheduler's warning signal (SIGTERM or SIGUSR1) on any rank stops every rank at the same step
boundary: the checkpoint of that exact position is written and ``Preempted`` (a ``SystemExit``
with status 75, ``EXIT_PREEMPTED``) ends the script, so that the job script can requeue it.
"""
from __future__ import annotations

__all__ = ["Checkpoint", "ResumableSampler", "PreemptionWatch", "Preempted", "EXIT_PREEMPTED",
           "save_durably"]

import contextlib
import itertools
import os
import signal
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DistributedSampler

from .errors import EngineShutdownError
from .reduce_ops import Max
from .runtime import rank, set_size, size
from .torch.ops.async_ops import allreduce_async
from .durable import write_durably
from . import checkpoint_files, checkpoint_sharded
from .torch.ops.functions import _broadcast_hyperparameters, allgather_object, broadcast_object, \
    broadcast_optimizer_state, broadcast_parameters, every_rank_calls
from .torch.ops.handles import synchronize
from .torch.sharding.optimizer import consolidated
from .torch.sharding.model_state import kept_whole, model_of
from .torch.core.sharded_registry import zero_stage_of
from .torch.sharding.state import broadcast_whole_state

# sysexits.h EX_TEMPFAIL, "temporary failure, try again": the status of a preempted run, on
# which the job scripts requeue the job (scripts/cluster/slurm.sbatch).
EXIT_PREEMPTED = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised by ``Checkpoint.batches`` on every rank after the preemption checkpoint is
    written. Uncaught, the process exits with ``EXIT_PREEMPTED`` (75)."""

    def __init__(self, signum: int, epoch: int, step: int, path: str):
        super().__init__(EXIT_PREEMPTED)
        self.signum, self.epoch, self.step, self.path = signum, epoch, step, path

    def __str__(self) -> str:
        return (f"{signal.Signals(self.signum).name} received: stopped at step {self.step} "
                f"of epoch {self.epoch + 1} on every rank, checkpoint written to {self.path}; "
                f"exiting with status {EXIT_PREEMPTED} (requeue or resubmit the job to resume)")


def save_durably(path: str, state: dict) -> None:
    """``torch.save(state, path)`` such that ``path`` always holds a whole checkpoint, the old
    or the new one, whatever happens meanwhile (the writer killed, the node losing power).

    Args:
        path: the file; its directory is made if missing.
        state: what ``torch.save`` writes.

    Raises:
        OSError: the file cannot be written.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_durably(path, lambda f: torch.save(state, f))


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch can start after its first ``skip`` samples (a job
    resumed part-way through an epoch goes on with the samples it had not seen)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Start epoch ``epoch`` (its shuffle, the same on every rank).

        Args:
            epoch: the epoch, counted from 0.
            skip: samples of this rank's share to leave out at the start (those a resumed
                epoch has done).
        """
        super().set_epoch(epoch)
        self.skip = min(skip, self.num_samples)

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class PreemptionWatch:
    """Turns the scheduler's warning signals into a stop that every rank agrees on.

    The signal handler only sets a flag: a signal may reach some ranks only, or reach them at
    different steps, and a rank that stopped alone would leave the others waiting in a
    collective. Each step's flags are combined with an all-reduce (Max) submitted before the
    step's compute and collected after it, so it costs no waiting."""

    def __init__(self, signals: Iterable[int] = PREEMPTION_SIGNALS):
        self.received = 0
        self._handle = None
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def start_step(self) -> None:
        """Submit this rank's flag for the step about to run (collective, not waited for)."""
        self._handle = allreduce_async(torch.tensor([float(self.received)]), op=Max,
                                       name="mpiddp.checkpoint.preemption")

    def stop_agreed(self) -> int:
        """Collect the step's flags (after the step's compute).

        Returns:
            The signal some rank received before this step (0: none), the same on every rank.
        """
        handle, self._handle = self._handle, None
        return int(synchronize(handle).item()) if handle is not None else 0


def _rng_state() -> dict:
    """This rank's random state: dropout masks drawn after a resume are then those the
    uninterrupted run drew."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpoint:
    """A job's checkpoint file: the model, the optimizer's state, the position (epoch and step)
    and values of your own (``extra``). Rank 0 reads and writes the file; what it holds reaches
    the other ranks by broadcast, so the file need not be on a shared file system.

    ``sharded=True`` with a sharded optimizer (``zero_stage`` 1 to 3): every rank writes its
    own part at once, and ``path`` becomes a small manifest written last (docs/checkpointing.md,
    "Sharded checkpoints"); the parts must be on a file system every rank reads. ``restore``
    reads either form, whatever ``sharded`` says.

    Every method but ``epochs`` is collective: call it on every rank, at the same point.
    After ``restore()``: ``epoch`` and ``step`` say where training goes on (``step`` counts
    this run's steps already done in that epoch), ``ranks`` how many ranks wrote the file
    (this run's count when nothing was restored), ``extra`` the values saved with it."""

    def __init__(self, path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sampler: ResumableSampler | None = None,
                 signals: Iterable[int] = PREEMPTION_SIGNALS, sharded: bool = False):
        if sampler is not None and not isinstance(sampler, ResumableSampler):
            raise TypeError(f"Checkpoint(sampler=...) takes an mpiddp.checkpoint."
                            f"ResumableSampler (it skips the samples a resumed epoch has "
                            f"done), not a {type(sampler).__name__}")
        if zero_stage_of(optimizer) == 3 and model_of(optimizer) is not model:
            raise ValueError("mpiddp.Checkpoint(model=..., optimizer=...) with "
                             "DistributedOptimizer(zero_stage=3): pass the model the optimizer "
                             "was built with (DistributedOptimizer(..., model=model))")
        stage = zero_stage_of(optimizer)
        if sharded and stage and set_size(optimizer._mpiddp.process_set) != size():
            raise ValueError("mpiddp.Checkpoint(sharded=True) takes an optimizer sharded over "
                             "every rank, not over a process set; use sharded=False (the whole "
                             "file)")
        self.path, self.model, self.optimizer, self.sampler = path, model, optimizer, sampler
        # (At stage 0 every rank holds everything: there is nothing to shard, the file is whole.)
        self.sharded = bool(sharded) and bool(stage)
        self.epoch, self.step, self.ranks = 0, 0, size()
        self.extra: dict[str, Any] = {}
        self.preemption = PreemptionWatch(signals)
        self._rng_states = None         # every rank's random state, for a mid-epoch resume

    # ---- resuming ---------------------------------------------------------------------
    def restore(self) -> bool:
        """Load the checkpoint if its file exists (rank 0 looks) and hand it to every rank.
        Without a file, the model's and optimizer's state are still broadcast from rank 0,
        so every rank starts from the same weights.

        A sharded optimizer (``zero_stage`` 1 to 3) gets the whole optimizer state from
        rank 0, a part at a time, and each rank keeps its shards: the file may come from any
        stage and any rank count. At stage 3 the file's model state reaches every rank
        whole, and each keeps its chunks of the parameters. Without a file it takes rank
        0's hyperparameters only (its shards' state is each rank's own).

        A sharded checkpoint (its manifest at ``path``) is read by every rank, memory-mapped:
        each takes what its shards need (at stages 0 to 2, the whole model), from the newest
        save whose parts are all there, written at any rank count and stage.

        Returns:
            Whether a checkpoint was loaded (then ``epoch``, ``step``, ``ranks`` and
            ``extra`` say what it held).

        Raises:
            OSError, RuntimeError: rank 0 cannot read the file (``torch.load``); the job
                ends as for any exception on one rank.
            ValueError: with a sharded optimizer or a sharded checkpoint, the saved state
                belongs to another model; the manifest names no complete save (raised on
                every rank).
            EngineShutdownError: some ranks did not call it (on every rank, naming them).
        """
        every_rank_calls("mpiddp.Checkpoint.restore")   # on some ranks only: an error
        found = checkpoint_sharded.find(self.path) \
            if rank() == 0 and os.path.exists(self.path) else None
        found = broadcast_object(found, root_rank=0, name="mpiddp.checkpoint.found")
        if found is not None and "error" in found:
            raise ValueError(f"mpiddp.Checkpoint.restore: {found['error']}")
        if found is not None and "directory" in found:
            return self._resume(checkpoint_sharded.restore(self, found["directory"],
                                                           found["world_size"]))
        state = None
        sharded = zero_stage_of(self.optimizer)
        if rank() == 0 and found is not None:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
            if sharded != 3:
                self.model.load_state_dict(state["model"])
            if not sharded:
                self.optimizer.load_state_dict(state["optimizer"])
        position = None if state is None else \
            {key: state[key] for key in ("epoch", "step", "ranks", "extra", "rng")}
        position = broadcast_object(position, root_rank=0, name="mpiddp.checkpoint.position")
        if sharded == 3:
            _restore_full_model(self.model, self.optimizer, state["model"] if state else None,
                                position is not None)
        else:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if not sharded:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        elif position is not None:
            # The whole state (any stage, any rank count wrote it) from rank 0: every rank
            # keeps its shards' slices.
            broadcast_whole_state(self.optimizer, state["optimizer"] if state else None,
                                  root_rank=0, name="mpiddp.checkpoint.optimizer")
        else:
            # Nothing to resume: rank 0's hyperparameters. (The shards' state, if any, is
            # each rank's own: nothing of rank 0's to copy.)
            _broadcast_hyperparameters(self.optimizer, root_rank=0,
                                       name="mpiddp.checkpoint.hyperparameters")
        if position is None:
            return False
        if position["ranks"] != size():
            position["rng"] = None
        return self._resume(position)

    def _resume(self, position: dict) -> bool:
        """Take the restored position: ``rng`` indexed by rank, None at another rank count."""
        self.epoch, self.ranks, self.extra = position["epoch"], position["ranks"], \
            position["extra"]
        # The same samples are done in this run's steps (exactly when the counts divide).
        self.step = position["step"] * self.ranks // size()
        self._rng_states = position["rng"]
        return True

    def epochs(self, num_epochs: int) -> range:
        """The epochs left to train.

        Args:
            num_epochs: the epochs the whole training has.

        Returns:
            ``range(epoch, num_epochs)``: from the restored epoch (0 when nothing was
            restored).
        """
        return range(self.epoch, num_epochs)

    # ---- training -----------------------------------------------------------------------
    def batches(self, loader: Iterable, epoch: int) -> Iterator[tuple[int, Any]]:
        """The batches of one epoch, with a preemption check after each step.

        Sets the sampler's epoch; in the restored epoch skips the batches already done.
        After each step, checks (with every rank) for a preemption signal: on one, writes the
        checkpoint of this exact position and raises ``Preempted`` on every rank.

        Args:
            loader: the epoch's batches (a ``DataLoader`` over the ``sampler``).
            epoch: the epoch, counted from 0.

        Returns:
            An iterator of ``(step, batch)``, steps counted from 1 (from the first step not
            done, in the restored epoch).

        Raises:
            Preempted: a preemption signal reached some rank; the checkpoint is written.
            ValueError: resuming part-way through an epoch without a ``ResumableSampler``
                or through a loader without ``batch_size``.
        """
        skip = self.step if epoch == self.epoch else 0
        self.step = 0                               # the skip applies once
        if skip and self.sampler is None:
            raise ValueError(f"the checkpoint {self.path} stopped part-way through epoch "
                             f"{epoch + 1}: resuming there needs Checkpoint(sampler=...) with "
                             "an mpiddp.checkpoint.ResumableSampler")
        per_batch = getattr(loader, "batch_size", None)
        if skip and per_batch is None:
            raise ValueError(f"the checkpoint {self.path} stopped part-way through epoch "
                             f"{epoch + 1}: resuming there needs a DataLoader with a "
                             "batch_size (the samples to skip are the steps done times it), "
                             "not a batch_sampler")
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, skip=skip * (per_batch or 0))
        batches = iter(loader)      # draws the loader's seed: restore the random state after
        if skip and self._rng_states is not None:
            _set_rng_state(self._rng_states[rank()])
        self._rng_states = None
        for step, batch in enumerate(batches, start=skip + 1):
            self.preemption.start_step()
            try:
                yield step, batch
            except GeneratorExit:           # the loop was left early: collect the flag
                with contextlib.suppress(EngineShutdownError):  # (left by that error)
                    self.preemption.stop_agreed()
                raise
            signum = self.preemption.stop_agreed()
            if signum:
                self.save(epoch, step)
                raise Preempted(signum, epoch, step, self.path)

    def save(self, epoch: int, step: int = 0, **extra: Any) -> None:
        """Write the checkpoint (rank 0, durably: temporary file, fsync, rename). A sharded
        optimizer's state (``zero_stage`` 1 to 3) is first gathered into the whole state on
        rank 0 (``consolidate_state_dict(to=0)``), so the file is the same at every stage.
        With ``sharded=True`` every rank writes its own part instead, and rank 0 the manifest
        once every part is on disk; the save before it stays as a fallback.

        Args:
            epoch: the epoch the position is in, counted from 0; after an epoch, call
                ``save(epoch + 1)``.
            step: the steps of ``epoch`` done (0: it has not begun). Part-way through an
                epoch every rank's random state is saved too.
            **extra: values of your own (plain data, tensors), kept in ``self.extra`` and
                saved with it.

        Raises:
            OSError: rank 0 cannot write the file; sharded, a rank cannot write its part
                (on every rank; the previous checkpoint stays).
            EngineShutdownError: some ranks did not call it (on every rank, naming them).
        """
        every_rank_calls("mpiddp.Checkpoint.save")      # called on some ranks only: an error
        self.extra.update(extra)
        if self.sharded:                # each rank writes its own random state in its part
            checkpoint_sharded.save(self, epoch, step, _rng_state() if step else None)
            self.epoch, self.step, self.ranks = epoch, 0, size()
            return
        rng = allgather_object(_rng_state(), name="mpiddp.checkpoint.rng") if step else None
        # Sharded: every rank's shards are gathered (bucket by bucket) into the whole state on
        # rank 0, so the file is the same at every stage and rank count; afterwards the
        # optimizer and model are as they were.
        with consolidated(self.optimizer, to=0) if zero_stage_of(self.optimizer) \
                else contextlib.nullcontext():
            if rank() == 0:
                save_durably(self.path, {
                    "epoch": epoch, "step": step, "ranks": size(), "extra": self.extra,
                    "rng": rng, "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict()})
                checkpoint_files.remove_parts(self.path)   # (a sharded save's, now no one's)
        self.epoch, self.step, self.ranks = epoch, 0, size()


def _restore_full_model(model: torch.nn.Module, optimizer, saved: dict | None,
                        found: bool) -> None:
    """Stage 3: rank 0's file's model state reaches every rank whole (a tensor per
    entry, broadcast), and each rank's ``load_state_dict`` keeps its chunks of the parameters
    (``DistributedOptimizer(..., model=model)``). Without a file only what is kept whole
    (buffers) comes from rank 0: the sharded parameters, gathered from every rank's chunk,
    are already the same everywhere."""
    if not found:
        broadcast_parameters(kept_whole(optimizer, model), root_rank=0,
                             prefix="mpiddp.checkpoint.buffers")
        return
    shapes = broadcast_object({key: (tuple(value.shape), value.dtype)
                               for key, value in saved.items()} if rank() == 0 else None,
                              root_rank=0, name="mpiddp.checkpoint.model")
    full = saved if rank() == 0 else {key: torch.empty(shape, dtype=dtype)
                                      for key, (shape, dtype) in shapes.items()}
    broadcast_parameters(full, root_rank=0, prefix="mpiddp.checkpoint.model")
    model.load_state_dict(full)
