"""Hierarchical all-reduce: within a node over shared memory, across nodes over the network
only once per byte.

1. Node-local reduce-scatter (a ring over the node's ranks): local rank ``l`` ends with the
   node's sum of chunk ``l`` (1/local_size of the buffer).
2. Cross-node all-reduce of that chunk among the ranks with the same local rank (one per
   node): every byte of the buffer crosses the network once per direction, split over the
   node's ranks, instead of ``2 (N-1)/N`` times in a flat ring over all N ranks.
3. Node-local all-gather of the finished chunks.

Large buffers are pipelined: cut into segments, one segment's cross-node all-reduce is on the
wire while the node-local phases of its neighbours run (``pipeline_segments``), so the
node-local work hides behind the network instead of adding to it.

It needs the same number of ranks on every node (then the cross-node groups line up with the
chunks): ``Topology.hierarchical_usable`` says whether a communicator qualifies.
"""
from __future__ import annotations

import math

from ..buffers.dtypes import DType
from ..reduce_ops import ReduceOp
from ..transport import overlaps_transfers
from .flat import NATIVE, RING, flat_allreduce
from .ring import (allgather_steps, chunk_bounds, complete, reduce_scatter_steps,
                   ring_allreduce_steps)

# Pipelining: segments of at least this many bytes, at most this many of them. Measured on
# the emulated cluster (2 nodes x 2 ranks, 1 Gbit/s, docs/dev/benchmark-record.md): 64 MiB in
# 1 / 4 / 8 / 16 segments 588-610 / 575-590 / 567-572 / 563-571 ms (561 ms is TCP's rate);
# 16 MiB in 1 / 2 / 4 segments 149-153 / 144-147 / 142 ms.
PIPELINE_SEGMENT_BYTES = 4 * 1024 * 1024
MAX_PIPELINE_SEGMENTS = 16
# Every segment costs a full set of ring steps, each with a fixed cost in Python and MPI
# (tens of microseconds): segments stop where a cross-node ring step would carry less than
# this, so that on a fast network with many ranks the steps stay large next to their cost.
MIN_CROSS_STEP_BYTES = 1024 * 1024


def pipeline_segments(nbytes: int, local_size: int, cross, cross_ring_threshold: int) -> int:
    """Into how many segments to cut a hierarchical all-reduce of ``nbytes`` (1: none).

    Pipelining needs a cross-node transport that leaves transfers in flight
    (``overlaps_transfers``), and segments whose cross-node chunk still takes the ring
    (above ``cross_ring_threshold``): native ``MPI_Allreduce`` would block. Segments are at
    least ``PIPELINE_SEGMENT_BYTES``, at most ``MAX_PIPELINE_SEGMENTS``, and each cross-node
    ring step carries at least ``MIN_CROSS_STEP_BYTES``."""
    if not overlaps_transfers(cross):
        return 1
    ranks = local_size * cross.Get_size()
    segments = min(MAX_PIPELINE_SEGMENTS, nbytes // PIPELINE_SEGMENT_BYTES,
                   nbytes // (ranks * MIN_CROSS_STEP_BYTES))
    if segments < 2 or nbytes // segments // local_size <= cross_ring_threshold:
        return 1
    return segments


def scratch_elements(count: int, local_size: int, cross_size: int, segments: int) -> int:
    """Elements of scratch ``hierarchical_allreduce`` needs for a buffer of ``count``: the
    largest node-local chunk, and with segments, the cross-node ring's chunk beside it
    (a segment's node-local phase and the previous segment's cross-node ring overlap)."""
    if segments <= 1:
        return math.ceil(count / local_size)
    local_chunk = math.ceil(math.ceil(count / segments) / local_size)
    return local_chunk + math.ceil(local_chunk / cross_size)


def hierarchical_allreduce(local, cross, buf, scratch, dtype: DType, op: ReduceOp,
                           reduce_kernel, cross_algorithm: str = NATIVE, postprocess=None,
                           segments: int = 1) -> None:
    """All-reduce the flat ``buf`` in place over ``local`` x ``cross`` (see the module
    docstring). ``scratch`` holds ``scratch_elements(len(buf), ...)``.
    ``postprocess(chunk)`` (Average's scaling) runs on the one chunk this rank owns, before
    the all-gather. ``cross_algorithm`` (``flat.NATIVE`` or ``flat.RING``) reduces the chunk
    across nodes; ``segments`` > 1 (ring only) pipelines the phases (``pipeline_segments``)."""
    size, rank = local.Get_size(), local.Get_rank()
    if size == 1 or len(buf) == 0:
        flat_allreduce(cross, buf, scratch, dtype, op, cross_algorithm, reduce_kernel,
                       postprocess)
        return
    reduce_into = lambda dst, src: reduce_kernel(dst, src, op, dtype)   # noqa: E731
    if segments > 1:
        if cross_algorithm != RING:
            raise ValueError("a pipelined hierarchical all-reduce needs the cross-node ring")
        _pipelined(local, cross, buf, scratch, reduce_into, postprocess, segments)
        return
    bounds = chunk_bounds(len(buf), size)
    complete(reduce_scatter_steps(local, buf, scratch, bounds, reduce_into, owner_shift=-1))
    mine = buf[bounds[rank]:bounds[rank + 1]]          # this node's sum of chunk ``rank``
    flat_allreduce(cross, mine, scratch, dtype, op, cross_algorithm, reduce_kernel,
                   postprocess)
    complete(allgather_steps(local, buf, bounds, owner_shift=-1))


class _Segment:
    """One segment of a pipelined all-reduce: its part of the buffer, the node-local chunk
    bounds, and its cross-node ring (steps and the transfer in flight)."""

    def __init__(self, part, local_size: int):
        self.part = part
        self.bounds = chunk_bounds(len(part), local_size)
        self.steps = None
        self.transfer = None

    def start_cross(self, cross, rank: int, scratch, reduce_into, postprocess) -> None:
        mine = self.part[self.bounds[rank]:self.bounds[rank + 1]]
        self.steps = ring_allreduce_steps(cross, mine, scratch, reduce_into, postprocess)
        self.transfer = next(self.steps, None)

    def wait_cross(self) -> None:
        while self.transfer is not None:
            self.transfer.wait()
            self.transfer = next(self.steps, None)


def _pipelined(local, cross, buf, scratch, reduce_into, postprocess, segments: int) -> None:
    """The three phases per segment, overlapped: segment s's cross-node ring is in flight
    while this rank reduce-scatters segment s + 1 and all-gathers segment s - 1 within the
    node, so the network is busy nearly all the time (one segment on the wire at once)."""
    size, rank = local.Get_size(), local.Get_rank()
    seg_bounds = chunk_bounds(len(buf), segments)
    local_chunk = math.ceil(math.ceil(len(buf) / segments) / size)
    local_scratch, cross_scratch = scratch[:local_chunk], scratch[local_chunk:]
    previous = None
    for s in range(segments):
        segment = _Segment(buf[seg_bounds[s]:seg_bounds[s + 1]], size)
        complete(reduce_scatter_steps(local, segment.part, local_scratch, segment.bounds,
                                      reduce_into, owner_shift=-1))
        if previous is not None:
            previous.wait_cross()
        segment.start_cross(cross, rank, cross_scratch, reduce_into, postprocess)
        if previous is not None:
            complete(allgather_steps(local, previous.part, previous.bounds, owner_shift=-1))
        previous = segment
    previous.wait_cross()
    complete(allgather_steps(local, previous.part, previous.bounds, owner_shift=-1))
