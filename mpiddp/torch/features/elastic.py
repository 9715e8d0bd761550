"""Elastic training: durable snapshots that restore on any rank count, and a sampler whose
position survives a change of rank count (docs/elastic.md).

    state = mpiddp.elastic.State(model, optimizer, sampler=sampler, directory="snapshots")
    state.restore()                       # the newest whole snapshot any rank can read
    for state.epoch in range(state.epoch, epochs):
        sampler.set_epoch(state.epoch, consumed=state.consumed)
        for batch in loader:
            train(batch)
            state.step += 1
            if state.step % 50 == 0:
                state.commit()            # host copy now, the write in the background
        state.consumed = 0

``python -m mpiddp.run`` relaunches a job that lost a node on the nodes still alive; the
script then goes on from its last commit.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import io
import os
import queue
import re
import socket
import threading
from typing import Any, Iterator

import torch

from ... import runtime
from ...durable import write_durably
from ..ops.functions import allgather_object, broadcast_object, broadcast_optimizer_state, \
    broadcast_parameters
from ..sharding.optimizer import consolidated
from ..sharding.model_state import kept_whole, model_of
from ..core.sharded_registry import zero_stage_of

SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d+)-(.+)\.pt$")


def _to_host(value):
    """A deep copy of ``value`` with every tensor copied to host memory (detached), so that
    training may go on changing the originals while the copy is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return copy.deepcopy(value)


class ElasticSampler:
    """Which samples each rank trains in an epoch, such that a job resumed on another rank
    count trains every sample of the interrupted epoch exactly once.

    The epoch's order is one permutation of the data set (the same on every rank, from
    ``seed + epoch``). Step ``k`` trains the next ``size * batch_size`` samples of it, rank
    ``r`` taking every ``size``-th of them from the ``r``-th: the samples done are always a
    prefix of the permutation, ``consumed`` long, whatever rank counts trained it. No sample is
    repeated to pad the epoch: in the last step a rank's batch may be short (or empty when
    fewer samples are left than ranks), so every rank runs the same number of steps.

    It yields batches of indices: pass it to a ``DataLoader`` as ``batch_sampler``."""

    def __init__(self, dataset_size: int, batch_size: int, shuffle: bool = True,
                 seed: int = 0, rank: int | None = None, size: int | None = None):
        self.dataset_size = int(dataset_size)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.rank = runtime.rank() if rank is None else rank
        self.size = runtime.size() if size is None else size
        self.epoch = 0
        self.consumed = 0           # samples of this epoch trained, on every rank together

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Start ``epoch`` after its first ``consumed`` samples (trained before a restart)."""
        if not 0 <= consumed <= self.dataset_size:
            raise ValueError(f"ElasticSampler.set_epoch: consumed={consumed} is outside the "
                             f"data set of {self.dataset_size} samples")
        self.epoch, self.consumed = epoch, consumed

    def order(self) -> list[int]:
        """The epoch's permutation of the sample indices."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def __len__(self) -> int:
        """Steps left in the epoch (the same on every rank)."""
        step = self.size * self.batch_size
        return -(-(self.dataset_size - self.consumed) // step)

    def __iter__(self) -> Iterator[list[int]]:
        order, step = self.order(), self.size * self.batch_size
        while self.consumed < self.dataset_size:
            chunk = order[self.consumed:self.consumed + step]
            # Counted as trained when handed out: a commit made after the step that trains
            # this batch records it as done.
            self.consumed += len(chunk)
            yield chunk[self.rank::self.size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.set_epoch(state["epoch"], state["consumed"])


class State:
    """The training state to snapshot: model, optimizer, sampler position, ``epoch``,
    ``step`` and any user extras (keyword arguments, read and set as attributes; plain
    Python values or tensors).

    ``commit()`` copies the state to host memory at once and writes it in a background thread
    (see ``write_durably``). Every node's first rank writes its own copy, named after the
    node, so that a snapshot survives the loss of any one node whether ``directory`` is shared
    or node-local; ``restore()`` (collective) loads the newest whole snapshot any rank can read
    and gives it to every rank, on any rank count. ``keep`` commits per writer are kept."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 sampler: ElasticSampler | None = None, directory: str = "snapshots",
                 keep: int = 2, writer: bool | None = None, **extras: Any):
        self.__dict__.update(_model=model, _optimizer=optimizer, _sampler=sampler,
                             _extras=dict(extras), directory=directory, keep=max(1, keep))
        if optimizer is not None and zero_stage_of(optimizer) == 3 and \
                model_of(optimizer) is not model:
            raise ValueError("elastic.State(model, optimizer) with DistributedOptimizer("
                             "zero_stage=3): pass the model the optimizer was built with "
                             "(DistributedOptimizer(..., model=model))")
        clash = set(extras) & set(dir(type(self)))
        if clash:
            raise ValueError(f"elastic.State: extras {sorted(clash)} would hide State's own "
                             "attributes; rename them")
        self.epoch, self.step, self.commits = 0, 0, 0
        self.writer = runtime.local_rank() == 0 if writer is None else writer
        self.host = socket.gethostname()
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # extras read and set as attributes
    def __getattr__(self, name: str):
        extras = self.__dict__.get("_extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"elastic.State has no attribute or extra {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__.get("_extras", {}):
            self._extras[name] = value
        else:
            object.__setattr__(self, name, value)      # properties (consumed) included

    @property
    def consumed(self) -> int:
        """Samples of the current epoch trained so far (from the sampler)."""
        return self._sampler.consumed if self._sampler is not None else 0

    @consumed.setter
    def consumed(self, value: int) -> None:
        if self._sampler is not None:
            self._sampler.consumed = value

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "commits": self.commits,
                "size": runtime.size(), "extras": self._extras,
                "model": self._model.state_dict(),
                "optimizer": self._optimizer.state_dict() if self._optimizer else None,
                "sampler": self._sampler.state_dict() if self._sampler else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step, self.commits = state["epoch"], state["step"], state["commits"]
        self._extras.update(state["extras"])
        self._model.load_state_dict(state["model"])
        if self._optimizer is not None and state["optimizer"] is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        if self._sampler is not None and state["sampler"] is not None:
            self._sampler.load_state_dict(state["sampler"])

    # ---- commit ---------------------------------------------------------------------------
    def commit(self) -> None:
        """Copy the state to host memory now; write it durably in the background. Call it at
        the same step on every rank (it is not collective, but restore needs every writer's
        copy to mean the same step). A write still pending is replaced by this newer one.
        With a ``DistributedOptimizer(zero_stage=1|2|3)`` it is a collective: the snapshot
        holds the whole optimizer state (at stage 3 the full parameters too), gathered bucket
        by bucket onto the writers only (the other ranks hold one bucket's at a time), so
        that a restore at any rank count re-shards it."""
        self._raise_write_error()
        self.commits += 1
        # (Consolidated for the snapshot only: afterwards the optimizer and model are as they
        # were.)
        with consolidated(self._optimizer, to=None, keep=self.writer) \
                if zero_stage_of(self._optimizer) else contextlib.nullcontext():
            if not self.writer:
                return
            snapshot = (self.commits, _to_host(self.state_dict()))
        if self._thread is None:
            os.makedirs(self.directory, exist_ok=True)
            self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                            name="mpiddp-snapshot-writer")
            self._thread.start()
        try:
            self._queue.get_nowait()            # drop an older one not yet started
            self._queue.task_done()
        except queue.Empty:
            pass
        self._queue.put(snapshot)

    def wait(self) -> None:
        """Block until every commit made so far is on disk."""
        if self._thread is not None:
            self._queue.join()
        self._raise_write_error()

    def _raise_write_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"elastic.State: writing a snapshot to {self.directory} "
                               f"failed: {error}") from error

    def _write_loop(self) -> None:
        while True:
            commits, state = self._queue.get()
            try:
                buffer = io.BytesIO()
                torch.save(state, buffer)
                path = os.path.join(self.directory, f"snapshot-{commits}-{self.host}.pt")
                write_durably(path, buffer.getvalue())
                self._prune()
            except BaseException as exc:       # reported by the next commit or wait
                self._error = exc
            finally:
                self._queue.task_done()

    def _prune(self) -> None:
        mine = sorted((n, p) for n, host, p in list_snapshots(self.directory)
                      if host == self.host)
        for _, path in mine[:-self.keep]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # ---- restore --------------------------------------------------------------------------
    def restore(self) -> bool:
        """Collective: load the newest snapshot any rank can read and give it to every rank
        (parameters and optimizer state then equal everywhere). False when there is none:
        the state is then only synchronised from rank 0."""
        self.wait()
        mine = _newest_readable(self.directory)
        found = allgather_object((mine[0] if mine else -1), name="elastic.restore.find")
        best = max(found)
        if best < 0:
            self.sync()
            return False
        root = found.index(best)
        state = mine[1] if runtime.rank() == root else None
        state = broadcast_object(state, root_rank=root, name="elastic.restore.state")
        self.load_state_dict(state)
        self.sync()
        return True

    def sync(self) -> None:
        """Collective: make every rank's state rank 0's."""
        if zero_stage_of(self._optimizer) == 3:
            # (The sharded parameters are gathered from every rank's chunk: the same
            # everywhere.)
            broadcast_parameters(kept_whole(self._optimizer, self._model), root_rank=0)
        else:
            broadcast_parameters(self._model.state_dict(), root_rank=0)
        if self._optimizer is not None and not zero_stage_of(self._optimizer):
            # (A sharded optimizer's shards are each rank's own: restore loaded the whole
            # state on every rank, each keeping its shard.)
            broadcast_optimizer_state(self._optimizer, root_rank=0)
        rest = broadcast_object({"epoch": self.epoch, "step": self.step,
                                 "commits": self.commits, "extras": self._extras,
                                 "sampler": self._sampler.state_dict() if self._sampler
                                 else None}, root_rank=0, name="elastic.sync")
        self.epoch, self.step, self.commits = rest["epoch"], rest["step"], rest["commits"]
        self._extras.update(rest["extras"])
        if self._sampler is not None:
            self._sampler.load_state_dict(rest["sampler"])


def list_snapshots(directory: str) -> list[tuple[int, str, str]]:
    """(commit number, host, path) of every finished snapshot file in ``directory``."""
    found = []
    for path in glob.glob(os.path.join(directory, "snapshot-*.pt")):
        match = SNAPSHOT_PATTERN.match(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), match.group(2), path))
    return found


def _newest_readable(directory: str):
    """(commit number, state) of the newest snapshot here that loads, or None. A file is
    renamed into place only once whole, but a disk may still corrupt it: try older ones."""
    for commits, _, path in sorted(list_snapshots(directory), reverse=True):
        try:
            return commits, torch.load(path, weights_only=False, map_location="cpu")
        except Exception:           # unreadable: fall back to an older snapshot
            continue
    return None
