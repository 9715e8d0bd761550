"""Sharded gradients for ``DistributedOptimizer(zero_stage=1|2)``.

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

When a bucket's shards are stepped is ``StepTiming``'s rule (``core/step_timing.py``,
shared with Adasum), decided by the first ``step()`` and agreed by every rank:

* ``AT_STEP`` (the first step, and scripts that clip, use a ``GradScaler`` or synchronize by
  hand): the end of backward waits for every reduce-scatter (``ShardRound``); ``step()``
  steps every shard, then the gathers start.
* ``EARLY``: each bucket is stepped as soon as its reduce-scatter (and the small all-reduce
  of which of its parameters had a gradient on some rank) has landed, from the gradient hooks
  that come after it, and its gather is submitted at once, so the gathers travel during
  backward as the unsharded all-reduce's second half would. ``step()`` only steps what is
  left (with ``overlap_forward``: not even that; the next use of a parameter, ``zero_grad``
  or the next backward does it, with the hyperparameters recorded at ``step()``).

Stage 1 keeps the full-size local gradient in ``param.grad`` (backward accumulates into it);
stage 2 releases it as soon as it is packed for its bucket's reduction.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch


from ... import runtime
from ...reduce_ops import ReduceOp
from ..ops.collectives import allreduce
from ..gradients.sync import GradientSync, Pending
from ..core.step_timing import StepTiming
from ..ops.requests import allreduce_request_, reducescatter_entry, submit_together
from ..core.streams import ready_event
from ..core.subset_step import hyperparameters, same_hyperparameters
from .gathers import Gathers
from .param_gathers import ParamGathers
from .layout import SHARD_ATTR, Bucket, ShardLayout, in_flight_limit
from ..core.sharded_registry import register


def _wire_bytes(bucket: Bucket) -> int:
    return bucket.numel * bucket.wire_dtype.itemsize


class Reduction:
    """One bucket's reduce-scatter in flight, then its result (``settle``). Under the early
    schedule it comes with the all-reduce (MAX) of which of the bucket's parameters had a
    gradient on this rank (``usage``)."""

    __slots__ = ("bucket", "handle", "output", "flat", "parts", "nonfinite", "usage",
                 "usage_handle")

    def __init__(self, bucket, handle, output, flat, usage=None, usage_handle=None):
        self.bucket, self.handle, self.output, self.flat = bucket, handle, output, flat
        self.parts: Optional[list] = None     # per piece: its averaged gradient
        self.nonfinite = False
        self.usage, self.usage_handle = usage, usage_handle

    def done(self) -> bool:
        return self.handle.done() and (self.usage_handle is None or self.usage_handle.done())

    def handles(self) -> list:
        return [self.handle] + ([self.usage_handle] if self.usage_handle is not None else [])

    def settle(self, zero_stage: int, check_finite: bool = True) -> None:
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
        # (for GradScaler's agreement at the end of backward; the early schedule has none)
        self.nonfinite = check_finite and output.is_floating_point() and output.numel() > 0 \
            and not bool(torch.isfinite(output).all())
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

    def __init__(self, *args, zero_stage: int, hybrid: bool = False, mixed_precision=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.zero_stage = zero_stage
        casts = self.wire_casts
        # Stage 3's MixedPrecisionPolicy (mixed_precision.py): the gathered parameters'
        # dtype, and the gradients' on the wire (floating-point parameters only).
        self.mixed_precision = policy = mixed_precision
        self.param_dtype = policy.param_dtype if policy is not None else None
        reduce_dtype = policy.reduce_dtype or policy.param_dtype if policy is not None \
            else None

        def wire_dtype_of(p):
            if reduce_dtype is not None and p.dtype.is_floating_point:
                return reduce_dtype
            return casts.wire_dtype if casts.casts(p.dtype) else p.dtype
        self.layout = ShardLayout(
            runtime.shard_grid(self.process_set, hybrid), self.bucket_cap, wire_dtype_of)
        self.filling: dict[int, tuple] = {}      # bucket index -> (flat, queued set, events)
        self.missing: dict[int, int] = {}        # ... -> members requiring a gradient not queued
        self.in_flight: list[Reduction] = []
        self.complete: set[int] = set()          # buckets filled, waiting for their turn
        self.next_bucket = 0                     # the next bucket to submit, in layout order
        self.used: dict = {}                     # parameter -> had a gradient on this rank
        self.gather_buckets: list[Bucket] = []   # changed by the last round's shards
        self.gathers = ParamGathers(self) if zero_stage == 3 else Gathers(self)
        self.consolidated = None                 # (to, state dict) until the next step
        self.full_groups: list[list] = []        # the param groups' full parameters
        self.optimizer_ref = lambda: None        # weak: the optimizer whose groups hold shards
        self.schedule = ShardedSchedule()
        # The early schedule (module docstring).
        self.timing = StepTiming(f"DistributedOptimizer(zero_stage={zero_stage})")
        # The wrapped class's own step on some shards, with recorded hyperparameters (or the
        # current ones): set by the optimizer.
        self.step_shards: Callable[[list, Optional[list]], None] = lambda shards, options: None
        self.in_round = False                    # a gradient of this step was queued
        self.closing_early = False               # start_round is closing an early backward
        self.awaiting_step = False               # an early backward closed, step() not called
        self.step_options: Optional[list] = None  # recorded by step(): for the steps still due
        self.early_options: Optional[list] = None  # what this step's early steps used
        self.observed: Optional[tuple] = None    # AT_STEP, undecided: (gradient versions,
                                                 # hyperparameters) at the end of backward
        register(self)      # join() refuses while it lives

    def add(self, named) -> None:
        # Frozen parameters get shards when they are unfrozen (_adopt_unfrozen): laid out
        # now, their elements would take a share of every rank's chunk and leave the
        # trainable ones unevenly spread.
        trainable = [param for _, param in named if param.requires_grad]
        if getattr(self.gathers, "meta_init", None) is not None:
            # A model on the meta device gets its memory as it is laid out (meta_init.py),
            # which swaps the tensors behind the parameters: the hooks come after.
            self._lay_out(trainable)
            super().add(named)
            return
        super().add(named)
        self._lay_out(trainable)

    def _lay_out(self, params: list) -> None:
        before = len(self.layout.buckets)
        self.layout.add(params)
        if self.zero_stage == 3:    # the buckets own the parameters' memory from now on
            self.gathers.adopt(self.layout.buckets[before:])
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
    def on_gradient(self, param: torch.Tensor) -> None:
        # Our reads of parameters and gradients are no use of them (forward overlap's guard).
        with self.gathers.internal():
            super().on_gradient(param)

    def _queue(self, param: torch.Tensor, zeros: bool = False) -> None:
        if not self.in_round:
            self._start_step()
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
            self.missing[bucket.index] = sum(1 for p in bucket.params if p.requires_grad)
        if not handed_over:
            offset = bucket.offsets[param]
            if grad is not None:
                flat[offset:offset + param.numel()].copy_(grad.reshape(-1))
            else:
                flat[offset:offset + param.numel()].zero_()
        if grad is not None and self.zero_stage >= 2:
            param.grad = None                # the full-size gradient is no longer needed
        event = ready_event(flat)
        if event is not None:
            events.append(event)
        self._finish_queue(param, bucket, grad is not None)
        if self.timing.early and not zeros:
            self.advance()

    def _finish_queue(self, param, bucket: Bucket, had_grad: bool) -> None:
        """``param`` is packed: note it, and submit its bucket once every member is."""
        self.used[param] = had_grad
        self.pending[param] = Pending(None, None, None, not had_grad)
        self.filling[bucket.index][1].add(param)
        if param.requires_grad:
            self.missing[bucket.index] -= 1
        if self.missing[bucket.index] <= 0:       # every member that requires a gradient
            if self.zero_stage == 3:
                self.gathers.bucket_complete(bucket)
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
        # At most in_flight_limit bytes on the wire: each bucket holds a full-size gradient
        # buffer until it is reduced, and a backward faster than the network would otherwise
        # hold them all (the whole gradient again).
        limit = in_flight_limit(self.bucket_cap)
        while True:
            waiting = [r for r in self.in_flight if r.parts is None]
            if not waiting or sum(_wire_bytes(r.bucket) for r in waiting) + \
                    _wire_bytes(bucket) <= limit:
                break
            try:
                waiting[0].settle(self.zero_stage, not self.timing.early)
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
        # In submission order (no priority): the buckets are stepped in that order as their
        # reductions land, and their gathers (prioritized for the next forward) start then;
        # ranked by urgency, the last layers' reduce-scatters and usage vectors were put off
        # behind every newer bucket, and with them every gather, until the end of backward.
        entry.request = entry.request._replace(ring_order=self.layout.grid.ring_order,
                                               shape=(bucket.numel,))
        entries, usage = [entry], None
        if self.timing.early:
            # Which members had a gradient on some rank, known with the bucket itself: its
            # early step skips the others (their state, Adam's step count too, stays).
            usage = torch.tensor([self.used.get(p, False) for p in bucket.params],
                                 dtype=torch.uint8)
            entries.append(allreduce_request_(usage, f"{self.prefix}.zero{bucket.index}.used",
                                              ReduceOp.MAX))
        handles = submit_together(entries, self.process_set)
        self.in_flight.append(Reduction(bucket, handles[0], output, flat, usage,
                                        handles[1] if usage is not None else None))

    def _release_reduced(self) -> None:
        """Drop the flat buffers of buckets already reduced (their result is in the
        engine's output): a bucket's full-size copy lives only while it is on the wire."""
        for reduction in self.in_flight:
            if reduction.parts is None and reduction.handle.done():
                try:
                    reduction.settle(self.zero_stage, not self.timing.early)
                except BaseException:        # raised again where the round finishes
                    pass

    def _flush_with_usage(self, params):
        if self.closing_early:
            return None, None            # each bucket's usage travelled with it
        return super()._flush_with_usage(params)

    def _flush(self, extra: tuple = ()) -> list:
        # Buckets go out from _queue when complete; only the usage vector comes here.
        return submit_together(list(extra), self.process_set) if extra else []

    def _has_gradient(self, param) -> bool:
        return self.used.get(param, param.grad is not None)   # stage 2 dropped param.grad

    def _submit_rest(self) -> None:
        self.complete.update(self.filling)       # members frozen this step: zeros
        self._submit_in_order(end_of_step=True)
        self.next_bucket = 0

    def _start_step(self) -> None:
        """The first gradient of a step: what the last one left (early schedule) is done
        first; its gathers too, so that no bucket is stepped while its last gather is out."""
        self.in_round = True
        if self.awaiting_step or self.step_options is not None:
            self.finish_previous("backward")
        if self.timing.early and self.gathers.pending():
            self.gathers.complete()

    def _new_round(self, usage, usage_handle, position: dict):
        self.used = {}
        self.in_round = False
        if self.closing_early:
            return None                  # the reductions stay in in_flight, for advance()
        round_ = ShardRound(self, self.in_flight, usage, usage_handle, position)
        self.in_flight = []
        return round_

    # ---- the early schedule -------------------------------------------------------------
    def close_backward_early(self) -> None:
        """End of backward under the early schedule: submit what is left (as ``start_round``
        does) without waiting; the shards are stepped as their reductions land."""
        self.closing_early = True
        try:
            self.start_round()
        finally:
            self.closing_early = False
        self.synchronized = True
        self.awaiting_step = True
        self.advance()

    def advance(self, until: Optional[Bucket] = None, wait: bool = False) -> None:
        """Step the buckets whose reductions have landed (with ``wait``: all of them, or up to
        ``until``, waiting), in layout order, and start their gathers; unpack the gathers
        already done."""
        if not self.timing.early or not (wait or self.gathers.has_work() or (
                self.in_flight and self.in_flight[0].done())):
            return                # nothing to do: the common case, in every gradient hook
        with self.gathers.internal():
            while self.in_flight:
                reduction = self.in_flight[0]
                if not (wait or reduction.done()):
                    break
                self.in_flight.pop(0)
                self._step_early(reduction)
                if reduction.bucket is until:
                    break
            self.gathers.poll()
            if self.step_options is not None and not self.in_flight:
                self._end_early_step()

    def _step_early(self, reduction: Reduction) -> None:
        reduction.settle(self.zero_stage, not self.timing.early)
        reduction.usage_handle.wait()
        bucket = reduction.bucket
        used = {id(param) for param, flag in zip(bucket.params, reduction.usage) if flag}
        shards = []
        for piece, part in zip(bucket.pieces, reduction.parts):
            if id(piece.param) in used:
                piece.shard.grad = part
                shards.append(piece)
            else:
                piece.shard.grad = None
        if shards:
            optimizer = self.optimizer_ref()
            if self.early_options is None and optimizer is not None:
                self.early_options = hyperparameters(optimizer.param_groups)
            self.step_shards([piece.shard for piece in shards], self.step_options)
            for piece in shards:
                self.timing.note_stepped(self.names[piece.param], piece.shard.grad)
            self.consolidated = None
        if used:
            self.gathers.add(bucket)
        else:
            self.gathers.unwatch(bucket)

    def finish_previous(self, what: str) -> None:
        """Before ``what`` (zero_grad, the next backward, ...): step what the last backward
        left, with the hyperparameters recorded at ``step()``. Refused when ``step()`` was not
        called: its shards were already stepped during backward."""
        if self.awaiting_step:
            raise RuntimeError(
                f"{self.timing.owner}: {what} after a backward without step(). Under the "
                "early schedule (docs/sharding.md) each bucket is stepped during backward, as "
                "soon as its gradients are reduced, so a step cannot be skipped afterwards. "
                "Call step() after every backward (with backward_passes_per_step for "
                "accumulation), or call optimizer.synchronize() after backward from the first "
                "step on: every step then waits for step()")
        self.advance(wait=True)

    def record_step(self, optimizer) -> None:
        """``step()`` under the early schedule: check that nothing changed what the early
        steps used, and record the hyperparameters for the steps still due."""
        self.timing.check_untouched()
        now = hyperparameters(optimizer.param_groups)
        if self.early_options is not None and not same_hyperparameters(now, self.early_options):
            raise RuntimeError(
                f"{self.timing.owner}: the param groups' hyperparameters (learning rate, ...) "
                "changed between backward and step(), but buckets had already been stepped "
                "during backward with the old ones (the first step() showed no such change). "
                "Change them after step() (as LR schedulers do), or call "
                "optimizer.synchronize() after backward from the first step on")
        self.awaiting_step = False
        self.step_options = now
        if not self.in_flight:
            self._end_early_step()

    def _end_early_step(self) -> None:
        self.step_options = self.early_options = None
        self.timing.end_step()

    # ---- deciding the schedule ------------------------------------------------------------
    def observe(self, optimizer) -> None:
        """End of backward while the schedule is undecided: remember the shards' gradients'
        versions and the hyperparameters, to see at ``step()`` whether the script changed
        them (``decide``)."""
        grads = [piece.shard.grad for piece in self.layout.pieces()
                 if piece.shard.grad is not None]
        self.observed = ([(grad, grad._version) for grad in grads],
                         hyperparameters(optimizer.param_groups))

    def decide(self, optimizer, needs_whole: bool) -> None:
        """At the first ``step()`` (collective): every rank takes the early schedule unless
        one of them saw something that needs every shard's gradient first: a closure, the
        gradients changed or synchronized by hand (GradScaler, clipping), hyperparameters
        changed after backward."""
        if self.observed is not None:
            versions, options = self.observed
            needs_whole = needs_whole or any(grad._version != version
                                             for grad, version in versions) \
                or not same_hyperparameters(options, hyperparameters(optimizer.param_groups))
        needs_whole = needs_whole or self.timing.touched
        anyone = allreduce(torch.tensor([float(needs_whole)]), op=ReduceOp.MAX,
                           name=f"{self.prefix}.timing", process_set=self.process_set)
        self.timing.decide(needs_whole=bool(anyone[0]))
        self.observed = None


class ShardedSchedule:
    """The sharded optimizer's ``Schedule``: at the end of backward, the early schedule closes
    the round without waiting; otherwise every reduce-scatter is waited for (``ShardRound``)
    and, while the schedule is undecided, what the script does next is watched."""

    def end_of_backward(self, sync: ShardedSync) -> None:
        if not sync.pending:
            return
        sync.marks.record("backward_end")
        if sync.timing.early:
            sync.close_backward_early()
        else:
            sync.synchronize()
            optimizer = sync.optimizer_ref()
            if sync.timing.mode is None and optimizer is not None:
                sync.observe(optimizer)
        sync.marks.record("synchronized")

    def before_step(self, sync: ShardedSync) -> None:
        sync.synchronize()


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
        for item in [*(h for r in self.reductions for h in r.handles()), self.usage_handle]:
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
