"""How a sharded optimizer's parameters are cut: fixed buckets in the order backward finishes
them, each bucket's flat buffer cut into one chunk per rank (flat, or by node:
``collectives/shard_grid.py``), and this rank's *pieces* (a parameter's part in this rank's
chunk) with their *shards* (1-D views of the parameter's memory that the wrapped optimizer
steps in place). See docs/dev/sharding.md."""
from __future__ import annotations

import collections
from typing import Optional

import torch

from ...collectives.shard_grid import ShardGrid

# Buckets on the wire at once (reduce-scatters during backward; all-gathers after the step
# without forward overlap): the "two fusion buffers" of transient memory.
MAX_IN_FLIGHT = 2

# ... and the reduce-scatters' full-size buffers on the wire at once, in bytes, when that is
# more than MAX_IN_FLIGHT buckets: two of the former default buckets (25 MiB). Small buckets
# then travel together (the engine fuses those ready in one cycle into one ring pass) instead
# of each waiting for the one before.
IN_FLIGHT_BYTES = 2 * 25 * 2 ** 20


def in_flight_limit(cap_bytes: int) -> int:
    """The bytes of reduce-scatters a sharded optimizer with buckets of ``cap_bytes`` keeps
    on the wire at once (one bucket at least, whatever its size)."""
    return max(MAX_IN_FLIGHT * cap_bytes, IN_FLIGHT_BYTES)

# The first layers' bucket, as a fraction of bucket_cap_mb (ShardLayout.add).
FIRST_BUCKET_FRACTION = 1 / 8

SHARD_ATTR = "_mpiddp_shard_of"   # on a shard: weakref to the ShardedSync that made it

# A parameter's part in this rank's chunk of its bucket.
Piece = collections.namedtuple("Piece", "param start stop chunk_offset shard")


class Bucket:
    """Parameters reduced together: their offsets in the flat buffer, its chunks (one per
    rank, as ``grid`` cuts it) and this rank's pieces of each parameter."""

    def __init__(self, index: int, params: list, grid: ShardGrid, wire_dtype):
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
        bounds = grid.bounds(total)
        self.ring_order = grid.ring_order      # how the engine cuts it (Request.ring_order)
        self.lo, self.hi = bounds[grid.owned], bounds[grid.owned + 1]
        # Stage 3 (own_storage): the full parameters' memory and this rank's chunk.
        self.flat: Optional[torch.Tensor] = None
        self.chunk: Optional[torch.Tensor] = None
        self.gathered = True          # the full parameters hold their values
        self.frozen = False           # stage 3: frozen parameters, never reduced
        # Stage 3 with mixed precision: the full parameters' dtype (``flat``), set before
        # own_storage; the chunk (the masters) keeps ``dtype``.
        self.param_dtype = self.dtype
        self.pieces: list[Piece] = []
        for param in params:
            start = max(self.lo, self.offsets[param]) - self.offsets[param]
            stop = min(self.hi, self.offsets[param] + param.numel()) - self.offsets[param]
            if stop > start:
                shard = param.detach().view(-1)[start:stop]
                self.pieces.append(Piece(param, start, stop,
                                         self.offsets[param] + start - self.lo, shard))

    # ---- stage 3: the bucket owns the parameters' memory (docs/dev/zero3.md) -------------
    def own_storage(self) -> None:
        """Move the parameters into one flat buffer of the bucket (``flat``; each parameter's
        ``.data`` a view of it: the same ``Parameter`` objects, shapes and values) and this
        rank's chunk into memory of its own (``chunk``, which the shards now view), so that
        ``release`` can free the full parameters and the shards survive it. With mixed
        precision (``param_dtype`` other than ``dtype``) ``flat`` is ``param_dtype`` (the
        parameters become tensors of that dtype) and ``chunk`` keeps ``dtype`` (the
        masters)."""
        masters = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for param in self.params:
                offset = self.offsets[param]
                masters[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
            self.chunk = masters[self.lo:self.hi].clone()
            flat = masters if not self.mixed else masters.to(self.param_dtype)
            del masters
            for param in self.params:
                offset = self.offsets[param]
                # ``.data =`` keeps the parameter's own version counter: writes into ``flat``
                # (gathers) never look like in-place changes to autograd.
                param.data = flat[offset:offset + param.numel()].view_as(param)
        self.flat = flat
        self.pieces = [piece._replace(shard=self.chunk[piece.chunk_offset:piece.chunk_offset
                                                       + piece.stop - piece.start])
                       for piece in self.pieces]
        self.gathered = True

    @property
    def mixed(self) -> bool:
        """Stage 3 with mixed precision: the full parameters are ``param_dtype`` copies of
        the masters (the chunks)."""
        return self.param_dtype != self.dtype

    @property
    def owns_storage(self) -> bool:
        return self.chunk is not None

    def release(self) -> None:
        """Free the full parameters' memory (their shapes stay; their data must not be read
        until ``materialise`` and a gather have refilled it)."""
        if self.gathered and self.owns_storage:
            self.flat.untyped_storage().resize_(0)
            self.gathered = False

    def materialise(self) -> torch.Tensor:
        """Give the full parameters their memory back (every view of it sees it again) and
        return the flat buffer for a gather to fill (its contents are undefined until then)."""
        storage = self.flat.untyped_storage()
        needed = self.numel * self.flat.element_size()
        if storage.nbytes() < needed:
            storage.resize_(needed)
        self.gathered = True
        return self.flat

    def unpack_gathered(self, gathered: torch.Tensor) -> None:
        """Write the gathered bucket (every rank's chunk, in bucket order) into the
        parameters."""
        for param in self.params:
            offset = self.offsets[param]
            param.detach().view(-1).copy_(gathered[offset:offset + param.numel()])


class ShardLayout:
    """The buckets of a sharded optimizer's parameters (see the module docstring)."""

    def __init__(self, grid: ShardGrid, cap_bytes: int, wire_dtype_of):
        self.grid, self.cap_bytes = grid, cap_bytes
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
        bucket = Bucket(len(self.buckets), list(params), self.grid,
                        self.wire_dtype_of(params[0]))
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket
            self.shards[param] = [piece.shard for piece in bucket.pieces
                                  if piece.param is param]

    def pieces(self):
        for bucket in self.buckets:
            yield from bucket.pieces

    def own_storage(self, buckets: list) -> None:
        """Stage 3: ``buckets`` own their parameters' memory (``Bucket.own_storage``); the
        shards of their parameters are views of their chunks from now on."""
        for bucket in buckets:
            bucket.own_storage()
            for param in bucket.params:
                self.shards[param] = [piece.shard for piece in bucket.pieces
                                      if piece.param is param]
