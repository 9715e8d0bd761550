"""The optimizer side of ``DistributedOptimizer(zero_stage=1|2|3)`` (docs/sharding.md).

The wrapped optimizer's param groups hold this rank's shards (``layout.py``, ``sync.py``), so its ``state``
holds only their state and its own ``step`` steps only them; ``ShardedOptimizer`` adds the
parameter gathers after the step, the global-norm clipping from the shards and the state in
its three forms: consolidated (the wrapped class's own format, on one rank or all),
loaded from that format on every rank (any rank count), and sharded (each rank its own part).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Callable, Optional

import torch

from ... import runtime
from ...errors import TensorMismatchError
from ...reduce_ops import ReduceOp
from ..ops.collectives import allreduce
from ..ops.functions import allgather_object, every_rank_calls
from ..gradients.optimizer import (STEP_WHILE_IN_FLIGHT, _check_consolidate_to,
                                 _check_same_everywhere, _clear_grads, _DistributedOptimizer)
from ..core.subset_step import step_subset
from .model_state import (check_sharded_model, frozen_pieces, load_sharded_model, model_of,
                           whole_model_state)
from .state import _as_param_state, _copy_piece, _groups, _indices, _load_full, \
    _set_hyperparameters

__all__ = ["elementwise_optimizer"]

# torch.optim classes whose update of each element depends only on that element's parameter,
# gradient and state: stepping a shard gives the bits stepping the whole tensor gives.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad,
                torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD,
                torch.optim.Rprop)
_declared: "weakref.WeakSet[type]" = weakref.WeakSet()


def elementwise_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise, so that ``DistributedOptimizer(zero_stage=1|2)``
    may shard it: each element's update depends only on that element's parameter, gradient
    and state (as SGD's and Adam's do; not LAMB's or LARS's per-tensor trust ratio). Usable as
    a class decorator.

    Args:
        cls: a ``torch.optim.Optimizer`` subclass.

    Returns:
        ``cls``.

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"elementwise_optimizer takes a torch.optim.Optimizer subclass, not "
                        f"{cls!r}")
    _declared.add(cls)
    return cls


def check_shardable(optimizer, named, compression, zero_stage: int) -> None:
    """Refuse what sharding cannot do exactly, naming the reason."""
    cls = type(optimizer)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"DistributedOptimizer(zero_stage={zero_stage}) cannot shard LBFGS: "
                         "its line search needs whole gradients and a closure. Use "
                         "zero_stage=0.")
    if not (isinstance(optimizer, _ELEMENTWISE) or any(issubclass(cls, c) for c in _declared)):
        raise ValueError(
            f"DistributedOptimizer(zero_stage={zero_stage}) shards only optimizers whose update "
            f"is elementwise, and {cls.__name__} is not known to be (optimizers with per-tensor "
            "norms or trust ratios, such as LAMB or LARS, need whole tensors). Built in: "
            + ", ".join(c.__name__ for c in _ELEMENTWISE) + ". If each element's update of "
            f"{cls.__name__} depends only on that element, declare it with "
            f"mpiddp.elementwise_optimizer({cls.__name__}); otherwise use zero_stage=0.")
    from ..compression import Compression
    if compression not in (Compression.none, Compression.fp16, Compression.bf16):
        raise ValueError(f"DistributedOptimizer(zero_stage={zero_stage}) takes "
                         "Compression.none, .fp16 or .bf16, not a custom compressor "
                         "(a shard of a compressed gradient need not be the compressed shard)")
    for name, param in named:
        if not param.is_contiguous():
            raise ValueError(f"DistributedOptimizer(zero_stage={zero_stage}): parameter "
                             f"'{name}' is not contiguous (channels_last?); its shards are "
                             "views of its memory. Make it contiguous before building the "
                             "optimizer, or use zero_stage=0.")


def shard_param_groups(optimizer) -> None:
    """Replace the full parameters in ``optimizer.param_groups`` by this rank's shards (keeping
    the full lists in ``sync.full_groups``); existing state is sharded too."""
    sync = optimizer._mpiddp
    full_state = None
    if optimizer.state:
        full_state = torch.optim.Optimizer.state_dict(optimizer)
    sync.full_groups = [list(group["params"]) for group in optimizer.param_groups]
    sync.optimizer_ref = ref = weakref.ref(optimizer)

    def step_shards(shards: list, options: Optional[list]) -> None:
        """The wrapped class's own step on ``shards`` (the early schedule's steps)."""
        opt = ref()
        step_subset(opt.param_groups, super(_DistributedOptimizer, opt).step, shards, options)
    sync.step_shards = step_shards
    for group in optimizer.param_groups:
        group["params"] = _shards_of(sync, group["params"])
    optimizer.state.clear()
    if full_state is not None:
        _load_full(optimizer, full_state)


def _shards_of(sync, params) -> list:
    return [shard for param in params for shard in sync.layout.shards.get(param, [])]


class ShardedOptimizer(_DistributedOptimizer):
    """Methods of a ``DistributedOptimizer(zero_stage=1|2)`` (see the module docstring)."""

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Synchronize the gradients' reduce-scatters (unless inside ``skip_synchronize()``),
        step this rank's shards, then gather every rank's updated shards into the
        parameters: before returning, or with ``overlap_forward`` just before each
        parameter's first use. A collective.

        Under the early schedule (decided by the first step: docs/sharding.md) most shards
        were already stepped during backward, and their gathers started; this steps what is
        left and waits for the gathers (with ``overlap_forward`` it returns at once).

        Args:
            closure: evaluated once, with gradients enabled, before the step; default None.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: inside ``skip_synchronize()`` while reductions are in flight; under
                the early schedule, gradients or hyperparameters changed after backward.
            MpiddpError: a reduction or gather failed.
        """
        sync = self._mpiddp
        # GradScaler's, when it called (``_step_supports_amp_scaling``): kept from the
        # wrapped class's step and put back for the scaler, which deletes them.
        scale = self.__dict__.pop("grad_scale", None)
        found_inf = self.__dict__.pop("found_inf", None)
        if sync.awaiting_step and closure is None:
            if found_inf is not None:
                raise RuntimeError(
                    f"{sync.timing.owner}: a GradScaler stepped this optimizer, but the first "
                    "step did not use one, so its shards were stepped during backward on "
                    "gradients the scaler had not unscaled. Use the GradScaler from the first "
                    "step on")
            return self._finish_early_step()
        result = self._step_at_step(closure, scale, found_inf)
        if found_inf is not None:
            self.__dict__.update(grad_scale=scale, found_inf=found_inf)
        return result

    # GradScaler hands step() its scale and its inf check (the two attributes above) instead
    # of stepping itself: a sharded optimizer must know that a scaler is in use.
    _step_supports_amp_scaling = True

    def _step_at_step(self, closure, scale, found_inf) -> Any:
        """Every shard stepped now (the ``AT_STEP`` schedule, or a step the early one cannot
        take: a closure, fewer backward passes than a step)."""
        sync = self._mpiddp
        sync.gathers.complete()
        deciding = sync.timing.mode is None
        needs_whole = closure is not None or sync.skip_synchronize or found_inf is not None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sync.skip_synchronize:
            if sync.pending:
                raise RuntimeError(STEP_WHILE_IN_FLIGHT)
        else:
            sync.schedule.before_step(sync)
        sync.marks.record("step_begin")
        # An inf in any rank's shard shows in every rank's (ShardRound): all skip alike.
        if found_inf is None or not float(found_inf.sum()):
            if scale is not None:
                _unscale(self, scale)
            super(_DistributedOptimizer, self).step()
            sync.consolidated = None
            sync.gathers.start(sync.gather_buckets)
        sync.synchronized = False
        if deciding:
            sync.decide(self, needs_whole)
        sync.timing.end_step()
        sync.marks.record("step_end")
        return loss

    def _finish_early_step(self) -> None:
        """``step()`` after an early backward: the shards still due are stepped with the
        hyperparameters of now (at once, or with forward overlap when first needed)."""
        sync = self._mpiddp
        sync.marks.record("step_begin")
        sync.record_step(self)
        sync.synchronized = False
        if sync.gathers.deferred:
            sync.gathers.watch([r.bucket for r in sync.in_flight] + sync.gathers.pending())
        else:
            sync.gathers.complete()
        sync.marks.record("step_end")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' averaged gradients and the parameters' local ones (completing
        reductions in flight first, a collective if there are any).

        Args:
            set_to_none: set the gradients to None instead of zeroing them. Default True.

        Raises:
            MpiddpError: a reduction in flight failed.
        """
        sync = self._mpiddp
        if sync.awaiting_step or sync.step_options is not None:
            sync.finish_previous("zero_grad()")
        sync.wait_all()
        sync.synchronized = False
        super(_DistributedOptimizer, self).zero_grad(set_to_none)
        with sync.gathers.internal():       # reading .grad is no use of the parameters
            _clear_grads([p for group in sync.full_groups for p in group], set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (a collective, as without sharding); its parameters are laid
        out in new buckets and this rank keeps their shards.

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``.

        Raises:
            TensorMismatchError: the ranks added different parameters (every rank).
            ValueError: a parameter cannot be sharded (see ``DistributedOptimizer``).
        """
        sync = self._mpiddp
        sync.gathers.complete()
        sync.wait_all()
        super(_DistributedOptimizer, self).add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        full = list(group["params"])
        named = [(sync.extra_names.get(p, f"group{index}.{i}"), p) for i, p in enumerate(full)]
        check_shardable(self, named, sync.compression, sync.zero_stage)
        _check_same_everywhere(sync, named, f"add_param_group (group {index})")
        sync.add(named)
        sync.full_groups.append(full)
        group["params"] = _shards_of(sync, full)
        self.__dict__["_parameter_names"].update({p: n for n, p in named})

    def synchronize(self) -> None:
        """Wait until every shard's averaged gradient is in its ``.grad`` (see
        ``DistributedOptimizer``'s ``synchronize``). Called after backward from the first
        step on, it keeps every step at ``step()``, after your changes to the gradients
        (clipping); under the early schedule it waits for the shards already stepped.

        Raises:
            MpiddpError: a reduction failed.
        """
        sync = self._mpiddp
        sync.timing.touch()
        if sync.awaiting_step:
            sync.advance(wait=True)
        else:
            sync.synchronize()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed from every rank's
        shards with one scalar all-reduce, as ``torch.nn.utils.clip_grad_norm_`` would on
        the whole averaged gradients. A collective: call it on every rank, after backward
        (or ``synchronize()``) and before ``step()``.

        Args:
            max_norm: the largest total norm the gradients keep.
            norm_type: the norm's order (``float("inf")`` for the largest element). Default
                2.0.
            error_if_nonfinite: raise when the total norm is inf or nan. Default False.

        Returns:
            The total norm (a one-element float tensor, as torch's).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is inf or nan (every rank);
                under the early schedule, where the shards were already stepped.
        """
        sync = self._mpiddp
        sync.timing.touch()
        if sync.awaiting_step:
            raise RuntimeError(
                f"{sync.timing.owner}.clip_grad_norm_: the shards were already stepped during "
                "backward (the early schedule, chosen because the first step() clipped "
                "nothing). Clip from the first step on, or call optimizer.synchronize() after "
                "backward from the first step on: every step then waits for step()")
        if sync.pending:
            sync.synchronize()
        norm_type = float(norm_type)
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        dtype = grads[0].dtype if grads else torch.float32
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in grads])
        else:
            norms = torch.zeros(1, dtype=torch.float64)
        if math.isinf(norm_type):
            local, op = norms.max().reshape(1), ReduceOp.MAX
        else:
            local, op = (norms ** norm_type).sum().reshape(1), ReduceOp.SUM
            if sync.layout.grid.replica:     # hybrid: one node's copy of each shard counts
                local.zero_()
        total = allreduce(local.cpu(), op=op, name=f"{sync.prefix}.grad_norm",
                          process_set=sync.process_set)[0]
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(float(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so it cannot be clipped (error_if_nonfinite)")
        coefficient = torch.clamp(torch.tensor(max_norm, dtype=torch.float64) / (total + 1e-6),
                                  max=1.0)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient.to(grad.dtype))
        return total.to(dtype)

    # ---- state ------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Collective: gather the whole optimizer state, bucket by bucket, onto rank ``to``
        (None: every rank). Until the next ``step()``, ``state_dict()`` there returns it in
        the wrapped optimizer's own format, loadable into a plain torch optimizer.

        Args:
            to: the rank that receives the whole state, or None for every rank. Default 0.

        Raises:
            ValueError: ``to`` is not a rank of the optimizer's process set, or None.
            TensorMismatchError: the ranks passed different ``to`` (every rank).
        """
        sync = self._mpiddp
        size, rank = runtime.set_size(sync.process_set), runtime.set_rank(sync.process_set)
        _check_consolidate_to(to, size)
        self._consolidate(to)

    def _consolidate(self, to: Optional[int], keep: Optional[bool] = None) -> None:
        """``consolidate_state_dict(to)``; with ``keep`` (and ``to`` None), this rank keeps
        the whole state where ``keep`` is True, which may differ between ranks."""
        sync = self._mpiddp
        rank = runtime.set_rank(sync.process_set)
        gathering = (to is None or to == rank) if keep is None else keep
        # (Called on some ranks only, e.g. under `if rank == 0`: an error on every rank.)
        every_rank_calls(f"{sync.prefix}.consolidate_state_dict", sync.process_set)
        sync.gathers.complete()
        if sync.zero_stage == 3:        # the full parameters too, for model.state_dict()
            # (The gathers keep them where their `to` is None or this rank, a choice each
            # rank makes alone: -1 keeps nothing.)
            sync.gathers.consolidate(to if keep is None else None if keep else -1)
        index_of, params = _indices(sync)
        state: dict = {}
        sharded: set = set()
        for position, bucket in enumerate(sync.layout.buckets or [None]):
            mine = []
            for piece in (bucket.pieces if bucket is not None else []):
                values = self.state.get(piece.shard)
                if values:
                    mine.append((index_of[piece.param], piece.start, piece.stop,
                                 {k: v.detach().cpu() if torch.is_tensor(v) else v
                                  for k, v in values.items()}))
            everyone = allgather_object((to, mine), name=f"{sync.prefix}.consolidate",
                                        process_set=sync.process_set)
            if position == 0:
                targets = [t for t, _ in everyone]
                if any(t != to for t in targets):
                    raise TensorMismatchError(
                        f"consolidate_state_dict: the ranks disagree on 'to': {targets}")
            if gathering:
                for _, pieces in everyone:
                    for index, start, stop, values in pieces:
                        created = _copy_piece(state.setdefault(index, {}), values, start, stop,
                                              start, stop, 0, params[index].numel())
                        sharded.update((index, key) for key in created)
        if not gathering:
            sync.consolidated = (to, None)
            return
        for index, values in state.items():
            for key in values:
                if (index, key) in sharded:
                    values[key] = values[key].reshape(params[index].shape)
        sync.consolidated = (to, {"state": state, "param_groups": _groups(self, sync)})

    def state_dict(self) -> dict:
        """The whole state, on the rank(s) of the last ``consolidate_state_dict`` and until
        the next step.

        Returns:
            The wrapped optimizer's own ``state_dict()`` format for the whole model.

        Raises:
            RuntimeError: anywhere else: this rank holds only its shard.
        """
        sync = self._mpiddp
        rank = runtime.set_rank(sync.process_set)
        if sync.consolidated is not None and sync.consolidated[1] is not None:
            return sync.consolidated[1]
        where = ("on every rank first (then state_dict() returns the whole state here until "
                 "the next step)")
        if sync.consolidated is not None:
            where = (f"with to={rank} or to=None (it was consolidated onto rank "
                     f"{sync.consolidated[0]})")
        raise RuntimeError(
            f"state_dict() of DistributedOptimizer(zero_stage={sync.zero_stage}) on rank "
            f"{rank}: this rank holds only its shard of the optimizer state. Call "
            f"optimizer.consolidate_state_dict(to=0) {where}, or save "
            "optimizer.sharded_state_dict() on every rank.")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (``consolidate_state_dict`` + ``state_dict()``, or a plain torch
        optimizer's) on every rank: each keeps its shard. Any rank count.

        Args:
            state_dict: the whole state.

        Raises:
            ValueError: the state belongs to another model (param group sizes or state
                shapes differ), or is a sharded one (use ``load_sharded_state_dict``).
        """
        sync = self._mpiddp
        if "zero_sharded" in state_dict:
            raise ValueError("load_state_dict got a sharded state (from sharded_state_dict()); "
                             "load every rank's with load_sharded_state_dict([...])")
        sync.gathers.complete()
        sync.wait_all()
        _load_full(self, state_dict)
        sync.consolidated = None

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state: O(total / ranks), nothing gathered. Save one per
        rank; ``load_sharded_state_dict`` takes them all back, at any rank count. At stage 3
        it holds this rank's chunks of the parameters and the model's buffers too: the
        files of every rank are then the whole training state.

        Returns:
            ``{"zero_sharded": {world_size, rank, pieces, replica}, "state": ..., "param_groups":
            ...}``: this rank's state by parameter index, with the element ranges it covers
            (stage 3: also ``"parameters"``, this rank's elements of each, ``"frozen"``,
            this rank's elements of the frozen parameters by name, and ``"whole"``, the
            model's buffers and what else is not sharded).
        """
        sync = self._mpiddp
        sync.gathers.complete()
        index_of, _ = _indices(sync)
        pieces, state, values = [], {}, {}
        for piece in sync.layout.pieces():
            index = index_of[piece.param]
            pieces.append((index, piece.start, piece.stop, tuple(piece.param.shape)))
            if self.state.get(piece.shard):
                state[index] = dict(self.state[piece.shard])
            values[index] = piece.shard.detach().clone()
        sharded = {"zero_sharded": {"world_size": runtime.set_size(sync.process_set),
                                    "rank": runtime.set_rank(sync.process_set),
                                    "pieces": pieces,
                                    # hybrid: which node's copy (the others skip it on load)
                                    "replica": sync.layout.grid.replica},
                   "state": state, "param_groups": _groups(self, sync)}
        model = model_of(self)
        if model is not None:
            sharded["parameters"] = values
            sharded["whole"] = whole_model_state(sync.gathers, model)
            sharded["frozen"] = frozen_pieces(sync.gathers, model)
        return sharded

    def load_sharded_state_dict(self, sharded: list[dict]) -> None:
        """Load the ``sharded_state_dict()`` of every rank of the run that saved them (a
        list, any order; ``torch.load(..., mmap=True)`` keeps memory low): each rank takes
        the parts of its own shards. Any rank count.

        Args:
            sharded: every rank's ``sharded_state_dict()`` of one save.

        Raises:
            ValueError: parts are missing or come from different runs or models.
        """
        sync = self._mpiddp
        sync.gathers.complete()
        sync.wait_all()
        worlds = {s["zero_sharded"]["world_size"] for s in sharded}
        ranks = sorted(s["zero_sharded"]["rank"] for s in sharded)
        if len(worlds) != 1 or ranks != list(range(next(iter(worlds)))):
            raise ValueError(f"load_sharded_state_dict needs every rank's part of one save: got "
                             f"ranks {ranks} of world sizes {sorted(worlds)}")
        # A hybrid save holds each piece once per node: one copy is the whole state.
        sharded = [s for s in sharded if not s["zero_sharded"].get("replica", 0)]
        index_of, _ = _indices(sync)
        model = model_of(self)
        with_parameters = model is not None and all("parameters" in s for s in sharded)
        if with_parameters:             # (before anything changes)
            check_sharded_model(sync.gathers, model, sharded)
        _set_hyperparameters(self, sharded[0]["param_groups"])
        self.state.clear()
        for piece in sync.layout.pieces():
            index = index_of[piece.param]
            values: dict = {}
            elements: dict = {}      # (stage 3) this piece's parameter elements
            covered = state_covered = 0
            for part in sharded:
                found = [p for p in part["zero_sharded"]["pieces"] if p[0] == index]
                if not found or (index not in part["state"] and not with_parameters):
                    continue
                _, start, stop, shape = found[0]
                if tuple(shape) != tuple(piece.param.shape):
                    raise ValueError(f"load_sharded_state_dict: parameter {index} has shape "
                                     f"{list(shape)} in the save, {list(piece.param.shape)} "
                                     "here: a state of another model")
                lo, hi = max(start, piece.start), min(stop, piece.stop)
                if lo >= hi:
                    continue
                covered += hi - lo
                if index in part["state"]:
                    state_covered += hi - lo
                    _copy_piece(values, part["state"][index], start, stop, lo, hi,
                                piece.start, piece.stop - piece.start)
                if with_parameters:
                    _copy_piece(elements, {"value": part["parameters"][index]}, start, stop,
                                lo, hi, piece.start, piece.stop - piece.start)
            if values and state_covered != piece.stop - piece.start or \
                    elements and covered != piece.stop - piece.start:
                raise ValueError(f"load_sharded_state_dict: the parts do not cover "
                                 f"parameter {index} elements {piece.start}-{piece.stop}")
            if values:
                self.state[piece.shard] = _as_param_state(values, piece.shard)
            if elements:
                with torch.no_grad():
                    piece.shard.copy_(elements["value"])
        if with_parameters:
            load_sharded_model(sync.gathers, model, sharded)
        sync.consolidated = None


# torch.optim wraps an optimizer class's step in its profiling/hook wrapper unless marked
# (see gradients/optimizer.py): the wrapped class's own step runs the hooks.
ShardedOptimizer.step.hooked = True


def _unscale(optimizer, scale: torch.Tensor) -> None:
    """Divide the shards' gradients by GradScaler's scale, with the kernel and the reciprocal
    its own ``unscale_`` uses (the same bits)."""
    inverse = scale.double().reciprocal().float()
    by_device: dict = {}
    for group in optimizer.param_groups:
        for shard in group["params"]:
            if shard.grad is not None:
                by_device.setdefault(shard.grad.device, []).append(shard.grad)
    for device, grads in by_device.items():
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, torch.zeros(1, device=device), inverse.to(device))


@contextlib.contextmanager
def consolidated(optimizer, to: Optional[int], keep: Optional[bool] = None):
    """Collective: ``optimizer.consolidate_state_dict(to)`` for the block (a save reading the
    whole state), then the optimizer, and a stage-3 model, as they were: a library save does
    not change what ``state_dict()`` and ``model.state_dict()`` do afterwards. ``keep``
    instead of ``to``: whether this rank keeps the whole state (True on some ranks only:
    elastic snapshots' writers), so that the others never hold it."""
    sync = optimizer._mpiddp
    gathers = sync.gathers
    before = sync.consolidated, getattr(gathers, "consolidated", None), \
        getattr(gathers, "consolidated_to", None)
    if keep is None:
        optimizer.consolidate_state_dict(to=to)
    else:
        optimizer._consolidate(None, keep=keep)
    try:
        yield
    finally:
        sync.consolidated = before[0]
        if sync.zero_stage == 3:
            gathers.consolidated, gathers.consolidated_to = before[1:]
