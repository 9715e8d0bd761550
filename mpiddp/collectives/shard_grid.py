"""Where a sharded optimizer's bucket is cut, and its two ring halves over that cut.

A bucket of ``count`` elements is cut into one *piece* per rank. Flat (``ShardGrid.flat``):
the ring's chunks over all the ranks, rank ``r`` keeping chunk ``(r + 1) % N``, summed in the
ring all-reduce's order. By node (``ShardGrid.by_node``, several ranks on each of several
nodes): the bucket is cut into one chunk per local rank, each of those into one piece per
node, and rank (node ``c``, local rank ``l``) keeps piece ``(c + 1) % C`` of chunk ``l``: a
chunk of its node's chunk. The reduce-scatter then runs within the node first (local rank
``l`` ends with its node's sum of chunk ``l``) and across nodes on that chunk only, the
all-gather back the other way, so each byte crosses the network once per direction as in
the hierarchical all-reduce (``hierarchical.py``), instead of ``2 (N-1)/N`` times a flat
ring's share per node. Both sum each element in the order of the all-reduce with the same
cut (the flat ring, the hierarchical all-reduce with the cross-node ring).

Pieces are numbered chunk-major (``l * C + c``); with one rank per node the by-node cut is
the flat one. ``bounds`` are ``N + 1`` offsets in that numbering; the fused halves
(``engine/ring_halves.py``) sum several buckets' bounds piece by piece.

Hybrid (``ShardGrid.hybrid``, FSDP's ``HYBRID_SHARD``): sharded within the node and
replicated across nodes. The pieces are the node-local chunks; local rank ``l`` keeps chunk
``l`` on every node. The reduce-scatter runs within the node, then all-reduces chunk ``l``
across nodes (a ring: the hierarchical all-reduce's order again); the all-gather stays within
the node, so parameters never cross the network, and the cross-node bytes are the unsharded
path's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .ring import (ReduceInto, allgather_steps, chunk_bounds, complete, owned_chunk,
                   reduce_scatter_steps, ring_allreduce_steps)
from .topology import Topology

# Request.ring_order values: how a sharded half's buffer is cut (0: not a sharded half).
RING_FLAT = 1
RING_BY_NODE = 2
RING_HYBRID = 3


@dataclass(frozen=True)
class ShardGrid:
    """This rank's place among the pieces (see the module docstring)."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    replicated: bool = False        # hybrid: the same pieces on every node

    @classmethod
    def flat(cls, rank: int, size: int) -> "ShardGrid":
        return cls(0, 1, rank, size)

    @classmethod
    def by_node(cls, topology: Topology) -> "ShardGrid":
        return cls(topology.local_rank, topology.local_size, topology.cross_rank,
                   topology.cross_size)

    @classmethod
    def hybrid(cls, topology: Topology) -> "ShardGrid":
        return cls(topology.local_rank, topology.local_size, topology.cross_rank,
                   topology.cross_size, replicated=True)

    @property
    def ring_order(self) -> int:
        """The requests' ``ring_order`` for this cut."""
        if self.replicated:
            return RING_HYBRID
        return RING_BY_NODE if self.local_size > 1 else RING_FLAT

    @property
    def pieces(self) -> int:
        return self.local_size if self.replicated else self.local_size * self.cross_size

    @property
    def owned(self) -> int:
        """The piece this rank keeps."""
        if self.replicated:
            return self.local_rank
        return self.local_rank * self.cross_size + \
            owned_chunk(self.cross_rank, self.cross_size, ring_order=True)

    @property
    def replica(self) -> int:
        """Which copy of its piece this rank holds (0 but for hybrid's other nodes)."""
        return self.cross_rank if self.replicated else 0

    def bounds(self, count: int) -> list[int]:
        """The pieces' offsets in a bucket of ``count`` elements (``pieces + 1`` of them)."""
        local = chunk_bounds(count, self.local_size)
        if self.replicated:
            return local
        bounds = []
        for chunk in range(self.local_size):
            start = local[chunk]
            bounds.extend(start + b for b in chunk_bounds(local[chunk + 1] - start,
                                                          self.cross_size)[:-1])
        bounds.append(count)
        return bounds

    def local_bounds(self, bounds: Sequence[int]) -> list[int]:
        """The node-local chunks' offsets (each a run of ``cross_size`` pieces; hybrid: one)."""
        return list(bounds) if self.replicated else list(bounds[::self.cross_size])

    def cross_part(self, bounds: Sequence[int]) -> tuple[int, int, list[int]]:
        """(start, stop, pieces' offsets within it) of this rank's node-local chunk."""
        first = self.local_rank * self.cross_size
        start, stop = bounds[first], bounds[first + self.cross_size]
        return start, stop, [b - start for b in bounds[first:first + self.cross_size + 1]]

    def scratch_elements(self, bounds: Sequence[int]) -> int:
        """Scratch the reduce-scatter needs: the largest node-local chunk (or piece)."""
        local = self.local_bounds(bounds)
        return max(local[i + 1] - local[i] for i in range(self.local_size))


def sharded_reduce_scatter(grid: ShardGrid, local, cross, buf, scratch,
                           bounds: Sequence[int], reduce_into: ReduceInto) -> None:
    """Reduce ``buf`` in place so that this rank holds the sum of its piece
    (``grid.owned``); the other pieces hold partial sums afterwards. ``local`` and ``cross``:
    the node-local and cross-node communicators (``local`` unused for a flat grid, whose
    ``cross`` is the whole communicator)."""
    if grid.local_size > 1:
        complete(reduce_scatter_steps(local, buf, scratch, grid.local_bounds(bounds),
                                      reduce_into, owner_shift=-1))
    if grid.cross_size > 1 and grid.replicated:
        start, stop = bounds[grid.owned], bounds[grid.owned + 1]
        complete(ring_allreduce_steps(cross, buf[start:stop], scratch, reduce_into))
    elif grid.cross_size > 1:
        start, stop, pieces = grid.cross_part(bounds)
        complete(reduce_scatter_steps(cross, buf[start:stop], scratch, pieces, reduce_into,
                                      owner_shift=0))


def sharded_allgather(grid: ShardGrid, local, cross, buf, bounds: Sequence[int]) -> None:
    """Fill ``buf`` with every rank's piece, this rank's already in place: across nodes
    within this rank's node-local chunk, then the chunks within the node (hybrid: within the
    node only, every node holding every piece)."""
    if grid.cross_size > 1 and not grid.replicated:
        start, stop, pieces = grid.cross_part(bounds)
        complete(allgather_steps(cross, buf[start:stop], pieces, owner_shift=0))
    if grid.local_size > 1:
        complete(allgather_steps(local, buf, grid.local_bounds(bounds), owner_shift=-1))
