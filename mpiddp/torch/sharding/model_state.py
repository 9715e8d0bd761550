"""Stage 3's model: the ``model=`` argument checked, the model attached to its
``ParamGathers`` (hooks for its full state dict, loads, evaluation and threads), given back
to a new optimizer, and its sharded state forms (docs/dev/zero3.md "Model and optimizer
state")."""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

from ... import runtime
from .mixed_precision import cast_inputs_hook
from .param_gathers import GATHERS_ATTR, NOT_PICKLED, ParamGathers, _remove_hooks
from .param_guard import _THREAD, guard_thread
from .state import _copy_piece

def give_back(params) -> None:
    """Collective, before a new ``DistributedOptimizer`` takes ``params``: a stage-3 model
    whose optimizer is gone gives them (and its other parameters) memory of their own
    (``ParamGathers.unshard``), so that the new optimizer starts from their values."""
    owners = []
    for param in params:
        gathers = getattr(param, GATHERS_ATTR, None)
        if gathers is not None and not gathers.detached and \
                all(owner is not gathers for owner in owners):
            owners.append(gathers)
    for gathers in owners:
        gathers.unshard()


def check_not_released(named: list) -> None:
    """A parameter whose memory a stage-3 optimizer released, and which that optimizer no
    longer gathers (it is gone), cannot be read: refuse it by name."""
    released = [name for name, param in named if param.layout == torch.strided and
                param.untyped_storage().nbytes() <
                (param.storage_offset() + param.numel()) * param.element_size()]
    if released:
        raise ValueError(
            f"DistributedOptimizer: parameters {released[:3]} have no memory (their storage "
            "was resized to 0 outside mpiddp)")


def check_model(zero_stage: int, model, optimizer) -> None:
    """``DistributedOptimizer``'s ``model`` argument: needed at stage 3 (holding every
    parameter of the optimizer), refused elsewhere. Before any collective."""
    if zero_stage == 3 and model is None:
        raise ValueError("DistributedOptimizer(zero_stage=3) needs the model: pass model=model "
                         "(its parameters are sharded, and model.state_dict() gathers them)")
    if model is not None and zero_stage != 3:
        raise ValueError(f"DistributedOptimizer(model=...) is for zero_stage=3 only, not "
                         f"zero_stage={zero_stage}; leave model out")
    if model is None:
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    own = {id(p) for p in model.parameters()}
    strays = [(g, i, list(p.shape)) for g, group in enumerate(optimizer.param_groups)
              for i, p in enumerate(group["params"]) if id(p) not in own]
    if strays:
        where = ", ".join(f"group {g} #{i} {shape}" for g, i, shape in strays[:3])
        raise ValueError(f"DistributedOptimizer(zero_stage=3, model=...): {len(strays)} "
                         f"parameter(s) of the optimizer are not the model's ({where})")


def attach_model(optimizer, model: torch.nn.Module) -> None:
    """Stage 3: ``model.state_dict()`` gives the full parameters (the copies
    ``optimizer.consolidate_state_dict(to)`` made on rank ``to``, until the next step;
    otherwise gathered there and then, a collective on every rank), and
    ``model.load_state_dict(full)`` takes them (every sharded parameter's key present; the
    whole model is materialised while it loads). Only the root module's calls do this. A
    thread that runs the model's forward gets the guard first."""
    gathers = optimizer._mpiddp.gathers
    ref = _GathersRef(gathers)
    gathers.model = weakref.ref(model)
    gathers.shard_frozen(model)
    gathers.finish_meta(model)
    handles = [
        model.register_forward_pre_hook(_guard_thread),
        model.register_forward_hook(functools.partial(_after_forward, ref)),
        model.register_state_dict_pre_hook(functools.partial(_before_state, ref)),
        model.register_state_dict_post_hook(functools.partial(_full_state, ref)),
        model.register_load_state_dict_pre_hook(functools.partial(_before_load, ref)),
        model.register_load_state_dict_post_hook(functools.partial(_after_load, ref))]
    policy = optimizer._mpiddp.mixed_precision
    if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
        handles.append(model.register_forward_pre_hook(cast_inputs_hook(policy.param_dtype),
                                                       with_kwargs=True))
    # (The model's parameters keep ``gathers`` alive: it serves the model after the
    # optimizer is gone, until a new DistributedOptimizer takes the model: unshard.)
    gathers.model_hooks = handles
    weakref.finalize(gathers, _remove_hooks, handles)


def model_of(optimizer) -> Optional[torch.nn.Module]:
    """The model a ``DistributedOptimizer(zero_stage=3)`` was given (else None)."""
    sync = optimizer.__dict__.get("_mpiddp")
    gathers = getattr(sync, "gathers", None)
    return gathers.model() if isinstance(gathers, ParamGathers) else None


def _guard_thread(module, args) -> None:
    if not getattr(_THREAD, "guarded", False) and not torch.compiler.is_compiling():
        guard_thread()          # (compiled code: refused by the guard at its first run)


def _after_forward(ref, module, args, output) -> None:
    """A forward without autograd (evaluation) keeps nothing gathered."""
    gathers = ref()
    if gathers is not None and not torch.is_grad_enabled() and \
            not torch.compiler.is_compiling():
        with gathers.lock, gathers.internal():
            for bucket in list(gathers.gathered.values()):
                gathers.release(bucket)


class _GathersRef(weakref.ref):
    """The model's hooks' reference to its ``ParamGathers``: pickling the model (its hooks
    too) raises the reason, not "cannot pickle weakref"."""

    __slots__ = ()

    def __reduce__(self):
        raise TypeError(NOT_PICKLED)


def _before_state(ref, module, prefix, keep_vars) -> None:
    _quiet(ref, True)


def _quiet(ref, quiet: bool) -> None:
    """The guard passes (state_dict's detach() and load's copy_() are ours to handle)."""
    gathers = ref()
    if gathers is not None:
        gathers.busy = quiet


def _sharded_keys(gathers: ParamGathers, module, prefix: str) -> list:
    return [(prefix + name, param) for name, param in
            module.named_parameters(remove_duplicate=False) if id(param) in gathers.params]


def _full_state(ref, module, state_dict, prefix, local_metadata) -> None:
    gathers = ref()
    if gathers is None:
        return
    _quiet(ref, False)
    to = gathers.consolidated_to
    if gathers.consolidated is None and to is not None and to >= 0:
        rank = runtime.set_rank(gathers.process_set)
        raise RuntimeError(
            f"model.state_dict() on rank {rank} with DistributedOptimizer(zero_stage=3): the "
            f"full parameters were consolidated onto rank {to} only (consolidate_state_dict"
            f"(to={to})); call it there, or consolidate with to=None, or after the next step "
            "(then it gathers on every rank)")
    values = gathers.consolidated if gathers.consolidated is not None \
        else gathers.full_values()
    for key, param in _sharded_keys(gathers, module, prefix):
        if key in state_dict:
            state_dict[key] = values[id(param)]


def _before_load(ref, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs) -> None:
    gathers = ref()
    if gathers is None:
        return
    absent = [key for key, _ in _sharded_keys(gathers, module, prefix) if key not in state_dict]
    if absent:
        raise ValueError(f"zero_stage=3 loads every sharded parameter: {absent[:3]} missing "
                         "from the state dict")
    # Mixed precision: the masters take the given values at full precision (the parameters,
    # param_dtype copies, would round them).
    gathers.loading = {id(param): state_dict[key]
                       for key, param in _sharded_keys(gathers, module, prefix)
                       if gathers.params[id(param)][1].mixed}
    with gathers.lock, gathers.internal():
        for bucket in gathers.all_buckets():
            # (Gathered, not just given memory: an entry load_state_dict skips, or a load
            # that fails, leaves the current values.)
            if id(bucket) in gathers.arriving or not bucket.gathered:
                gathers._gather(bucket)
    _quiet(ref, True)


def _after_load(ref, module, incompatible_keys) -> None:
    gathers = ref()
    if gathers is None:
        return
    _quiet(ref, False)
    loading, gathers.loading = gathers.loading, {}
    with torch.no_grad():
        for bucket in gathers.all_buckets():
            if bucket.mixed:
                for piece in bucket.pieces:
                    value = loading.get(id(piece.param))
                    if gathers.owns(piece.param, bucket) and value is not None and \
                            value.numel() == piece.param.numel():
                        piece.shard.copy_(value.detach().reshape(-1)[piece.start:piece.stop])
            else:
                bucket.chunk.copy_(bucket.flat[bucket.lo:bucket.hi])
            gathers.release(bucket)
    gathers.forget_consolidated()


def _kept_whole(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """What stage 3 keeps whole on every rank: the model's buffers and the parameters not
    sharded (frozen ones), by name."""
    whole = {name: param for name, param in model.named_parameters()
             if id(param) not in gathers.params}
    whole.update(model.named_buffers())
    return whole


def kept_whole(optimizer, model: torch.nn.Module) -> dict:
    """What a ``DistributedOptimizer(zero_stage=3)`` leaves whole in ``model`` (buffers,
    parameters not sharded), by name: what a broadcast from one rank still reaches."""
    return _kept_whole(optimizer.__dict__["_mpiddp"].gathers, model)


def whole_model_state(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """Copies of ``_kept_whole`` (for ``sharded_state_dict``)."""
    return {name: tensor.detach().clone()
            for name, tensor in _kept_whole(gathers, model).items()}


def _frozen_pieces_here(gathers: ParamGathers, model: torch.nn.Module) -> list:
    """(name, piece) for this rank's pieces of the frozen parameters still in their frozen
    buckets."""
    if gathers.frozen_layout is None:
        return []
    names = {id(param): name for name, param in model.named_parameters()}
    return [(names[id(piece.param)], piece) for bucket in gathers.frozen_layout.buckets
            for piece in bucket.pieces if gathers.owns(piece.param, bucket)]


def frozen_pieces(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """This rank's pieces of the sharded frozen parameters, by name: (start, stop, copy)."""
    return {name: (piece.start, piece.stop, piece.shard.detach().clone())
            for name, piece in _frozen_pieces_here(gathers, model)}


def check_sharded_model(gathers: ParamGathers, model: torch.nn.Module, parts: list) -> None:
    """The parts hold what ``load_sharded_model`` takes (ValueError naming what is missing)."""
    whole = parts[0]["whole"]
    own = _kept_whole(gathers, model)
    missing = sorted(set(own) - set(whole))
    wrong = sorted(name for name in set(own) & set(whole)
                   if tuple(whole[name].shape) != tuple(own[name].shape))
    missing += sorted({name for name, _ in _frozen_pieces_here(gathers, model)
                       if not any(name in part.get("frozen", {}) for part in parts)})
    if missing or wrong:
        raise ValueError(f"load_sharded_state_dict: the save lacks {missing[:3]} or has other "
                         f"shapes for {wrong[:3]}: a state of another model")


def load_sharded_model(gathers: ParamGathers, model: torch.nn.Module, parts: list) -> None:
    """``load_sharded_state_dict`` at stage 3 wrote this rank's chunks of the trainable
    parameters: the full parameters gathered before are stale. The frozen ones' pieces come
    from every part, what is kept whole from the first."""
    whole = parts[0]["whole"]
    with torch.no_grad(), gathers.lock, gathers.internal():
        for bucket in gathers.all_buckets():
            gathers.release(bucket)
        for name, tensor in _kept_whole(gathers, model).items():
            tensor.copy_(whole[name])
        for name, piece in _frozen_pieces_here(gathers, model):
            _load_piece(piece, name, parts)
    gathers.forget_consolidated()


def _load_piece(piece, name: str, parts: list) -> None:
    """Copy elements ``piece.start:piece.stop`` of frozen parameter ``name`` from the parts
    that hold them (any rank count saved them)."""
    covered, elements = 0, {}
    for part in parts:
        found = part.get("frozen", {}).get(name)
        if found is None:
            continue
        start, stop, values = found
        lo, hi = max(start, piece.start), min(stop, piece.stop)
        if lo < hi:
            _copy_piece(elements, {"value": values}, start, stop, lo, hi, piece.start,
                        piece.stop - piece.start)
            covered += hi - lo
    if covered != piece.stop - piece.start:
        raise ValueError(f"load_sharded_state_dict: the parts do not cover the frozen "
                         f"parameter '{name}' elements {piece.start}-{piece.stop}")
    piece.shard.copy_(elements["value"])
