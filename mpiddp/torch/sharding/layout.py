"""How a sharded optimizer's parameters are cut: fixed buckets in the order backward finishes
them, each bucket's flat buffer cut into the ring's chunks, and this rank's *pieces* (a
parameter's part in this rank's chunk) with their *shards* (1-D views of the parameter's
memory that the wrapped optimizer steps in place). See docs/dev/sharding.md."""
from __future__ import annotations

import collections

import torch

from ...collectives.ring import chunk_bounds, owned_chunk

# Buckets on the wire at once (reduce-scatters during backward; all-gathers after the step
# without forward overlap): the "two fusion buffers" of transient memory.
MAX_IN_FLIGHT = 2

# The first layers' bucket, as a fraction of bucket_cap_mb (ShardLayout.add).
FIRST_BUCKET_FRACTION = 1 / 8

SHARD_ATTR = "_mpiddp_shard_of"   # on a shard: weakref to the ShardedSync that made it

# A parameter's part in this rank's chunk of its bucket.
Piece = collections.namedtuple("Piece", "param start stop chunk_offset shard")


class Bucket:
    """Parameters reduced together: their offsets in the flat buffer, the ring's chunks of it
    and this rank's pieces of each parameter."""

    def __init__(self, index: int, params: list, rank: int, size: int, wire_dtype):
        self.index = index
        self.params = params
        self.offsets = {}
        total = 0
        for param in params:
            self.offsets[param] = total
            total += param.numel()
        self.numel = total
        self.dtype = params[0].dtype
        self.wire_dtype = wire_dtype
        self.device = params[0].device
        self.bounds = chunk_bounds(total, size)
        self.size = size
        own = owned_chunk(rank, size, ring_order=True)
        self.lo, self.hi = self.bounds[own], self.bounds[own + 1]
        self.pieces: list[Piece] = []
        for param in params:
            start = max(self.lo, self.offsets[param]) - self.offsets[param]
            stop = min(self.hi, self.offsets[param] + param.numel()) - self.offsets[param]
            if stop > start:
                shard = param.detach().view(-1)[start:stop]
                self.pieces.append(Piece(param, start, stop,
                                         self.offsets[param] + start - self.lo, shard))

    def unpack_gathered(self, gathered: torch.Tensor) -> None:
        """Write the gathered bucket (every rank's chunk, in bucket order) into the
        parameters."""
        for param in self.params:
            offset = self.offsets[param]
            param.detach().view(-1).copy_(gathered[offset:offset + param.numel()])


class ShardLayout:
    """The buckets of a sharded optimizer's parameters (see the module docstring)."""

    def __init__(self, rank: int, size: int, cap_bytes: int, wire_dtype_of):
        self.rank, self.size, self.cap_bytes = rank, size, cap_bytes
        self.wire_dtype_of = wire_dtype_of
        self.buckets: list[Bucket] = []
        self.bucket_of: dict = {}
        self.shards: dict = {}               # parameter -> its shards (0 or 1 here)

    def add(self, params: list) -> None:
        """Lay out ``params`` (new ones, in optimizer order) in new buckets. When they fill
        more than one bucket, the first parameters (the first layers: the last gradients of
        backward and the first parameters the next forward needs) get a bucket of
        ``FIRST_BUCKET_FRACTION`` of the cap of their own, so that the forward can start
        after a short reduce-scatter, step and gather instead of a full bucket's."""
        head = self._head(params)
        current, current_bytes = [], 0
        for param in reversed(params[len(head):]):
            if current and not self._fits(param, current):
                self._close(current)
                current, current_bytes = [], 0
            current.append(param)
            current_bytes += self._bytes(param)
            if current_bytes >= self.cap_bytes:
                self._close(current)
                current, current_bytes = [], 0
        if current:
            self._close(current)
        if head:
            self._close(list(reversed(head)))

    def _head(self, params: list) -> list:
        if sum(self._bytes(param) for param in params) <= self.cap_bytes:
            return []
        head, head_bytes = [], 0
        for param in params:
            if head and (head_bytes >= self.cap_bytes * FIRST_BUCKET_FRACTION
                         or not self._fits(param, head)):
                break
            head.append(param)
            head_bytes += self._bytes(param)
        return head if len(head) < len(params) else []

    def _bytes(self, param) -> int:
        return param.numel() * self.wire_dtype_of(param).itemsize

    @staticmethod
    def _fits(param, bucket: list) -> bool:
        """One dtype and device per bucket."""
        return param.dtype == bucket[0].dtype and param.device == bucket[0].device

    def _close(self, params: list) -> None:
        bucket = Bucket(len(self.buckets), list(params), self.rank, self.size,
                        self.wire_dtype_of(params[0]))
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket
            self.shards[param] = [piece.shard for piece in bucket.pieces
                                  if piece.param is param]

    def pieces(self):
        for bucket in self.buckets:
            yield from bucket.pieces
