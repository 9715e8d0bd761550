"""Gradient synchronization: hooks, reduction scheduling, and writing averaged gradients back.

``GradientSync`` is the distributed part of a ``DistributedOptimizer`` (``optimizer/wrap.py``
wraps the user's optimizer around it):

* a ``post_accumulate_grad`` hook on every trainable parameter queues an in-place all-reduce
  of its gradient the moment the gradient is final (after ``backward_passes_per_step``
  backward passes). Queued gradients go to the engine together as soon as they add up to
  ``bucket_cap_mb`` (and at the last gradient of the step), so the last layers' gradients
  travel while backward still computes the first layers', and one engine cycle covers
  several gradients (``bucket_cap_mb=0``: every gradient goes out on its own);
* ``synchronize()`` submits what is still missing (gradients of parameters that got none on
  this rank: zeros, so that every rank reduces the same names and nothing deadlocks), waits
  for every reduction and writes the averaged gradients into ``param.grad``. Parameters that
  no rank used keep ``grad=None`` (as in a single process, so optimizers skip them): a small
  usage bit-vector is all-reduced next to the last gradients;
* when that happens is the ``schedule``'s decision (``Schedule``), the seam where other
  schedules plug in. ``SynchronizeAtBackwardEnd``, the default, keeps DDP's contract: at
  the end of the backward pass that made the step's gradients final, a callback of the
  autograd engine synchronizes, so ``backward()`` returns with averaged gradients and code
  that reads or rewrites them before ``step()`` (GradScaler's ``unscale_`` and inf check,
  clipping) sees the averaged ones and never races with a reduction writing ``param.grad``.

Which parameters are reduced is decided at every synchronize: those that require a gradient
(or have one). A parameter frozen when the optimizer was built and unfrozen later
(``requires_grad_(True)``, gradual unfreezing) joins the reduction from then on; one frozen
later stops costing bandwidth. Every rank must freeze and unfreeze the same parameters at the
same step (a rank that differs is reported by the stall inspector, naming the tensor).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional, Protocol

import torch

from ... import runtime
from ...errors import MpiddpError
from ...reduce_ops import ReduceOp
from ...runtime import ProcessSet
from ..compression import WireCasts
from ..core.param_refs import ParameterRef
from ..core.streams import ready_event
from ..ops.async_ops import sparse_allreduce_async
from ..ops.handles import combined
from ..ops.handles import synchronize as wait_for
from ..ops.requests import allreduce_request_, contiguous, submit_together

# The autograd engine: queue_callback() runs a function once the current backward pass
# has finished (every gradient accumulated), on the thread that ran it.
_autograd_engine = torch.autograd.Variable._execution_engine

OWNER_ATTR = "_mpiddp_optimizer"   # on a parameter: weakref to the GradientSync reducing it


class Schedule(Protocol):
    """When the averaged gradients must be complete (see the module docstring)."""

    def end_of_backward(self, sync: "GradientSync") -> None:
        """Runs when a backward pass that made gradients final has finished."""

    def before_step(self, sync: "GradientSync") -> None:
        """Runs when ``step()`` is called (outside ``skip_synchronize()``), before the
        wrapped optimizer's step."""


class SynchronizeAtBackwardEnd:
    """DDP's contract: ``backward()`` returns with averaged gradients; ``step()`` only
    completes what gradients set by hand (or fewer passes than a step) left pending."""

    def end_of_backward(self, sync: "GradientSync") -> None:
        if sync.pending:
            sync.marks.record("backward_end")
            sync.synchronize()
            sync.marks.record("synchronized")

    def before_step(self, sync: "GradientSync") -> None:
        sync.synchronize()


class PhaseMarks:
    """The optimizer's phases (backward end, synchronized, step) on the engine's timeline
    while it records, for scripts/plot_timeline.py; nothing on a rank outside the optimizer's
    process set, where it is a plain local optimizer."""

    def __init__(self, prefix: str, process_set: Optional[ProcessSet]):
        self.prefix, self.process_set = prefix, process_set

    def record(self, phase: str) -> None:
        try:
            engine = runtime.engine_for(self.process_set, "DistributedOptimizer")[0]
        except ValueError:
            return
        if engine.timeline.enabled:
            engine.timeline.record(self.prefix, phase)


class Pending:
    """One gradient reduction in flight."""

    __slots__ = ("handle", "wire", "ctx", "local_zeros", "sparse", "cast_back", "ready")

    def __init__(self, handle, wire, ctx, local_zeros, sparse=False, cast_back=False,
                 ready=None):
        self.handle = handle          # TensorHandle of the all-reduce
        self.wire = wire              # the tensor being reduced (grad itself, or compressed)
        self.ctx = ctx                # compression context
        self.local_zeros = local_zeros  # this rank had no gradient: it contributed zeros
        self.sparse = sparse          # a sparse gradient reduced as dense: give back sparse
        self.cast_back = cast_back    # wire is a reused cast of param.grad: copy it back
        self.ready = ready            # CUDA: event on the stream that produced wire


class GradientSync:
    """Names, hooks and reductions in flight of one ``DistributedOptimizer`` (see the module
    docstring). Lives in the optimizer's ``__dict__`` as ``_mpiddp``; hooks reach it through
    a weak reference, so a dropped optimizer leaves only inert hooks behind."""

    def __init__(self, index: int, compression, backward_passes_per_step: int, op: ReduceOp,
                 gradient_predivide_factor: float, sparse_as_dense: bool, bucket_cap_mb: float,
                 process_set: Optional[ProcessSet], schedule: Optional[Schedule] = None):
        self.index = index
        self.prefix = f"opt{index}"
        self.compression = compression
        self.passes_per_step = backward_passes_per_step
        self.op = op
        self.prescale = 1.0 / gradient_predivide_factor
        self.postscale = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set                # the ranks the gradients average over
        self.schedule = schedule or SynchronizeAtBackwardEnd()
        self.marks = PhaseMarks(self.prefix, process_set)
        self.params: list[torch.Tensor] = []          # hooked parameters, in order
        self.names: dict[torch.Tensor, str] = {}      # parameter -> tensor name
        self.frozen: list[tuple[str, torch.Tensor]] = []  # not hooked yet (requires_grad off)
        self.trainable = 0                            # params reduced at the last synchronize
        self.extra_names: dict = {}                   # names for add_param_group
        self.hook_handles: list = []
        self.lock = threading.Lock()
        self.passes: dict[torch.Tensor, int] = {}     # backward passes seen this step
        self.bucket: list[torch.Tensor] = []          # queued, not yet submitted
        self.bucket_bytes = 0
        self.bucket_cap = int(bucket_cap_mb * 2 ** 20)
        self.pending: dict[torch.Tensor, Pending] = {}
        self.wire_casts = WireCasts(compression)
        self.synchronized = False
        self.skip_synchronize = False
        self.end_of_backward_queued = False
        # param -> all-reduce priority (1 = most urgent); empty: no priorities (standard path)
        self.priorities: dict[torch.Tensor, int] = {}
        self.piece_bytes = 0          # with priorities: gradients are cut into such pieces
        self.cycle_bytes = 0          # ... and a cycle runs this many bytes of them (0: the
                                      # engine's budget; forward overlap's sized pieces)
        # Called before prioritized gradients are submitted (forward overlap sizes the pieces
        # for the engine they go to).
        self.before_prioritized_flush: Optional[Callable[[], None]] = None

    def wire_bytes(self) -> int:
        """The bytes a step's gradients take on the wire (a built-in cast's dtype where one
        applies): what forward overlap's cycles are sized for. Every parameter that requires
        a gradient now, hooked or not yet adopted (unfrozen since the last round): the same
        on every rank whichever hook submits first."""
        casts = self.wire_casts
        def itemsize(param):
            return casts.wire_dtype.itemsize if casts.casts(param.dtype) \
                else param.element_size()
        params = self.params + [param for _, param in self.frozen]
        params = [param for param in params if param.requires_grad]
        return sum(param.numel() * itemsize(param) for param in params)

    # ---- registration -------------------------------------------------------------------
    def add(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, param in named:
            if param.requires_grad:
                self._hook(name, param)
            else:       # a hook needs requires_grad: hooked when unfrozen (_adopt_unfrozen)
                self.frozen.append((name, param))
        self.trainable = sum(1 for p in self.params if p.requires_grad)

    def _hook(self, name: str, param: torch.Tensor) -> None:
        ref = ParameterRef(self)
        self.params.append(param)
        self.names[param] = f"{self.prefix}.grad.{name}"
        setattr(param, OWNER_ATTR, ref)
        self.hook_handles.append(param.register_post_accumulate_grad_hook(_make_hook(ref)))

    def _adopt_unfrozen(self) -> None:
        """Hook the parameters that were frozen at construction and require a gradient now."""
        if any(param.requires_grad for _, param in self.frozen):
            still_frozen = []
            for name, param in self.frozen:
                if param.requires_grad:
                    self._hook(name, param)
                else:
                    still_frozen.append((name, param))
            self.frozen = still_frozen

    def _reduced_params(self) -> list[torch.Tensor]:
        """The parameters every rank reduces in this synchronize: trainable ones, and frozen
        ones that still hold a gradient (stepping with it unaveraged would split replicas) or
        whose reduction has started."""
        return [p for p in self.params
                if p.requires_grad or p.grad is not None or p in self.pending]

    # ---- called by the autograd hooks ---------------------------------------------------
    def on_gradient(self, param: torch.Tensor) -> None:
        with self.lock:
            if param in self.pending:
                # Only two backward passes running at once (threads) get here: each pass
                # finishes its reductions before it returns.
                raise RuntimeError(
                    f"the gradient of '{self.names[param]}' was computed again while its "
                    "reduction was still in flight: two backward passes through the same "
                    "parameters ran at the same time. Run them one after the other. This "
                    "step's gradients are not valid: call optimizer.zero_grad() before going on.")
            self.synchronized = False
            count = self.passes.get(param, 0) + 1
            self.passes[param] = count
            if count >= self.passes_per_step:
                self._queue(param)
                if self.bucket_bytes >= self.bucket_cap or len(self.pending) >= self.trainable:
                    self._flush()        # bucket full, or the last gradient of this step
                if not self.end_of_backward_queued:
                    _autograd_engine.queue_callback(self._end_of_backward)
                    self.end_of_backward_queued = True

    def _end_of_backward(self) -> None:
        """Runs once per backward pass in which a gradient became final."""
        self.end_of_backward_queued = False
        self.schedule.end_of_backward(self)

    def _queue(self, param: torch.Tensor, zeros: bool = False) -> None:
        """Make ``param``'s gradient ready for reduction (it goes out with the next flush)."""
        name = self.names[param]
        if zeros:
            grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        else:
            grad = param.grad
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    # Gather every rank's rows (Horovod's sparse path); it needs a sparse
                    # gradient on every rank (a rank without one would submit dense zeros).
                    item = Pending(sparse_allreduce_async(grad, name, self.op,
                                                          self.process_set), None, None, False)
                    self.pending[param] = item
                    return
                grad = grad.to_dense()
        sparse = not zeros and param.grad.is_sparse
        cast = None if zeros or sparse else self.wire_casts.cast(param, grad)
        wire, ctx = (cast, grad.dtype) if cast is not None else self.compression.compress(grad)
        # Reduce a plain copy of a non-contiguous gradient or a conjugate view (autograd's
        # for W.mH); _write_back copies the result back.
        wire = contiguous(wire)
        # Recorded here, in the gradient's hook on the stream that produced it: the bucket
        # may be flushed later, from another gradient's hook on another stream.
        self.pending[param] = Pending(None, wire, ctx, zeros, sparse, cast_back=cast is not None,
                                      ready=ready_event(wire))
        self.bucket.append(param)
        self.bucket_bytes += wire.numel() * wire.element_size()

    def _flush(self, extra: tuple = ()) -> list:
        """Submit the queued gradients (and ``extra`` entries) in one go: the engine takes them
        in the same cycle, so one negotiation covers them all and they fuse together. Returns
        the handles of the ``extra`` entries."""
        if not self.bucket and not extra:
            return []
        if self.priorities and self.before_prioritized_flush is not None:
            self.before_prioritized_flush()
        entries, items = [], []      # items: (Pending, how many entries it has)
        for param in self.bucket:
            item = self.pending[param]
            pieces = self._pieces(item.wire)
            priority = self.priorities.get(param, 0)
            name = self.names[param]
            for k, piece in enumerate(pieces):
                entries.append(allreduce_request_(
                    piece, name if len(pieces) == 1 else f"{name}#{k}", self.op,
                    self.prescale, self.postscale, priority=priority,
                    cycle_bytes=self.cycle_bytes, ready_event=item.ready))
            items.append((item, len(pieces)))
        self.bucket = []
        self.bucket_bytes = 0
        handles = submit_together(entries + list(extra), self.process_set)
        start = 0
        for item, count in items:
            parts = handles[start:start + count]
            item.handle = parts[0] if count == 1 else combined(parts)
            start += count
        return handles[start:]

    def _pieces(self, wire: torch.Tensor) -> list:
        """``wire``, or contiguous pieces of it of at most ``piece_bytes`` (prioritized
        reductions: an urgent gradient never waits on the wire behind a whole large one)."""
        size = wire.numel() * wire.element_size()
        if not self.piece_bytes or not self.priorities or size <= self.piece_bytes:
            return [wire]
        step = max(1, self.piece_bytes // wire.element_size())
        flat = wire.view(-1)
        return [flat[i:i + step] for i in range(0, flat.numel(), step)]

    # ---- synchronize ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Submit what is missing, wait for every reduction and write the results back."""
        round_ = self.start_round()
        if round_ is None:
            return
        try:
            round_.finish()
        finally:
            self.synchronized = round_.error is None

    def start_round(self) -> Optional["Round"]:
        """Submit what is missing (see ``synchronize``) and hand the reductions in flight over
        to a ``Round``, without waiting; None when nothing happened since the last round."""
        with self.lock:
            self._adopt_unfrozen()
            params = self._reduced_params()
            if not params or (self.synchronized and not self.pending and not self.passes):
                return None
            # Every rank must reduce the same names: submit what the hooks did not.
            for param in params:
                if param not in self.pending:
                    # no gradient on this rank (zeros), or fewer than backward_passes_per_step
                    self._queue(param, zeros=param.grad is None)
            self._submit_rest()
            usage, usage_handle = self._flush_with_usage(params)
            round_ = self._new_round(usage, usage_handle,
                                     {param: i for i, param in enumerate(params)})
            self.pending = {}
            self.passes = {}
            self.trainable = sum(1 for p in params if p.requires_grad)
            return round_

    def _submit_rest(self) -> None:
        """At the end of a step, before the usage vector: submit what the last flush does
        not (nothing here: the queued gradients go with it)."""

    def _new_round(self, usage, usage_handle, position: dict) -> "Round":
        # In the order of submission (the order ``pending`` was filled, bucket by bucket):
        # the order the reductions finish.
        return Round(self, self.pending, usage, usage_handle, position)

    def _has_gradient(self, param: torch.Tensor) -> bool:
        """Whether this rank had a gradient for ``param`` this step (the usage vector)."""
        return param.grad is not None

    def _write_back(self, param: torch.Tensor, item: Pending, used, error):
        """Wait for one reduction and put its result into ``param.grad``. ``used`` (for a
        gradient this rank did not have) is whether any rank had one. Returns the first
        error so far: after an error the others are still waited for (no stray writes
        later), and the first one is raised."""
        if item.handle is None:          # its submission failed (already raised)
            return error or MpiddpError(
                f"the gradient of '{self.names[param]}' was never submitted for "
                "reduction because of an earlier error")
        try:
            if item.wire is None:        # sparse: the handle returns the gradient
                param.grad = item.handle()
                return error
            wait_for(item.handle)
        except BaseException as exc:
            return error or exc
        if item.cast_back:               # one pass: cast and copy into the gradient
            param.grad.copy_(item.wire)
            return error
        grad = self.compression.decompress(item.wire, item.ctx)
        if item.local_zeros:
            if used:                     # no rank used this parameter: grad stays None
                param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
        elif item.sparse:                # sparse_as_dense: optimizers like SparseAdam need
            param.grad = grad.to_sparse()    # their gradients sparse again
        elif grad is not param.grad:
            param.grad.copy_(grad)
        return error

    def _flush_with_usage(self, params):
        """Flush the last gradients together with an all-reduce (logical or) of which
        parameters have a gradient on some rank; returns (usage, its handle)."""
        usage = torch.tensor([self._has_gradient(p) for p in params], dtype=torch.uint8)
        entry = allreduce_request_(usage, f"{self.prefix}.used", ReduceOp.MAX)
        return usage, self._flush(extra=(entry,))[0]

    def wait_all(self) -> None:
        """Complete reductions still in flight (the whole matched protocol, so the other
        ranks' collectives are answered too)."""
        if self.pending:
            self.synchronize()
        with self.lock:
            self.passes = {}


class Round:
    """The reductions of one step in flight, from ``GradientSync.start_round``: ``finish``
    waits for some or all of them and writes each result into ``param.grad``. Gradients this
    rank did not have wait for the usage vector (submitted with the last ones), which says
    whether any rank had one. After an error the rest are still waited for (no stray writes
    later) and the first error is raised."""

    def __init__(self, sync: GradientSync, items: dict, usage, usage_handle, position: dict):
        # Weak: forward overlap's schedule holds the round, the sync holds the schedule; a
        # cycle would keep a dropped optimizer's gradient hooks alive until the collector ran.
        self._sync = weakref.ref(sync)
        self.items: dict[torch.Tensor, Pending] = dict(items)   # not written back yet
        self.usage, self.usage_handle, self.position = usage, usage_handle, position
        self.usage_known = False
        self.error: Optional[BaseException] = None

    def __contains__(self, param) -> bool:
        return param in self.items

    def ready(self, param) -> bool:
        """Whether ``param``'s result can be written back without waiting."""
        item = self.items[param]
        if item.handle is None:
            return True                 # its submission failed: nothing to wait for
        if not item.handle.done():
            return False
        return not item.local_zeros or self.usage_handle.done()

    def finish(self, params=None) -> None:
        """Write back ``params`` (default: all that are left), in submission order: the casts
        and copies of the early ones overlap the later ones' transfers."""
        if params is None:
            chosen = list(self.items.items())
        else:
            chosen = [(p, self.items[p]) for p in params if p in self.items]
        sync = self._sync()     # alive: whoever finishes a round holds its optimizer
        with torch.no_grad():
            for param, item in chosen:
                if not item.local_zeros:
                    self.error = sync._write_back(param, item, None, self.error)
                    del self.items[param]
            if any(item.local_zeros for _, item in chosen) or not self.items:
                self._wait_usage()      # needed for zeros; and nothing stays in flight
            for param, item in chosen:
                if item.local_zeros:
                    used = self.error is None and bool(self.usage[self.position[param]])
                    self.error = sync._write_back(param, item, used, self.error)
                    del self.items[param]
        if self.error is not None and params is not None and self.items:
            self.finish()               # the first error ends the whole round
        if self.error is not None:
            raise self.error

    def _wait_usage(self) -> None:
        if not self.usage_known:
            self.usage_known = True
            try:
                wait_for(self.usage_handle)   # submitted with the last gradients
            except BaseException as exc:
                self.error = self.error or exc


def _make_hook(ref):
    def hook(param):
        sync = ref()
        if sync is not None:
            sync.on_gradient(param)
    return hook
