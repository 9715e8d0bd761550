"""The all-gathers that bring every rank's updated shards into the parameters (see
``Gathers``)."""
from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Optional

import torch

from ... import runtime
from ..gradients.forward_overlap import _Guard
from ..ops.requests import ring_allgather_entry, submit_together
from .layout import MAX_IN_FLIGHT, Bucket


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

    def priority(self, bucket: Bucket) -> int:
        """With forward overlap, the engine runs the buckets' gathers by urgency: the first
        layers' (the last bucket) first, which the next forward needs first (0: in
        submission order). The reduce-scatters go in submission order (``ShardedSync``)."""
        if not self.deferred:
            return 0
        return len(self._sync().layout.buckets) - bucket.index

    def add(self, bucket: Bucket) -> None:
        """Early schedule: ``bucket`` was just stepped; its gather goes out now (without
        forward overlap, once fewer than ``window`` buffered ones are in flight)."""
        with self.lock:
            self.queue.append(bucket)
            self._start_more()

    def has_work(self) -> bool:
        """Whether ``poll`` has a gather to unpack."""
        return bool(self.started) and self.started[0][1].done()

    def poll(self) -> None:
        """Unpack the gathers already done (in the order started) and start queued ones: no
        waiting."""
        with self.lock, self.internal():
            while self.started and self.started[0][1].done():
                self._finish(0)
            if self.queue:
                self._start_more()

    def watch(self, buckets) -> None:
        """With forward overlap: a torch call touching a parameter of ``buckets`` completes
        its bucket first (``touched``)."""
        self.guard_this_thread()
        self.watched.update((id(p), p) for bucket in buckets for p in bucket.params)

    def pending(self) -> list:
        """The buckets whose gathers are queued or in flight."""
        return [started[0] for started in self.started] + list(self.queue)

    def unwatch(self, bucket: Bucket) -> None:
        for param in bucket.params:
            self.watched.pop(id(param), None)

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
            entry = ring_allgather_entry(chunk, output, f"{sync.prefix}.gather{bucket.index}",
                                         bucket.ring_order)
            entry.request = entry.request._replace(priority=self.priority(bucket))
            entries.append(entry)
            started.append((bucket, None if single else output))
        if entries:
            handles = submit_together(entries, sync.process_set)
            self.started.extend((bucket, handle, output)
                                for (bucket, output), handle in zip(started, handles))

    def complete(self, until: Optional[Bucket] = None) -> None:
        """Finish the gathers, unpacking each: all of them, or ``until``'s alone (without
        waiting for the ones started before it: with forward overlap the engine runs the
        first layers' first)."""
        with self.lock, self.internal():
            if until is None:
                self._sync().advance(wait=True)     # early schedule: what is left to step
                while self.queue or self.started:
                    if self.queue:
                        self._start_more()
                    self._finish(0)
                return
            while any(bucket is until for bucket in self.queue):
                self._start_more()
                if any(bucket is until for bucket in self.queue):
                    self._finish(0)             # the window is full: make room
            for index, started in enumerate(self.started):
                if started[0] is until:
                    self._finish(index)
                    break

    def _finish(self, index: int) -> None:
        """Wait for the ``index``-th gather started and unpack it into its parameters."""
        bucket, handle, output = self.started[index]
        del self.started[index]
        handle.wait()
        if output is not None:
            with torch.no_grad(), torch.inference_mode(False):
                bucket.unpack_gathered(output)
        self.unwatch(bucket)

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
        """A torch call is about to use ``params``: finish their buckets' gathers (under the
        early schedule, stepping them first if their reduce-scatters are still out)."""
        sync = self._sync()
        bucket_of = sync.layout.bucket_of
        wanted = {id(bucket_of[p]) for p in params if p in bucket_of}
        unstepped = [r.bucket for r in sync.in_flight if id(r.bucket) in wanted]
        if unstepped:       # their gathers start once they are stepped
            with self.lock, self.internal():
                sync.advance(until=unstepped[-1], wait=True)
        for bucket in self.pending():
            if id(bucket) in wanted:
                self.complete(until=bucket)
        for param in params:       # nothing left to wait for (no rank had its gradient)
            self.watched.pop(id(param), None)

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
