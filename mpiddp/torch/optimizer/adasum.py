"""``DistributedOptimizer(op=Adasum)``: Horovod's delta semantics, with GradScaler and
accumulation (docs/adasum.md).

Each rank steps its own optimizer on its own gradient, from the same starting parameters;
the parameter deltas (new - start) are combined with Adasum (``collectives/adasum.py``) and
added to the starting point, so every rank ends the step with the same parameters. The
optimizer's state (momentum, Adam's moments) stays each rank's own, as in Horovod.

When the local step runs is decided by the first step (``step_timing.py``, the rule the
sharded optimizers share):

* during backward (``EARLY``): as each parameter's gradient is final (its
  ``backward_passes_per_step``-th pass), that parameter alone is stepped and its delta
  submitted, so the reductions run while backward computes the earlier layers. Chosen when
  the first step showed nothing touching the gradients between backward and ``step()``.
* at ``step()`` (``AT_STEP``): every parameter is stepped together and the deltas are
  submitted at once. Chosen when the first step came through AMP's ``GradScaler`` (its
  gradients are scaled until it unscales them) or the script called ``synchronize()`` (to
  clip, say) — and for the first step itself, before it is known.

An inf or nan in any rank's gradients makes every rank skip the step: at the end of each
backward pass (``AT_STEP``) the ranks agree whether any has one, and each rank's
gradients then show it, so every rank's GradScaler skips the step and backs off alike.
Horovod's Adasum optimizer has no such agreement and steps inside backward (issue 3429).

Memory: a copy of a parameter's starting values only while its delta is in flight (from its
local step to the end of ``step()``); Horovod keeps one of every parameter for good.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch

from ...reduce_ops import ReduceOp
from ..ops.async_ops import allreduce_async, allreduce_async_
from ..ops.handles import synchronize
from ..core.subset_step import step_subset
from ..core.step_timing import StepTiming

_adasum_index = itertools.count()


class AdasumSync:
    """The Adasum optimizer's bookkeeping (one per ``DistributedOptimizer(op=Adasum)``)."""

    def __init__(self, named: list, compression, passes: int, process_set):
        self.prefix = f"adasum{next(_adasum_index)}"
        self.compression, self.passes, self.process_set = compression, passes, process_set
        self.names = {param: name for name, param in named}
        self.timing = StepTiming("DistributedOptimizer(op=Adasum)")
        self.counts: dict = {}                   # backward passes seen per parameter
        self.pending: dict = {}                  # param -> (handle, start, ctx, grad version)
        self.callback_queued = False
        self.hooks, self.hooks_for = [], set()

    def add(self, named) -> None:
        for name, param in named:
            if param.requires_grad and param not in self.hooks_for:
                self.names[param] = name
                self.hooks.append(param.register_post_accumulate_grad_hook(self.on_gradient))
                self.hooks_for.add(param)

    def name(self, param) -> str:
        return f"{self.prefix}.delta.{self.names[param]}"

    def on_gradient(self, param) -> None:
        """A parameter's gradient was accumulated (once per backward pass)."""
        count = self.counts.get(param, 0) + 1
        self.counts[param] = count
        if count > self.passes:
            raise RuntimeError(
                f"DistributedOptimizer(op=Adasum): the gradient of '{self.names[param]}' was "
                f"computed {count} times before step(), more than backward_passes_per_step="
                f"{self.passes}; call step() after that many backward passes")
        if not self.timing.early and not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.agree_on_nonfinite)
            self.callback_queued = True
        if self.timing.early and count == self.passes:
            self.local_step([param])

    def agree_on_nonfinite(self) -> None:
        """End of a backward pass: if any rank has an inf or nan gradient, make every rank's
        gradients show one (a collective: every rank runs backward, or has joined)."""
        self.callback_queued = False
        grads = [p.grad for p in self.names if p.grad is not None]
        mine = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if mine else 0.0])
        anyone = bool(synchronize(allreduce_async(
            flag, op=ReduceOp.MAX, name=f"{self.prefix}.nonfinite",
            process_set=self.process_set)).item())
        if anyone and not mine and grads:
            grads[0].view(-1)[:1] = float("nan")

    def local_step(self, params: list) -> None:
        """Step ``params`` on this rank's gradients alone, from the starting values, and
        submit their deltas (the wrapped optimizer's own step, on these parameters only)."""
        params = [p for p in params if p not in self.pending]
        if not params:
            return
        starts = {p: p.detach().clone() for p in params}
        self.step_only(params)
        for p in params:
            delta = p.detach()
            delta.sub_(starts[p])                          # p holds its delta until step()
            compressed, ctx = self.compression.compress(delta)
            handle = allreduce_async_(compressed, op=ReduceOp.ADASUM, name=self.name(p),
                                      process_set=self.process_set)
            self.timing.note_stepped(self.names[p], p.grad)
            self.pending[p] = (handle, starts[p], compressed, ctx)

    step_only: Any          # set by the optimizer: its own step on a subset of parameters

    def finish(self) -> None:
        """Wait for every delta's Adasum and set each parameter to start + combined delta."""
        try:
            for p, (handle, start, compressed, ctx) in self.pending.items():
                result = self.compression.decompress(synchronize(handle), ctx)
                with torch.no_grad():
                    p.copy_(start.add_(result.to(start.dtype)))
        finally:
            self.pending = {}

    def abandon(self) -> None:
        """A skipped step: collect the reductions in flight, put the starting values back."""
        try:
            for p, (handle, start, compressed, ctx) in self.pending.items():
                synchronize(handle)
                with torch.no_grad():
                    p.copy_(start)
        finally:
            self.pending = {}


class _AdasumOptimizer:
    """Methods placed in front of the user's optimizer class for ``op=Adasum``."""

    # GradScaler then hands step() the scale and its inf check instead of stepping itself.
    _step_supports_amp_scaling = True

    def synchronize(self) -> None:
        """With Adasum each rank steps on its own gradient: there is nothing to average
        before ``step()``. Calling it (before clipping, say) keeps the local steps in
        ``step()``, after your changes to the gradients, from the first step on."""
        sync = self._mpiddp_adasum
        sync.timing.touch()
        if sync.timing.early and sync.pending:
            sync.timing.check_untouched()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for scripts written for the averaging optimizer: nothing to skip."""
        yield

    def step(self, closure=None):
        sync = self._mpiddp_adasum
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # GradScaler's, when it called: kept from the wrapped class's step (which would take
        # them for its own fused unscaling) and put back for the scaler, which deletes them.
        scale = self.__dict__.pop("grad_scale", None)
        found_inf = self.__dict__.pop("found_inf", None)
        amp = found_inf is not None
        if sync.timing.mode is None:
            sync.timing.decide(needs_whole=amp)
        elif sync.timing.early:
            if amp:
                raise RuntimeError(
                    "DistributedOptimizer(op=Adasum): a GradScaler stepped this optimizer, "
                    "but the first step did not use one, so the local steps run during "
                    "backward on gradients the scaler has not unscaled. Use the GradScaler "
                    "from the first step on")
            sync.timing.check_untouched()
        local_inf = float(found_inf.sum()) if amp else 0.0
        skip = amp and bool(synchronize(allreduce_async(
            torch.tensor([local_inf]), op=ReduceOp.MAX, name=f"{sync.prefix}.skip",
            process_set=sync.process_set)).item())
        try:
            if skip:
                sync.abandon()
                return loss
            if scale is not None:                # scaled gradients: unscale them first
                inverse = (1.0 / scale.double()).float()
                for p in sync.names:
                    if p.grad is not None:
                        p.grad.mul_(inverse.to(p.grad.device))
            sync.local_step([p for p in sync.names if p.requires_grad])
            sync.finish()
        finally:
            sync.counts = {}
            sync.timing.end_step()
            if amp:
                self.__dict__.update(grad_scale=scale, found_inf=found_inf)
        return loss

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        sync = self.__dict__.get("_mpiddp_adasum")
        if sync is not None:
            sync.add([(f"group{len(self.param_groups) - 1}.{i}", p)
                      for i, p in enumerate(self.param_groups[-1]["params"])])


_CLASSES: dict = {}


def adasum_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_AdasumOptimizer, base),
                                    {"__module__": base.__module__})
    return cls


def wrap_adasum(optimizer: torch.optim.Optimizer, named: list, compression, passes: int,
                process_set) -> torch.optim.Optimizer:
    """The Adasum DistributedOptimizer over ``optimizer`` (arguments checked by the caller)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("DistributedOptimizer(op=Adasum) cannot wrap LBFGS: its step "
                         "evaluates the model again (a closure), which a per-rank local step "
                         "cannot share; use op=Average")
    sync = AdasumSync(named, compression, passes, process_set)
    cls = adasum_class(type(optimizer))
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__       # one optimizer, two views: state is shared

    def step_only(params: list) -> None:
        """The wrapped class's own step on ``params`` only (hyperparameters, a scheduler's
        learning rate included, untouched)."""
        step_subset(wrapped.param_groups, super(_AdasumOptimizer, wrapped).step, params)

    sync.step_only = step_only
    wrapped.__dict__["_mpiddp_adasum"] = sync
    if process_set is None or process_set.included():
        sync.add(named)
    return wrapped
