"""The parts every kind of collective shares (``executor.py``): the job an operation carries
from ``prepare`` to ``unpack``, the operation's three steps, and the output and scaling helpers."""
from __future__ import annotations

from typing import Optional

from ..buffers.dtypes import DType, dtype_named
from ..reduce_ops import ReduceOp


def result_scaling(backend, request, size: int, dtype):
    """The scaling after a reduction, as a function of one chunk (None: nothing to do): the
    user's postscale factor, then Average's division by ``size`` (rounded once)."""
    post, average = request.postscale, request.op == ReduceOp.AVERAGE
    if post == 1.0 and not average:
        return None

    def scale(part):
        backend.scale_(part, post, dtype)
        if average:
            backend.scale_(part, 1.0 / size, dtype, exact=True)
    return scale


def allocate(backend, entry, shape):
    """The entry's output, allocated by the torch layer on the stream that writes it."""
    with backend.allocating():
        return entry.allocate(shape)


class Job:
    """What one operation carries from ``prepare`` to ``unpack`` (fields as each kind needs)."""

    __slots__ = ("request", "dtype", "entries", "counts", "buf", "scratch", "output", "bounds",
                 "row_bounds", "algorithm", "segments", "infos", "grid")

    def __init__(self, request, dtype: Optional[DType], entries: list):
        self.request = request
        self.dtype = dtype
        self.entries = entries       # this rank's entries in batch order (None: joined)
        self.infos = None            # per-entry extra results for the handles
        self.algorithm = None        # allreduce: the strategy (collectives/algorithms.py)
        self.segments = 1            # allreduce: the pieces the algorithm cut the buffer in
        self.grid = None             # a sharded half: how its buffer is cut (ring_halves.py)


class Operation:
    """One kind of collective (see the module docstring). ``ex`` is the executor: its rank,
    size, settings and buffer pool."""

    def prepare(self, ex, backend, batch: list, entries: list) -> Job:
        return Job(batch[0].request, dtype_named(batch[0].request.dtype), entries)

    def communicate(self, ex, job: Job, comm, backend) -> None:
        """Move the data (every rank makes the same calls)."""

    def unpack(self, ex, job: Job, backend) -> None:
        """Results into the entries' outputs."""
