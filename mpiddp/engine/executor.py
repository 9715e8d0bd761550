"""Executes the agreed, ordered responses of one cycle: fuses, reduces, unpacks, completes.

Every rank runs this on the identical response list, so every rank makes the identical
sequence of MPI calls. Ranks that have joined take part with zeros.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from mpi4py import MPI

from ..buffers import backend_for
from ..buffers.dtypes import DType, dtype_named, identity_value
from ..collectives.allreduce import allreduce_buffer, choose_algorithm
from ..collectives.native import allgatherv, alltoallv, broadcast
from ..collectives.ring import chunk_bounds, ring_reduce_scatter
from ..config import Settings
from ..errors import MpiddpError, TensorMismatchError
from ..ops import ReduceOp
from .fusion import BufferPool, plan_batches
from .request import ALLREDUCE, Entry, Response
from .stats import EngineStats
from .timeline import Timeline

# finish(entry, result_info=None, error=None): releases the name and completes the handle.
Finish = Callable[..., None]


def _post_factor(request, size: int) -> float:
    factor = request.postscale
    if request.op == ReduceOp.AVERAGE:
        factor /= size
    return factor


class Executor:
    def __init__(self, comm: MPI.Comm, settings: Settings, stats: EngineStats,
                 timeline: Timeline, finish: Finish):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.settings = settings
        self.stats = stats
        self.timeline = timeline
        self.finish = finish
        self.pool = BufferPool()
        # Adjustable at run time (set_allreduce_algorithm); start from the settings.
        self.algorithm = settings.allreduce_algorithm
        self.ring_threshold = settings.ring_threshold

    def run(self, responses: list[Response], entries: dict[str, Entry]) -> None:
        """Execute ``responses`` in order; ``entries`` maps names to this rank's entries
        (absent for a rank that has joined)."""
        for batch in plan_batches(responses, self.settings.fusion_threshold):
            first = batch[0]
            if first.error is not None:
                entry = entries.get(first.name)
                if entry is not None:
                    kind = TensorMismatchError if first.error_is_mismatch else MpiddpError
                    self.finish(entry, error=kind(first.error))
                self.stats.tensors += 1
                self.stats.errors += 1
                continue
            kind = first.request.kind
            if kind == ALLREDUCE:
                self._allreduce(batch, [entries.get(r.name) for r in batch])
            else:
                entry = entries.get(first.name)
                if entry is None:
                    raise MpiddpError(f"rank {self.rank} has no local request for agreed "
                                      f"{kind} '{first.name}'")
                self.timeline.record(first.name, "start")
                getattr(self, "_" + kind)(first, entry)
                self.timeline.record(first.name, "end")
                self.stats.tensors += 1

    # -- allreduce ------------------------------------------------------------------------
    def _allreduce(self, batch: list[Response], entries: list) -> None:
        request = batch[0].request
        dtype = dtype_named(request.dtype)
        backend = backend_for(request.device)
        counts = [r.request.numel for r in batch]
        total = sum(counts)
        for entry in entries:
            if entry is not None:
                backend.wait_ready(entry)
                self.timeline.record(entry.request.name, "start")
        if len(batch) == 1 and entries[0] is not None:
            # One tensor: reduce straight in its output memory, no fusion copy.
            buf = entries[0].output
            if entries[0].input is not buf:
                backend.copy(buf, entries[0].input)
        else:
            buf = self.pool.get(backend, request.device, dtype, "fusion", total)
            offset = 0
            for entry, count in zip(entries, counts):
                part = buf[offset:offset + count]
                if entry is None:
                    # A joined rank contributes the op's identity (zeros for sums).
                    backend.fill(part, identity_value(dtype, request.op))
                else:
                    backend.copy(part, entry.input)
                offset += count
        backend.scale_(buf, request.prescale, dtype)
        algorithm = choose_algorithm(self.algorithm, total * dtype.itemsize, self.ring_threshold)
        scratch = None
        if algorithm == "ring":
            scratch = self.pool.get(backend, request.device, dtype, "scratch",
                                    math.ceil(total / self.size))
        backend.before_mpi(request.device)
        factor = _post_factor(request, self.size)
        finish = None if factor == 1.0 else (lambda part: backend.scale_(part, factor, dtype))
        allreduce_buffer(backend.communicator(self.comm), buf, scratch, dtype, request.op,
                         algorithm, backend.reduce_into, finish)
        offset = 0
        for entry, count in zip(entries, counts):
            if entry is not None and entry.output is not buf:
                backend.copy(entry.output, buf[offset:offset + count])
            offset += count
        backend.after_unpack(request.device)
        end = time.perf_counter()
        for entry in entries:
            if entry is not None:
                self.timeline.record(entry.request.name, "end", end)
                self.finish(entry)
        stats = self.stats
        stats.tensors += len(batch)
        stats.allreduce_batches += 1
        stats.allreduce_bytes += total * dtype.itemsize
        if len(batch) > 1:
            stats.fused_batches += 1
            stats.fused_tensors += len(batch)
        stats.max_batch_tensors = max(stats.max_batch_tensors, len(batch))
        if algorithm == "ring":
            stats.ring_batches += 1
        else:
            stats.native_batches += 1

    # -- the other collectives (one tensor each) ------------------------------------------
    def _broadcast(self, response: Response, entry: Entry) -> None:
        request = response.request
        backend = backend_for(request.device)
        backend.wait_ready(entry)
        if self.rank == request.root and entry.input is not entry.output:
            backend.copy(entry.output, entry.input)
        backend.before_mpi(request.device)
        broadcast(backend.communicator(self.comm), entry.output, request.root)
        backend.after_unpack(request.device)
        self.finish(entry)

    def _allgather(self, response: Response, entry: Entry) -> None:
        request = response.request
        dtype = dtype_named(request.dtype)
        backend = backend_for(request.device)
        backend.wait_ready(entry)
        row = math.prod(request.shape[1:])
        output = entry.allocate((sum(response.sizes),) + tuple(request.shape[1:]))
        backend.before_mpi(request.device)
        allgatherv(backend.communicator(self.comm), entry.input, output,
                   [n * row for n in response.sizes], dtype.itemsize)
        backend.after_unpack(request.device)
        self.finish(entry)

    def _alltoall(self, response: Response, entry: Entry) -> None:
        request = response.request
        dtype = dtype_named(request.dtype)
        backend = backend_for(request.device)
        backend.wait_ready(entry)
        row = math.prod(request.shape[1:])
        matrix = response.sizes
        received = [matrix[src][self.rank] for src in range(self.size)]
        output = entry.allocate((sum(received),) + tuple(request.shape[1:]))
        backend.before_mpi(request.device)
        alltoallv(backend.communicator(self.comm), entry.input,
                  [n * row for n in matrix[self.rank]], output, [n * row for n in received],
                  dtype.itemsize)
        backend.after_unpack(request.device)
        self.finish(entry, info=tuple(received))

    def _reducescatter(self, response: Response, entry: Entry) -> None:
        request = response.request
        dtype: DType = dtype_named(request.dtype)
        backend = backend_for(request.device)
        backend.wait_ready(entry)
        row = math.prod(request.shape[1:])
        row_bounds = chunk_bounds(request.shape[0], self.size)   # rows of rank r's share
        bounds = [b * row for b in row_bounds]
        work = self.pool.get(backend, request.device, dtype, "fusion", request.numel)
        backend.copy(work, entry.input)
        backend.scale_(work, request.prescale, dtype)
        largest = max(bounds[i + 1] - bounds[i] for i in range(self.size))
        scratch = self.pool.get(backend, request.device, dtype, "scratch", largest)
        backend.before_mpi(request.device)
        ring_reduce_scatter(backend.communicator(self.comm), work, scratch, bounds,
                            lambda dst, src: backend.reduce_into(dst, src, request.op, dtype))
        mine = work[bounds[self.rank]:bounds[self.rank + 1]]
        rows = row_bounds[self.rank + 1] - row_bounds[self.rank]
        output = entry.allocate((rows,) + tuple(request.shape[1:]))
        backend.copy(output, mine)
        backend.scale_(output, _post_factor(request, self.size), dtype)
        backend.after_unpack(request.device)
        self.stats.allreduce_bytes += request.numel * dtype.itemsize
        self.finish(entry)

    def _barrier(self, response: Response, entry: Entry) -> None:
        # Agreement itself proves every rank reached the barrier: nothing left to move.
        if entry.action is not None:
            entry.action()
        self.finish(entry)
