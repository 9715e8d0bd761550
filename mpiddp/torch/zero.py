"""Sharded gradients and parameter gathers for ``DistributedOptimizer(zero_stage=1|2)``.

The parameters are laid out once in fixed buckets (``ShardLayout``): reverse parameter order,
the order backward makes gradients final, cut where a bucket reaches ``bucket_cap_mb`` (as
the standard path cuts its submissions). When every gradient of a bucket is final its
gradients are packed into one flat buffer and the engine reduce-scatters it around the ring in
the ring all-reduce's own order (``Request.ring_order``): rank r keeps chunk ``(r + 1) % N``,
holding the bits the ring all-reduce of that bucket would have left there.

Rank r's *shards* are 1-D views of the parameters' storage covering its chunk of each bucket;
the wrapped optimizer holds only those in its param groups, so it keeps state for them alone
and steps them in place. After the step each bucket's chunks are all-gathered into every
rank's parameters (``Gathers``): at once, or with ``overlap_forward`` just before each
parameter's first use in the next forward.

Stage 1 keeps the full-size local gradient in ``param.grad`` (backward accumulates into it);
stage 2 releases it as soon as it is packed for its bucket's reduction.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Optional

import torch

from .. import runtime
from ..collectives.ring import chunk_bounds, owned_chunk
from ..reduce_ops import ReduceOp
from .collectives import allreduce
from .forward_overlap import _Guard
from . import sharded_registry
from .gradient_sync import GradientSync, Pending
from .requests import reducescatter_entry, ring_allgather_entry, submit_together
from .streams import ready_event

# Buckets on the wire at once (reduce-scatters during backward; all-gathers after the step
# without forward overlap): the "two fusion buffers" of transient memory.
MAX_IN_FLIGHT = 2

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
        """Lay out ``params`` (new ones, in optimizer order) in new buckets."""
        current, current_bytes = [], 0
        for param in reversed(params):
            if current and (param.dtype != current[0].dtype
                            or param.device != current[0].device):
                self._close(current)
                current, current_bytes = [], 0
            current.append(param)
            current_bytes += param.numel() * self.wire_dtype_of(param).itemsize
            if current_bytes >= self.cap_bytes:
                self._close(current)
                current, current_bytes = [], 0
        if current:
            self._close(current)

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


class Reduction:
    """One bucket's reduce-scatter in flight, then its result (``settle``)."""

    __slots__ = ("bucket", "handle", "output", "flat", "parts", "nonfinite")

    def __init__(self, bucket, handle, output, flat):
        self.bucket, self.handle, self.output, self.flat = bucket, handle, output, flat
        self.parts: Optional[list] = None     # per piece: its averaged gradient
        self.nonfinite = False

    def settle(self, zero_stage: int) -> None:
        """Once reduced (waits otherwise): release the flat buffer, note any inf or nan, and
        cut the chunk into the pieces' gradients. Stage 1 writes them into ``param.grad``'s
        own elements (the full-size gradient is kept anyway), so that the chunk is freed as
        soon as the bucket is done, not at the end of backward."""
        if self.parts is not None:
            return
        self.handle.wait()
        self.flat = None
        output = self.output()
        self.output = None
        self.nonfinite = output.is_floating_point() and output.numel() > 0 and \
            not bool(torch.isfinite(output).all())
        parts = []
        with torch.no_grad():
            for piece in self.bucket.pieces:
                part = output[piece.chunk_offset:piece.chunk_offset + piece.shard.numel()]
                grad = piece.param.grad
                if zero_stage == 1 and grad is not None and not grad.is_sparse \
                        and grad.is_contiguous():
                    region = grad.view(-1)[piece.start:piece.stop]
                    region.copy_(part)
                    part = region
                elif part.dtype != piece.shard.dtype:
                    part = part.to(piece.shard.dtype)
                parts.append(part)
        self.parts = parts


class ShardedSync(GradientSync):
    """``GradientSync`` for ``zero_stage`` 1 and 2: hooks and rounds as on the standard path,
    but each bucket of gradients is reduce-scattered once complete, and a round writes the
    averaged shards into the shards' ``.grad`` (see the module docstring)."""

    def __init__(self, *args, zero_stage: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.zero_stage = zero_stage
        size = runtime.set_size(self.process_set)
        rank = runtime.set_rank(self.process_set)
        casts = self.wire_casts
        self.layout = ShardLayout(
            rank, size, self.bucket_cap,
            lambda p: casts.wire_dtype if casts.casts(p.dtype) else p.dtype)
        self.filling: dict[int, tuple] = {}      # bucket index -> (flat, queued set, events)
        self.in_flight: list[Reduction] = []
        self.complete: set[int] = set()          # buckets filled, waiting for their turn
        self.next_bucket = 0                     # the next bucket to submit, in layout order
        self.used: dict = {}                     # parameter -> had a gradient on this rank
        self.gather_buckets: list[Bucket] = []   # changed by the last round's shards
        self.gathers = Gathers(self)
        self.consolidated = None                 # (to, state dict) until the next step
        self.full_groups: list[list] = []        # the param groups' full parameters
        self.optimizer_ref = lambda: None        # weak: the optimizer whose groups hold shards
        sharded_registry.register(self)      # join() refuses while it lives

    def add(self, named) -> None:
        super().add(named)
        # Frozen parameters get shards when they are unfrozen (_adopt_unfrozen): laid out
        # now, their elements would take a share of every rank's chunk and leave the
        # trainable ones unevenly spread.
        self._lay_out([param for _, param in named if param.requires_grad])

    def _lay_out(self, params: list) -> None:
        self.layout.add(params)
        ref = weakref.ref(self)
        for param in params:
            for shard in self.layout.shards[param]:
                setattr(shard, SHARD_ATTR, ref)

    def _adopt_unfrozen(self) -> None:
        before = len(self.params)
        super()._adopt_unfrozen()
        new = self.params[before:]
        if not new:
            return
        self._lay_out(new)
        optimizer = self.optimizer_ref()
        if optimizer is not None:          # the shards join their param groups
            for group, full in zip(optimizer.param_groups, self.full_groups):
                if any(param in self.layout.shards for param in full):
                    group["params"] = [shard for param in full
                                       for shard in self.layout.shards.get(param, [])]

    # ---- packing and submitting -----------------------------------------------------------
    def _queue(self, param: torch.Tensor, zeros: bool = False) -> None:
        grad = None if zeros else param.grad
        if grad is not None and grad.is_sparse:
            grad = grad.to_dense()
        bucket = self.layout.bucket_of[param]
        flat, queued, events = self.filling.get(bucket.index) or (None, set(), [])
        # One parameter whose gradient can travel as it is: the gradient is the flat buffer,
        # handed over (stage 1 keeps it; its elements outside this rank's chunk then hold
        # partial sums).
        handed_over = flat is None and len(bucket.params) == 1 and grad is param.grad \
            and grad is not None and grad.dtype == bucket.wire_dtype and grad.is_contiguous()
        if flat is None:
            self._release_reduced()
            flat = grad.view(-1) if handed_over else \
                torch.empty(bucket.numel, dtype=bucket.wire_dtype, device=bucket.device)
            self.filling[bucket.index] = (flat, queued, events)
        if not handed_over:
            offset = bucket.offsets[param]
            if grad is not None:
                flat[offset:offset + param.numel()].copy_(grad.reshape(-1))
            else:
                flat[offset:offset + param.numel()].zero_()
        if grad is not None and self.zero_stage == 2:
            param.grad = None                # the full-size gradient is no longer needed
        event = ready_event(flat)
        if event is not None:
            events.append(event)
        self._finish_queue(param, bucket, grad is not None)

    def _finish_queue(self, param, bucket: Bucket, had_grad: bool) -> None:
        """``param`` is packed: note it, and submit its bucket once every member is."""
        self.used[param] = had_grad
        self.pending[param] = Pending(None, None, None, not had_grad)
        queued = self.filling[bucket.index][1]
        queued.add(param)
        if len(queued) >= sum(1 for p in bucket.params if p.requires_grad or p in queued):
            self.complete.add(bucket.index)
            self._submit_in_order()

    def _submit_in_order(self, end_of_step: bool = False) -> None:
        """Submit the complete buckets in layout order (a later one that is complete first
        waits for the earlier ones). Every rank then submits in the same order, which keeps
        the limit on buckets in flight (``_submit``) from ever waiting on a bucket another
        rank holds back. A bucket with nothing to reduce this step is passed over; at the
        end of the step (``end_of_step``) so is one nobody queued."""
        buckets = self.layout.buckets
        while self.next_bucket < len(buckets):
            bucket = buckets[self.next_bucket]
            if bucket.index in self.complete:
                self.complete.discard(bucket.index)
                self._submit(bucket)
            elif bucket.index in self.filling or \
                    (not end_of_step and any(p.requires_grad for p in bucket.params)):
                return
            self.next_bucket += 1

    def _submit(self, bucket: Bucket) -> None:
        # At most MAX_IN_FLIGHT buckets on the wire: each holds a full-size gradient buffer
        # until it is reduced, and a backward faster than the network would otherwise hold
        # them all (the whole gradient again).
        while sum(1 for r in self.in_flight if r.parts is None) >= MAX_IN_FLIGHT:
            oldest = next(r for r in self.in_flight if r.parts is None)
            try:
                oldest.settle(self.zero_stage)
            except BaseException:            # raised again where the round finishes
                break
        flat, queued, events = self.filling.pop(bucket.index)
        for param in bucket.params:          # frozen this step: nothing to add
            if param not in queued:
                offset = bucket.offsets[param]
                flat[offset:offset + param.numel()].zero_()
        if flat.is_cuda:
            stream = torch.cuda.current_stream(flat.device)
            for event in events:
                stream.wait_event(event)
        entry, output = reducescatter_entry(flat, f"{self.prefix}.zero{bucket.index}",
                                            self.op, self.prescale, self.postscale)
        entry.request = entry.request._replace(ring_order=True, shape=(bucket.numel,))
        handle = submit_together([entry], self.process_set)[0]
        self.in_flight.append(Reduction(bucket, handle, output, flat))

    def _release_reduced(self) -> None:
        """Drop the flat buffers of buckets already reduced (their result is in the
        engine's output): a bucket's full-size copy lives only while it is on the wire."""
        for reduction in self.in_flight:
            if reduction.parts is None and reduction.handle.done():
                try:
                    reduction.settle(self.zero_stage)
                except BaseException:        # raised again where the round finishes
                    pass

    def _flush(self, extra: tuple = ()) -> list:
        # Buckets go out from _queue when complete; only the usage vector comes here.
        return submit_together(list(extra), self.process_set) if extra else []

    def _has_gradient(self, param) -> bool:
        return self.used.get(param, param.grad is not None)   # stage 2 dropped param.grad

    def _submit_rest(self) -> None:
        self.complete.update(self.filling)       # members frozen this step: zeros
        self._submit_in_order(end_of_step=True)
        self.next_bucket = 0

    def _new_round(self, usage, usage_handle, position: dict) -> "ShardRound":
        round_ = ShardRound(self, self.in_flight, usage, usage_handle, position)
        self.in_flight, self.used = [], {}
        return round_


class ShardRound:
    """The reduce-scatters of one step: ``finish`` waits for them and points each shard's
    ``.grad`` at its part of the reduced chunk (None where no rank had a gradient). An inf or
    nan in any rank's chunk is made visible to every rank (``GradScaler`` then skips the step
    everywhere)."""

    def __init__(self, sync: ShardedSync, reductions, usage, usage_handle, position):
        self._sync = weakref.ref(sync)
        self.reductions, self.usage, self.usage_handle = reductions, usage, usage_handle
        self.position = position
        self.error: Optional[BaseException] = None
        self.items = {}       # the standard round's protocol: nothing per parameter here

    def finish(self, params=None) -> None:
        sync = self._sync()
        for item in [*(r.handle for r in self.reductions), self.usage_handle]:
            try:
                item.wait()
            except BaseException as exc:
                self.error = self.error or exc
        if self.error is not None:
            raise self.error
        nonfinite = False
        changed = []
        first_grad = None
        with torch.no_grad():
            for reduction in self.reductions:
                reduction.settle(sync.zero_stage)
                nonfinite = nonfinite or reduction.nonfinite
                bucket = reduction.bucket
                if any(self._used(p) for p in bucket.params):
                    changed.append(bucket)
                for piece, part in zip(bucket.pieces, reduction.parts):
                    piece.shard.grad = part if self._used(piece.param) else None
                    if first_grad is None and piece.shard.grad is not None:
                        first_grad = piece.shard.grad
            anywhere = allreduce(torch.tensor([float(nonfinite)]), op=ReduceOp.MAX,
                                 name=f"{sync.prefix}.nonfinite",
                                 process_set=sync.process_set)
            if bool(anywhere[0]) and not nonfinite and first_grad is not None:
                first_grad.view(-1)[0] = float("inf")     # so every rank skips the step
        sync.gather_buckets = changed

    def _used(self, param) -> bool:
        index = self.position.get(param)
        return index is not None and bool(self.usage[index])


class Gathers:
    """The all-gathers of updated parameters after a step, one per bucket, in forward order
    (the last bucket holds the first layers). Without forward overlap at most two are in
    flight and ``complete`` waits for all; with it they all start at ``step()`` and each
    parameter's bucket is completed when a torch call first touches the parameter (the guard
    of ``forward_overlap``)."""

    def __init__(self, sync: ShardedSync):
        self._sync = weakref.ref(sync)
        self.queue: collections.deque = collections.deque()     # buckets not yet started
        self.started: collections.deque = collections.deque()   # (bucket, handle, output)
        self.deferred = False                     # overlap_forward: complete on first use
        self.window = MAX_IN_FLIGHT               # without overlap (the memory they take)
        self.watched: dict[int, torch.Tensor] = {}
        self.busy = False
        self.forward_guarded = False
        self.guards: dict = {}
        self.lock = threading.RLock()

    def enable_overlap(self) -> None:
        self.deferred = True
        self.guard_this_thread()
        _live_gathers.add(self)

    def start(self, buckets: list) -> None:
        """Start gathering ``buckets`` after a step (the last ones first: forward order)."""
        self.complete()
        self.queue.extend(sorted(buckets, key=lambda b: -b.index))
        if self.deferred:
            self.guard_this_thread()
            self._start_more()
            self.watched = {id(p): p for bucket, _, _ in self.started for p in bucket.params}
        else:
            self.complete()

    def _start_more(self) -> None:
        """Start, in one submission (one engine cycle), the queued gathers that fit: every
        bucket of one parameter (gathered straight into it, its shard the chunk: no
        buffer) and, without forward overlap, others up to ``window`` buffers in flight."""
        sync = self._sync()
        buffered = sum(1 for _, _, output in self.started if output is not None)
        entries, started = [], []
        while self.queue:
            bucket = self.queue[0]
            single = len(bucket.params) == 1
            if not single and not self.deferred and buffered >= self.window:
                break
            self.queue.popleft()
            if single:
                output = bucket.params[0].detach().view(-1)
                chunk = bucket.pieces[0].shard if bucket.pieces else output[:0]
            else:
                pieces = [piece.shard for piece in bucket.pieces]
                chunk = torch.cat(pieces) if pieces else \
                    torch.empty(0, dtype=bucket.dtype, device=bucket.device)
                output = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
                buffered += 1
            entries.append(ring_allgather_entry(chunk, output,
                                                f"{sync.prefix}.gather{bucket.index}"))
            started.append((bucket, None if single else output))
        if entries:
            handles = submit_together(entries, sync.process_set)
            self.started.extend((bucket, handle, output)
                                for (bucket, output), handle in zip(started, handles))

    def complete(self, until: Optional[Bucket] = None) -> None:
        """Finish the gathers (all, or those started up to ``until``'s), unpacking each."""
        with self.lock, self.internal():
            while self.queue or self.started:
                if self.queue:
                    self._start_more()
                bucket, handle, output = self.started.popleft()
                handle.wait()
                if output is not None:
                    with torch.no_grad(), torch.inference_mode(False):
                        bucket.unpack_gathered(output)
                for param in bucket.params:
                    self.watched.pop(id(param), None)
                if bucket is until:
                    break

    @contextlib.contextmanager
    def internal(self):
        """Our own torch calls on watched parameters pass the guard: the gathers' unpacking,
        and ``zero_grad`` clearing their ``.grad`` (which must not complete the gathers the
        next forward is to overlap)."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    # ---- the forward_overlap guard's protocol --------------------------------------------
    def touched(self, params: list, what: str) -> None:
        """A torch call is about to use ``params``: finish their buckets' gathers (and the
        ones started before them, which the forward needs first)."""
        bucket_of = self._sync().layout.bucket_of
        wanted = {id(bucket_of[p]) for p in params if p in bucket_of}
        last = None
        for bucket, _, _ in self.started:
            if id(bucket) in wanted:
                last = bucket
        if last is not None:
            self.complete(until=last)

    def stop_for_compiled_code(self) -> None:
        for guard in self.guards.values():
            guard.inert = True
        self.deferred = False
        self.complete()

    def guard_this_thread(self) -> None:
        ident = threading.get_ident()
        if ident not in self.guards:
            guard = self.guards[ident] = _Guard(self)
            guard.__enter__()      # stays on this thread's mode stack, inert once we are gone


_live_gathers: "weakref.WeakSet[Gathers]" = weakref.WeakSet()


def _complete_all_gathers() -> None:
    """Before ``mpiddp.shutdown()``: finish every deferred gather of this process."""
    for gathers in list(_live_gathers):
        gathers.complete()


runtime.register_deferred_work(_complete_all_gathers)
