"""A sharded optimizer's collectives (``Request.ring_order``): its buckets' reduce-scatters and
all-gathers, cut as ``collectives/shard_grid.py`` says (flat, or by node).

One bucket goes in place: the reduce-scatter in the buffer the caller handed over, the
all-gather straight into the output. Several ready together (``plan_batches`` groups them as
it fuses all-reduces) share one pass: the fusion buffer's piece p holds every member's piece
p in batch order, so each member's elements meet the same ranks in the same order as in a
pass of its own (the same bits at any rank count), at the cost of one pass instead of one
each.
"""
from __future__ import annotations

from ..collectives.shard_grid import (RING_BY_NODE, RING_HYBRID, ShardGrid,
                                      sharded_allgather, sharded_reduce_scatter)
from ..errors import MpiddpError
from .operation import Job, Operation, allocate, result_scaling


def grid_for(ex, request) -> ShardGrid:
    """How ``request``'s buffer is cut on this engine's ranks."""
    if request.ring_order == RING_HYBRID:
        if not ex.topology.uniform:
            raise MpiddpError(f"'{request.name}' is sharded within nodes (hybrid), but the "
                              f"nodes of this communicator hold different numbers of ranks")
        return ShardGrid.hybrid(ex.topology)
    if request.ring_order != RING_BY_NODE:
        return ShardGrid.flat(ex.rank, ex.size)
    if not ex.topology.hierarchical_usable:
        raise MpiddpError(f"'{request.name}' is cut by node, but the ranks of this "
                          f"communicator are not the same number (more than one) on each of "
                          f"several nodes")
    return ShardGrid.by_node(ex.topology)


def communicators(ex, grid: ShardGrid, comm, backend) -> tuple:
    """(node-local, cross-node) transports for ``grid``: for a flat one the whole
    communicator's ``comm`` is the ring."""
    if grid.local_size == 1 and not grid.replicated:
        return None, comm
    links = ex.links(backend)
    return links.local, links.cross


class RingHalf(Operation):
    """The pieces' layout of one or several buckets (see the module docstring)."""

    def prepare(self, ex, backend, batch, entries) -> Job:
        """The grid, each member's piece bounds (``job.counts``) and the pass's
        (``job.bounds``: piece by piece, the members' sums)."""
        job = super().prepare(ex, backend, batch, entries)
        job.grid = grid = grid_for(ex, job.request)
        job.counts = [grid.bounds(r.request.numel) for r in batch]
        job.bounds = [sum(bounds[p] for bounds in job.counts) for p in range(grid.pieces + 1)]
        return job

    @staticmethod
    def pieces(job, piece: int):
        """(member, its slice, the pass buffer's slice) for every member's ``piece``."""
        at = job.bounds[piece]
        for member, bounds in enumerate(job.counts):
            length = bounds[piece + 1] - bounds[piece]
            yield member, slice(bounds[piece], bounds[piece + 1]), slice(at, at + length)
            at += length


class ReducescatterHalf(RingHalf):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        request, dtype = job.request, job.dtype
        if len(batch) == 1:
            job.buf = entries[0].input        # handed over: reduced in place, no copy
        else:
            job.buf = ex.pool.get(backend, request.device, dtype, "fusion", job.bounds[-1])
            for piece in range(job.grid.pieces):
                for member, own, fused in self.pieces(job, piece):
                    backend.copy(job.buf[fused], entries[member].input[own])
        backend.scale_(job.buf, request.prescale, dtype)
        job.scratch = ex.pool.get(backend, request.device, dtype, "scratch",
                                  job.grid.scratch_elements(job.bounds))
        return job

    def communicate(self, ex, job, comm, backend):
        op, dtype = job.request.op, job.dtype
        local, cross = communicators(ex, job.grid, comm, backend)
        sharded_reduce_scatter(job.grid, local, cross, job.buf, job.scratch, job.bounds,
                               lambda dst, src: backend.reduce_into(dst, src, op, dtype))

    def unpack(self, ex, job, backend):
        scale = result_scaling(backend, job.request, ex.size, job.dtype)
        for member, mine, fused in self.pieces(job, job.grid.owned):
            output = allocate(backend, job.entries[member], (mine.stop - mine.start,))
            backend.copy(output, job.buf[fused])
            if scale is not None:
                scale(output)


class AllgatherHalf(RingHalf):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        job.output = [allocate(backend, entry, (r.request.numel,))
                      for entry, r in zip(entries, batch)]
        # One bucket gathers straight into its output (the parameter itself, at stage 3).
        job.buf = job.output[0] if len(batch) == 1 else \
            ex.pool.get(backend, job.request.device, job.dtype, "fusion", job.bounds[-1])
        for member, mine, fused in self.pieces(job, job.grid.owned):
            if len(entries[member].input) != mine.stop - mine.start:
                raise MpiddpError(f"allgather '{batch[member].name}' in ring order: rank "
                                  f"{ex.rank}'s input is not its piece of the bucket")
            backend.copy(job.buf[fused], entries[member].input)
        return job

    def communicate(self, ex, job, comm, backend):
        local, cross = communicators(ex, job.grid, comm, backend)
        sharded_allgather(job.grid, local, cross, job.buf, job.bounds)

    def unpack(self, ex, job, backend):
        if len(job.output) == 1:
            return
        for piece in range(job.grid.pieces):
            for member, theirs, fused in self.pieces(job, piece):
                backend.copy(job.output[member][theirs], job.buf[fused])
