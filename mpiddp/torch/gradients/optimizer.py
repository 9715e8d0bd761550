"""The methods ``DistributedOptimizer`` puts in front of the user's optimizer class (see
``optimizer/wrap.py``), and the checks they share with it and with the sharded optimizer
(``sharding/optimizer.py``)."""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Optional

import torch

from ... import runtime
from ...errors import TensorMismatchError
from ...reduce_ops import ReduceOp
from ..ops.collectives import allreduce
from ..ops.functions import allgather_object
from .forward_overlap import ForwardOverlap
from .sync import GradientSync


# step() inside skip_synchronize() while reductions are in flight (here and sharding/optimizer.py).
STEP_WHILE_IN_FLIGHT = ("optimizer.step() inside skip_synchronize() while gradient reductions "
                        "are still in flight: call optimizer.synchronize() before the block")


class _DistributedOptimizer:
    """Methods placed in front of the user's optimizer class (see ``DistributedOptimizer``)."""

    def synchronize(self) -> None:
        """Wait until every gradient is averaged across ranks and written to ``param.grad``.

        ``backward()`` already does this at its end; call it for gradients that did not come
        from ``backward()`` (set by hand, or fewer than ``backward_passes_per_step`` passes),
        then call ``step()`` inside ``skip_synchronize()``. A collective when there is
        something to reduce: every rank must call it. Submits zeros for trainable parameters
        without a gradient on this rank; a parameter no rank has a gradient for keeps
        ``grad=None``. Returns at once when nothing happened since the last synchronize.

        Raises:
            TensorMismatchError: the ranks' gradients differ in shape or dtype.
            EngineShutdownError: the engine stopped (or was shut down) before the
                reductions finished.
            MpiddpError: a gradient's reduction could not be submitted because of an
                earlier error.
            RuntimeError: a sparse gradient without ``sparse_as_dense=True``.
        """
        _complete_overlap(self._mpiddp)
        self._mpiddp.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Context manager: ``step()`` inside this block does not synchronize (you called
        ``synchronize()`` yourself)::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        Raises:
            RuntimeError: from ``step()`` inside the block, when reductions are still in
                flight (``synchronize()`` was not called first).
        """
        sync = self._mpiddp
        previous, sync.skip_synchronize = sync.skip_synchronize, True
        try:
            yield
        finally:
            sync.skip_synchronize = previous

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before a reduction.

        Completes the reductions in flight first (a collective if there are any). Every
        rank must make the same change at the same point: it is not checked across ranks.

        Args:
            passes: the new number of backward passes per step, ``>= 1``.

        Raises:
            ValueError: ``passes`` is not a positive integer.
            MpiddpError: the reductions in flight failed (see ``synchronize``).
        """
        _check_passes(passes)
        _complete_overlap(self._mpiddp)
        self._mpiddp.wait_all()
        self._mpiddp.passes_per_step = passes

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before one reduction (read-only; see
        ``set_backward_passes_per_step``)."""
        return self._mpiddp.passes_per_step

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Synchronize the gradients (unless inside ``skip_synchronize()``), then run the
        wrapped optimizer's ``step``.

        Args:
            closure: as for the wrapped optimizer (e.g. LBFGS). Gradients are averaged after
                every evaluation; the loss it returns, when a one-element floating-point
                tensor, is averaged across ranks so that every rank takes the same
                decisions. Default None.

        Returns:
            What the wrapped optimizer's ``step`` returns.

        Raises:
            RuntimeError: inside ``skip_synchronize()`` while reductions are in flight.
            MpiddpError: a reduction failed (see ``synchronize``).
        """
        sync = self._mpiddp
        overlap = _overlap_of(sync)
        if sync.skip_synchronize:
            if sync.pending or (overlap is not None and overlap.round is not None
                                and overlap.deferred is None):
                raise RuntimeError(STEP_WHILE_IN_FLIGHT)
        sync.marks.record("step_begin")
        if overlap is not None and not sync.skip_synchronize and overlap.step(closure):
            return None                 # runs parameter by parameter in the next forward
        if not sync.skip_synchronize and (closure is None or sync.pending or sync.passes):
            sync.schedule.before_step(sync)
        if closure is not None and not sync.skip_synchronize:
            closure = _synchronized_closure(self, closure)
        result = super().step(closure)
        sync.synchronized = False
        sync.marks.record("step_end")
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Complete the reductions still in flight (a collective if there are any), then
        clear the gradients as the wrapped optimizer does.

        Args:
            set_to_none: set ``param.grad`` to None instead of zeroing it. Default True.

        Raises:
            MpiddpError: a reduction in flight failed (see ``synchronize``).
        """
        overlap = _overlap_of(self._mpiddp)
        if overlap is not None and overlap.zero_grad(
                set_to_none, lambda params: _clear_grads(params, set_to_none)):
            return                      # the deferred ones are cleared after their update
        self._mpiddp.wait_all()
        # Gradients written after this (by backward, or by hand) are new: a synchronize()
        # after them must reduce them, not return because the last ones were reduced.
        self._mpiddp.synchronized = False
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()``, after any deferred update
        (``overlap_forward``) has run.

        Returns:
            The state, as ``torch.optim.Optimizer.state_dict`` returns it.
        """
        _complete_overlap(self._mpiddp)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """The wrapped optimizer's ``load_state_dict()``, after any deferred update
        (``overlap_forward``) has run.

        Args:
            state_dict: as for ``torch.optim.Optimizer.load_state_dict``.
        """
        _complete_overlap(self._mpiddp)
        super().load_state_dict(state_dict)

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Make the whole optimizer state available to ``state_dict()`` on rank ``to`` (None:
        every rank), as ``DistributedOptimizer(zero_stage=1|2)`` needs before it saves. Here
        every rank already holds the whole state, so there is nothing to gather: a script
        written for a sharded optimizer (``consolidate_state_dict(to=0)``, then
        ``state_dict()`` on rank 0) runs unchanged, and ``state_dict()`` works on every rank
        as always. Not a collective here (it is with ``zero_stage`` 1 or 2: call it on every
        rank).

        Args:
            to: the rank (of the optimizer's process set) that would receive the whole
                state, or None for every rank. Default 0.

        Raises:
            ValueError: ``to`` is neither None nor a rank of the optimizer's process set.
        """
        _check_consolidate_to(to, runtime.set_size(self._mpiddp.process_set))

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group, as the wrapped optimizer does, and reduce its gradients too.

        A collective: every rank must add the same parameters in the same order. New
        parameters keep the names given in ``named_parameters`` (else
        ``group<index>.<position>``).

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``.

        Raises:
            TensorMismatchError: the ranks added different parameters (names, shapes,
                dtypes); raised on every rank.
        """
        _complete_overlap(self._mpiddp)
        before = {id(p) for g in self.param_groups for p in g["params"]}
        super().add_param_group(param_group)
        sync = self._mpiddp
        group_index = len(self.param_groups) - 1
        new = [p for p in self.param_groups[-1]["params"] if id(p) not in before]
        named = [(sync.extra_names.get(p, f"group{group_index}.{i}"), p)
                 for i, p in enumerate(new)]
        _check_same_everywhere(sync, named, f"add_param_group (group {group_index})")
        sync.add(named)
        overlap = _overlap_of(sync)
        if overlap is not None:
            overlap.adopt_new_params()
            overlap.params_added()


# Tell torch.optim that ``step`` needs no profiling/hook wrapper of its own: the wrapped
# class's step (already wrapped by torch) runs the optimizer step hooks once, after the
# gradients are averaged. Without this, load_state_dict() would wrap ours too.
_DistributedOptimizer.step.hooked = True


def _overlap_of(sync: GradientSync) -> Optional[ForwardOverlap]:
    return sync.schedule if isinstance(sync.schedule, ForwardOverlap) else None


def _complete_overlap(sync: GradientSync) -> None:
    """Run what forward overlap has deferred (a no-op without it)."""
    overlap = _overlap_of(sync)
    if overlap is not None:
        overlap.complete()


def _clear_grads(params, set_to_none: bool) -> None:
    """``zero_grad`` for some parameters, as ``torch.optim.Optimizer.zero_grad`` does."""
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def _synchronized_closure(optimizer, closure):
    """For step(closure) (e.g. LBFGS, which re-evaluates the loss several times): average the
    gradients after every evaluation, and return the loss averaged across ranks so that every
    rank takes the same decisions (line search, convergence)."""
    sync = optimizer._mpiddp

    def evaluate():
        with torch.enable_grad():
            loss = closure()
        sync.synchronize()
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.dtype.is_floating_point:
            loss = allreduce(loss.detach().reshape(1), op=ReduceOp.AVERAGE,
                             name=f"{sync.prefix}.closure_loss",
                             process_set=sync.process_set).reshape(loss.shape)
        return loss

    return evaluate


def _check_consolidate_to(to, size: int) -> None:
    """``consolidate_state_dict``'s ``to``: None, or a rank of a set of ``size``."""
    if to is not None and (isinstance(to, bool) or not isinstance(to, int)
                           or not 0 <= to < size):
        raise ValueError(f"consolidate_state_dict(to={to!r}): give a rank from 0 to "
                         f"{size - 1}, or None for every rank")


def _check_passes(passes) -> None:
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, not {passes!r}")


def _check_same_everywhere(sync: GradientSync, named, what: str) -> None:
    """Collective: every rank must reduce the same parameters with the same settings. Raises
    TensorMismatchError, on every rank, naming the first difference."""
    config = {"backward_passes_per_step": sync.passes_per_step, "op": ReduceOp(sync.op).name,
              "zero_stage": getattr(sync, "zero_stage", 0),
              "compression": getattr(sync.compression, "__name__",
                                     type(sync.compression).__name__),
              "gradient_predivide_factor": sync.postscale,
              # e.g. Compression.powersgd's settings (gradients/powersgd.py)
              "compression_settings": getattr(sync, "compression_settings", None)}
    signature = [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                 for name, p in named if p.requires_grad]
    everyone = allgather_object((config, signature), name=f"{sync.prefix}.signature",
                                process_set=sync.process_set)
    reference_config, reference = everyone[0]
    for rank, (rank_config, rank_signature) in enumerate(everyone):
        for key, value in reference_config.items():
            if rank_config[key] != value:
                raise TensorMismatchError(
                    f"DistributedOptimizer ({what}): ranks disagree on {key}: rank 0 uses "
                    f"{value!r}, rank {rank} uses {rank_config[key]!r}")
        if rank_signature == reference:
            continue
        for i, (a, b) in enumerate(itertools.zip_longest(reference, rank_signature)):
            if a != b:
                def show(item):
                    if item is None:
                        return "nothing (it has fewer)"
                    return f"'{item[0]}' {list(item[1])} {item[2]}"
                raise TensorMismatchError(
                    f"DistributedOptimizer ({what}): the models differ across ranks. Rank 0 "
                    f"has {len(reference)} trainable parameters, rank {rank} has "
                    f"{len(rank_signature)}; first difference at parameter {i}: rank 0 has "
                    f"{show(a)}, rank {rank} has {show(b)}")
