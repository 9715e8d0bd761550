"""Forward overlap: ``step()`` returns before the gradients are averaged, and each parameter is
updated just before the next forward (or anything else) uses it.

``DistributedOptimizer(..., overlap_forward=True)`` (or ``MPIDDP_OVERLAP_FORWARD=1``) makes
``ForwardOverlap`` the gradient schedule. A step goes through three phases:

1. **Backward.** Gradients are submitted as they become final, as on the standard path, each
   with a priority: its parameter's position in the optimizer (``named_parameters`` order,
   normally forward order), so the engine runs the first layers' gradients, which the next
   forward needs first, ahead of later ones (``Request.priority``). At the end of backward
   the rest is submitted and ``backward()`` returns without waiting.
2. **Before ``step()``.** The gradients are still being averaged. Anything that reads one
   (``clip_grad_norm_``, ``GradScaler.unscale_``, logging a gradient) makes this step fall
   back to the full synchronization, said once in the log: it needs every averaged gradient.
3. **After ``step()``.** ``step()`` records the optimizer's hyperparameters of this step
   (an LR scheduler may change them before the update runs) and returns. When a torch
   operation first touches a parameter (or its gradient), its reduction is waited for and the
   wrapped optimizer steps on that parameter, together with every other one whose reduction
   has already finished, with the recorded hyperparameters. Subsets of a step give the same
   values as the whole step: the optimizers' updates are elementwise per parameter.

Touches are seen by a ``TorchFunctionMode`` on the training thread (``_Guard``): every torch
function and tensor method on a watched tensor, in a module's forward or anywhere else
(functional use, tied or shared weights, ``state_dict()``, ``torch.no_grad()`` inference,
saving). What it cannot see is completed at the next safe point: the optimizer's own
``synchronize()``, ``state_dict()``, ``load_state_dict()``, ``add_param_group()``, the next
backward (a parameter no forward used), and ``mpiddp.shutdown()``. Inside torch.compile'd
code it sees nothing at run time (Dynamo traces it into the graph): the first compiled region
completes what is deferred and ends overlap for good (``_entering_compiled_code``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from ... import runtime
from ...reduce_ops import ReduceOp
from ..ops.collectives import allreduce
from .cycle_budget import device_piece_bytes, host_piece_bytes
from .sync import GradientSync, Round
from .overlap_trial import OverlapTrial
from ..core.subset_step import hyperparameters, step_subset

log = logging.getLogger("mpiddp")

# True while torch.compile traces (a constant in the traced code).
_compiling = torch.compiler.is_compiling

_live: "weakref.WeakSet[ForwardOverlap]" = weakref.WeakSet()
# Schedules holding a deferred update, held here until it has run: a script may drop its
# optimizer right after step() (to build another for the next phase), and the update must
# still land before the parameters are next used, not vanish with the optimizer.
_pending: "set[ForwardOverlap]" = set()


class DeferredStep:
    """A ``step()`` that has not run yet: the optimizer (kept alive until it has run), the
    hyperparameters of every param group at the time of the call, and the parameters still
    to update."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.options = hyperparameters(optimizer.param_groups)
        self.params: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.params[id(param)] = param
        self.clear_grads: Optional[bool] = None   # zero_grad() called: set_to_none or zero


class ForwardOverlap:
    """The forward-overlap schedule of one ``DistributedOptimizer`` (module docstring)."""

    def __init__(self, sync: GradientSync, optimizer_step: Callable[[], object],
                 auto: bool = False):
        # Weak: the sync holds this schedule, and a cycle would keep a dropped optimizer's
        # hooks submitting gradients until the garbage collector ran, at a different time
        # on each rank. (A deferred update keeps it all alive through ``_pending``.)
        self._sync = weakref.ref(sync)
        # auto: an OverlapTrial switches overlap on and off in the first steps, then decides.
        self.enabled = True
        self.trial = (OverlapTrial(self._agree, sync.prefix,
                                   speaks=runtime.set_rank(sync.process_set) == 0)
                      if auto else None)
        self.optimizer_step = optimizer_step      # the wrapped optimizer's own step()
        self._optimizer = lambda: None            # weak: set by attach()
        self.hook_handles: list = []
        self.round: Optional[Round] = None        # reductions in flight
        self.deferred: Optional[DeferredStep] = None
        self.watched: dict[int, torch.Tensor] = {}  # id(tensor) -> the parameter it guards
        self.busy = False                         # completing: our own torch calls pass
        self.fallback_logged = False
        self.deferred_steps = 0                   # steps that returned before their update
        # One guard per training thread (torch function modes are per thread); the builder's
        # thread gets one now, another thread at its first step().
        self.guards: dict[int, _Guard] = {}
        self.guard_this_thread()
        # Whether a guard saw torch calls since the last round started: the forward ran
        # where reads are seen. Checked at the end of backward, which may run on an
        # autograd device thread that cannot tell which thread called backward().
        self.forward_guarded = False
        # Pieces as large as a cycle's budget of prioritized bytes, one piece per cycle. Where
        # mpiddp sizes the budget (the user set none), the pieces are sized for this
        # optimizer's gradients and carry their cycle budget with them (Request.cycle_bytes,
        # cycle_budget.py): in device memory from a device all-reduce measured now, in host
        # memory from the links of each engine, at the first submission there.
        engine = runtime.engine_for(sync.process_set, "DistributedOptimizer()")[0]
        self.device_pieces = device_piece_bytes(sync.params, sync.prefix, sync.process_set,
                                                engine)
        sync.piece_bytes = self.device_pieces or engine.settings.priority_cycle_bytes
        sync.cycle_bytes = self.device_pieces or 0
        self.sized_engine = None                  # the engine the host pieces are sized on
        if not self.device_pieces:
            sync.before_prioritized_flush = self._size_host_pieces
        self.adopt_new_params()
        _live.add(self)

    def params_added(self) -> None:
        """``add_param_group`` (every rank, between steps, nothing in flight): size the pieces
        again, for the larger gradients, at the next submission."""
        self.sized_engine = None

    def attach(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    @property
    def sync(self) -> GradientSync:
        return self._sync()

    @property
    def optimizer(self):
        return self._optimizer()

    def adopt_new_params(self) -> None:
        """Priorities for every reduced parameter, in the optimizer's order (the first is the
        most urgent: the next forward needs it first), and a hook that completes a deferred
        update before backward accumulates a new gradient into the parameter (one no torch
        call touched in the forward, e.g. used only by a custom C++ op)."""
        hooked = set(map(id, self.sync.priorities))
        ref = weakref.ref(self)
        for param in self.sync.params:
            if id(param) not in hooked and param.requires_grad:
                self.hook_handles.append(param.register_hook(_before_accumulate(ref, param)))
        self.sync.priorities = {param: i + 1 for i, param in enumerate(self.sync.params)}

    # ---- the Schedule protocol ----------------------------------------------------------
    def end_of_backward(self, sync: GradientSync) -> None:
        if not sync.pending:
            return
        self.complete()          # parameters the last forward did not use
        if not self.enabled:     # auto chose the standard path (for now, or for good)
            sync.synchronize()
            return
        if not self.forward_guarded:
            self._log_fallback("the forward ran on a thread mpiddp does not guard yet (its "
                               "first step there)")
            sync.synchronize()
            return
        sync.marks.record("backward_end")
        self.forward_guarded = False
        self.round = sync.start_round()
        self._watch_gradients()

    def before_step(self, sync: GradientSync) -> None:
        self.complete()
        sync.synchronize()

    # ---- the optimizer's entry points -----------------------------------------------------
    def step(self, closure) -> bool:
        """Defer this step; False when it must run now (nothing in flight: the gradients
        were set by hand, or this step fell back to the full synchronization)."""
        if closure is not None:
            raise RuntimeError(
                "DistributedOptimizer(overlap_forward=True) cannot step with a closure: the "
                "closure evaluates the model while the update is deferred. Use "
                "overlap_forward=False with closure-based optimizers such as LBFGS.")
        if self.deferred is not None:              # step() twice without a forward between
            self.complete()
        self.guard_this_thread()
        if self.trial is not None:
            with self._internal():
                self._set_enabled(self.trial.on_step())   # for the next step
        if self.round is None:
            return False
        self.deferred = DeferredStep(self.optimizer)
        _pending.add(self)
        self.deferred_steps += 1
        watched = {}                # built apart: reading .grad is a watched torch call
        with self._internal():
            for param in self.deferred.params.values():
                watched[id(param)] = param
                if param.grad is not None:
                    watched[id(param.grad)] = param
            for item_param, item in self.round.items.items():
                if item.wire is not None:
                    watched[id(item.wire)] = item_param
        self.watched = watched
        # On the timeline the step ends here: its updates run inside the next forward, whose
        # span (with the reductions still on the wire beside it) is the picture of overlap.
        self.sync.marks.record("step_end")
        return True

    def _size_host_pieces(self) -> None:
        """Gradients in host memory, at each prioritized submission: the first on an engine
        (after every ``init()``, and after ``add_param_group``) sizes the pieces, and the
        cycles that carry them, for the gradients from that engine's links (the same on every
        rank; nothing to agree). Only where no gradient of the step has been cut yet on any
        rank: a size changed between two flushes of one step could cut one gradient into
        other pieces on one rank than on another (a gradient some ranks flush from its hook
        and others at the end of backward). Parameters unfrozen later are counted where they
        require a gradient at that first submission (``wire_bytes``), not after."""
        engine = runtime.engine_for(self.sync.process_set, "DistributedOptimizer")[0]
        if engine is self.sized_engine:
            return
        self.sized_engine = engine
        pieces = host_piece_bytes(self.sync.wire_bytes(), engine)
        if pieces:
            self.sync.piece_bytes = self.sync.cycle_bytes = pieces

    @contextlib.contextmanager
    def _internal(self):
        """Our own torch calls pass the guard."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    def zero_grad(self, set_to_none: bool, zero_now: Callable[[list], None]) -> bool:
        """Clear gradients without waiting for a deferred update: those of parameters still
        to update are cleared right after their update. False when there is nothing
        deferred (the caller clears as usual)."""
        if self.deferred is None:
            self.complete()
            return False
        self.deferred.clear_grads = set_to_none
        with self._internal():
            zero_now([p for group in self.optimizer.param_groups for p in group["params"]
                      if id(p) not in self.deferred.params])
        return True

    # ---- completing ---------------------------------------------------------------------
    def complete(self, params=None) -> None:
        """Finish the reductions and the deferred update of ``params`` (default: of all);
        every other parameter whose reduction is already done is updated in the same call."""
        if self.round is None and self.deferred is None:
            return
        # As step() would have run: not in the caller's inference mode (a first step there
        # would make the optimizer's state inference tensors no later step may update).
        with self._internal(), torch.inference_mode(False):
            if self.deferred is None:             # before step(): averaged gradients only
                round_, self.round, self.watched = self.round, None, {}
                round_.finish()
                self.sync.synchronized = True
                return
            self._update(params)

    def _update(self, params) -> None:
        deferred, round_ = self.deferred, self.round
        if params is None:
            chosen = list(deferred.params.values())
        else:
            # The touched parameters, and those at the front of the optimizer's order (the
            # order of urgency) whose results are already in: reductions finish roughly in
            # that order, so stopping at the first one still running keeps a forward's
            # touches linear in the number of parameters.
            wanted = {id(p) for p in params}
            chosen = [p for p in params if id(p) in deferred.params]
            for param in deferred.params.values():
                if id(param) in wanted:
                    continue
                if param in round_ and not round_.ready(param):
                    break
                chosen.append(param)
        try:
            round_.finish([p for p in chosen if p in round_])
        except BaseException:
            self._abandon()
            raise
        self._step_on(chosen)
        for param in chosen:
            del deferred.params[id(param)]
            self.watched.pop(id(param), None)
            if param.grad is not None:
                self.watched.pop(id(param.grad), None)
                if deferred.clear_grads is not None:
                    if deferred.clear_grads:
                        param.grad = None
                    else:
                        param.grad.detach_()
                        param.grad.zero_()
        if not deferred.params:
            self.deferred, self.round, self.watched = None, None, {}
            _pending.discard(self)      # the last use of the optimizer it may have held

    def _step_on(self, params: list) -> None:
        """Run the wrapped optimizer's step on ``params`` only, with the hyperparameters
        recorded at ``step()``."""
        step_subset(self.optimizer.param_groups, self.optimizer_step, params,
                    self.deferred.options)

    def _abandon(self) -> None:
        """A reduction failed: nothing deferred can be applied; the error is raised."""
        self.deferred, self.round, self.watched = None, None, {}
        _pending.discard(self)

    # ---- the guard ----------------------------------------------------------------------
    def touched(self, params: list, what: str) -> None:
        if self.deferred is None:
            self._log_fallback(f"'{what}' read a gradient before step() (clipping, "
                               "GradScaler.unscale_ or logging need every averaged gradient)")
        self.complete(params)

    def _watch_gradients(self) -> None:
        watched = {}
        if self.round is not None:
            with self._internal():
                for param, item in self.round.items.items():
                    for tensor in (item.wire, param.grad):
                        if tensor is not None:
                            watched[id(tensor)] = param
        self.watched = watched

    def guard_this_thread(self) -> None:
        ident = threading.get_ident()
        if ident not in self.guards:
            guard = self.guards[ident] = _Guard(self)
            guard.__enter__()      # stays on this thread's mode stack, inert once we are gone

    def _log_fallback(self, why: str) -> None:
        if not self.fallback_logged:
            self.fallback_logged = True
            log.warning("mpiddp forward overlap (%s): %s; such a step waits for every gradient "
                        "before step(), as without overlap_forward (said once)",
                        self.sync.prefix, why)

    def _set_enabled(self, enabled: bool) -> None:
        """Overlap the next step or not. Off means the standard path's requests too (no
        priorities, no pieces): every rank switches at the same step, so the changed requests
        are renegotiated once, in agreement."""
        if enabled != self.enabled:
            self.enabled = enabled
            if enabled:
                self.adopt_new_params()
            else:
                self.sync.priorities = {}

    def _agree(self, on: float, off: float) -> tuple:
        """The ranks' mean step times with and without overlap (one all-reduce)."""
        times = allreduce(torch.tensor([on, off], dtype=torch.float64), op=ReduceOp.AVERAGE,
                          name=f"{self.sync.prefix}.overlap_trial",
                          process_set=self.sync.process_set)
        return float(times[0]), float(times[1])

    def stop_for_compiled_code(self) -> None:
        """torch.compile'd code runs the forward (``_entering_compiled_code``): complete what
        is deferred and keep to the standard path from the next step on, said once."""
        sync = self.sync     # held: completing may drop a dropped optimizer's last reference
        for guard in self.guards.values():
            guard.inert = True
        self.trial = None
        with self._internal():
            self._set_enabled(False)
        self.complete()
        log.warning("mpiddp forward overlap (%s): a torch.compile'd region runs the forward; "
                    "a compiled graph reads every parameter inside it, where no update can be "
                    "made just before its use, so this optimizer steps on the standard path "
                    "from now on (the reductions still overlap backward)", sync.prefix)

    def update_is_deferred(self, param) -> bool:
        return self.deferred is not None and id(param) in self.deferred.params


def _before_accumulate(overlap_ref, param):
    param_ref = weakref.ref(param)

    def hook(grad):
        overlap, param = overlap_ref(), param_ref()
        if overlap is not None and param is not None and overlap.update_is_deferred(param):
            overlap.complete([param])
        return None
    return hook


class _Guard(TorchFunctionMode):
    """Sees every torch call on the thread that built the optimizer; a call on a watched
    tensor completes what that tensor is waiting for first."""

    def __init__(self, overlap: ForwardOverlap):
        super().__init__()
        self.overlap = weakref.ref(overlap)
        self.inert = False       # a compiled region met: the standard path from then on
        self.enter_compiled_code = _untraced_entry()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch.compile traces this method into its graphs, where nothing runs per call:
        # the first compiled region ends forward overlap (_entering_compiled_code), and the
        # graphs traced after that (Dynamo guards on ``inert``) pass every call through.
        if self.inert:
            return func(*args, **(kwargs or {}))
        if _compiling():
            self.enter_compiled_code(self)
            return func(*args, **(kwargs or {}))
        overlap = self.overlap()
        if overlap is None:
            return func(*args, **(kwargs or {}))
        overlap.forward_guarded = True
        if overlap.watched and not overlap.busy:
            hits = _watched_in(args, overlap.watched)
            if kwargs:
                hits += _watched_in(kwargs.values(), overlap.watched)
            if hits:
                overlap.touched(hits, getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@functools.cache
def _untraced_entry() -> Callable[[_Guard], None]:
    """``_entering_compiled_code`` under ``torch.compiler.disable``, made by the first guard:
    it imports torch._dynamo, seconds of CPU that every rank of every job paid at
    ``import mpiddp`` when this was a decorator."""
    return torch.compiler.disable(_entering_compiled_code)


def _entering_compiled_code(guard: _Guard) -> None:
    """Run (not traced: a graph break) where torch.compile'd code first meets the guard, before
    the compiled region's first torch call: a compiled graph reads every parameter inside
    itself, where no update can be made just before its use. So the deferred update, if
    any, completes now, and the optimizer steps on the standard path from now on (every rank
    compiles at the same point of the script)."""
    if guard.inert:
        return
    guard.inert = True
    overlap = guard.overlap()
    if overlap is not None:
        overlap.stop_for_compiled_code()


def _watched_in(values, watched: dict) -> list:
    hits = []
    for value in values:
        if isinstance(value, torch.Tensor):
            param = watched.get(id(value))
            if param is not None:
                hits.append(param)
        elif isinstance(value, (list, tuple)):
            hits += _watched_in(value, watched)
    return hits


def complete_all() -> None:
    """Complete every deferred update of this process (before ``mpiddp.shutdown()``)."""
    for overlap in list(_live):
        overlap.complete()


runtime.register_deferred_work(complete_all)
