"""Keeping ranks consistent: broadcast model parameters, optimizer state and Python objects;
gather Python objects from every rank.

Everything here goes through the engine's collectives (no MPI calls of its own), so it is
ordered with the rest of the job's collectives. Every rank must make the same calls in the
same order: they are collectives.
"""
from __future__ import annotations

import pickle
import sys
from typing import Any, Iterable, Mapping

import torch

from ... import runtime
from ...runtime import ProcessSet
from .async_ops import broadcast_async_
from .collectives import allgather, broadcast_
from .handles import synchronize
from ..core.naming import collective_name, root_rank as root_rank_of
from ..core.sharded_registry import zero_stage_of

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]

# Seconds a library call every rank must make waits for ranks that went on to other
# collectives without it before every rank stops with an error naming the call and those
# ranks (at most MPIDDP_STALL_CHECK_TIME): Request.deadline.
CALL_DEADLINE = 10.0


def every_rank_calls(call: str, process_set: ProcessSet | None = None) -> None:
    """Begin the library call ``call`` (e.g. ``"mpiddp.Checkpoint.save"``) with a barrier of
    that name (among ``process_set``'s ranks), so that the call made on some ranks only fails
    fast and alike: once it has waited ``CALL_DEADLINE`` s for ranks that wait in other
    collectives instead, every rank stops with ``EngineShutdownError`` saying which ranks
    made it and which did not. (A rank that shuts down instead ends the wait at once, with
    that said.)"""
    engine, _ = runtime.engine_for(process_set, call)
    engine.barrier(call, deadline=CALL_DEADLINE).wait()


# ---- Python objects ----------------------------------------------------------------------
def _dumps(obj) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _loads(tensor: torch.Tensor):
    return pickle.loads(tensor.numpy().tobytes())


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank. The length travels first, then the
    pickled bytes (two tensor broadcasts). A collective: every rank must call it.

    Args:
        obj: on ``root_rank``, any picklable object; ignored on the other ranks (pass
            anything, e.g. None). Default None.
        root_rank: the rank whose object everyone receives, the same on every rank.
            Default 0.
        name: identifies the call across ranks (collectives ``broadcast_object.<name>.len``
            and ``.data``). Default None: generated, numbered in call order.
        process_set: run among this ``ProcessSet``'s ranks only (``root_rank`` is still a
            global rank); default None: every rank.

    Returns:
        ``obj`` itself on ``root_rank``; an unpickled copy of it on the other ranks.

    Raises:
        TypeError: ``root_rank`` is not an integer.
        ValueError: ``root_rank`` is not a rank; ``name`` is not a non-empty string.
        pickle.PicklingError, TypeError: ``obj`` cannot be pickled (raised on
            ``root_rank``; the other ranks then wait for it).
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collectives finished.
        DuplicateNameError: a collective of the same name is in flight on this rank.
        TensorMismatchError: the ranks disagree on ``root_rank``; raised on every rank.
    """
    runtime.require("broadcast_object()")
    root_rank = root_rank_of(root_rank, runtime.size(), "broadcast_object")
    base = collective_name("broadcast_object", name, process_set, prefixed=True)
    is_root = runtime.rank() == root_rank
    payload = _dumps(obj) if is_root else None
    length = torch.tensor([payload.numel() if is_root else 0], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{base}.len", process_set=process_set)
    if not is_root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if is_root else _loads(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order, on every rank.

    One all-gather: each rank contributes an 8-byte length followed by its pickled bytes, so
    the concatenation is read back without a second round. A collective: every rank must
    call it.

    Args:
        obj: this rank's picklable object.
        name: identifies the call across ranks (collective ``allgather_object.<name>.data``).
            Default None: generated, numbered in call order.
        process_set: run among this ``ProcessSet``'s ranks only (``root_rank`` is still a
            global rank); default None: every rank.

    Returns:
        A new list of ``size()`` unpickled objects, rank 0's first (this rank's entry is a
        copy too).

    Raises:
        ValueError: ``name`` is not a non-empty string.
        pickle.PicklingError, TypeError: ``obj`` cannot be pickled (raised on that rank;
            the other ranks then wait for it).
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collectives finished.
        DuplicateNameError: a collective of the same name is in flight on this rank.
    """
    runtime.require("allgather_object()")
    base = collective_name("allgather_object", name, process_set, prefixed=True)
    payload = _dumps(obj)
    header = torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8)
    gathered = allgather(torch.cat([header, payload]), name=f"{base}.data",
                         process_set=process_set).numpy().tobytes()
    result, offset = [], 0
    for _ in range(runtime.set_size(process_set)):
        n = int.from_bytes(gathered[offset:offset + 8], sys.byteorder)
        result.append(pickle.loads(gathered[offset + 8:offset + 8 + n]))
        offset += 8 + n
    return result


# ---- model parameters --------------------------------------------------------------------
def _named_tensors(params, what: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, torch.Tensor):
        raise TypeError(f"{what} takes a state_dict, named_parameters() or a list of "
                        "(name, tensor) pairs, not a single tensor")
    else:
        items = []
        for i, item in enumerate(params):
            if isinstance(item, torch.Tensor):
                items.append((str(i), item))
            elif isinstance(item, tuple) and len(item) == 2:
                items.append((str(item[0]), item[1]))
            else:
                raise TypeError(f"{what}: item {i} is a {type(item).__name__}; expected a "
                                "(name, tensor) pair or a tensor")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{what}: the name '{dup}' appears more than once")
    for n, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: '{n}' is a {type(t).__name__}, not a tensor (use "
                            "broadcast_object for other values)")
    return items


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable,
                         root_rank: int = 0, prefix: str = "broadcast_parameters",
                         process_set: ProcessSet | None = None) -> None:
    """Overwrite every tensor in ``params`` with ``root_rank``'s values, in place.

    All broadcasts are submitted at once and waited for together. Run it after building the
    model (and after loading a checkpoint on the root) so that every rank starts from the
    same weights. A collective: every rank must call it with the same names and shapes.

    Args:
        params: a ``state_dict()`` (parameters and buffers), ``named_parameters()``, a list
            of ``(name, tensor)`` pairs, or a list of tensors (named by position). Names must
            be unique; every value must be a tensor.
        root_rank: the rank whose values everyone receives, the same on every rank.
            Default 0.
        prefix: tensor ``n`` is broadcast as ``<prefix>.<n>``; use different prefixes for
            calls that may be in flight at the same time. Default ``"broadcast_parameters"``.
        process_set: run among this ``ProcessSet``'s ranks only (``root_rank`` is still a
            global rank); default None: every rank.

    Raises:
        TypeError: ``params`` is a single tensor, an item is neither a tensor nor a
            ``(name, tensor)`` pair, a value is not a tensor (e.g. a module's extra state),
            or ``root_rank`` is not an integer.
        ValueError: a name appears twice; ``root_rank`` is not a rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collectives finished.
        DuplicateNameError: a collective of the same name is in flight on this rank.
        TensorMismatchError: the ranks disagree on a tensor's shape, dtype or device type,
            or on ``root_rank``; raised on every rank. (Names that exist on some ranks only
            are not an error but a stall, reported after ``MPIDDP_STALL_CHECK_TIME``.)
    """
    runtime.require("broadcast_parameters()")
    root_rank = root_rank_of(root_rank, runtime.size(), "broadcast_parameters")
    items = _named_tensors(params, "broadcast_parameters")
    handles = []
    with torch.no_grad():
        for name, tensor in items:
            handles.append(broadcast_async_(tensor, root_rank, name=f"{prefix}.{name}",
                                            process_set=process_set))
        for handle in handles:
            synchronize(handle)


# ---- optimizer state ---------------------------------------------------------------------
class _TensorSlot:
    """Placeholder for a tensor in the pickled skeleton of an optimizer's state."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape, dtype):
        self.index, self.shape, self.dtype = index, tuple(shape), dtype

    def __getstate__(self):
        return (self.index, self.shape, self.dtype)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype = state


def _skeleton(value, tensors: list):
    """Replace every tensor in ``value`` (nested dicts, lists, tuples) by a ``_TensorSlot``."""
    if isinstance(value, torch.Tensor):
        # Tensors travel through host memory on every rank (devices may differ per rank);
        # load_state_dict moves them to each parameter's device.
        tensors.append(value.detach().cpu())
        return _TensorSlot(len(tensors) - 1, value.shape, value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v, tensors) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_skeleton(v, tensors) for v in value)
    return value


def _fill(value, tensors: list, make):
    """Inverse of ``_skeleton``: put real tensors (made by ``make(slot)``) back in place."""
    if isinstance(value, _TensorSlot):
        tensor = make(value)
        tensors.append((value.index, tensor))
        return tensor
    if isinstance(value, dict):
        return {k: _fill(v, tensors, make) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors, make) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_fill(v, tensors, make) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              prefix: str = "broadcast_optimizer_state",
                              process_set: ProcessSet | None = None) -> None:
    """Make every rank's optimizer state (per-parameter state such as momentum buffers and step
    counts, and the param groups' hyperparameters such as ``lr``) equal to ``root_rank``'s.

    The structure and every non-tensor value (Python scalars, hyperparameters) travel as one
    pickled object; the tensors travel as tensor broadcasts, so large states are not pickled.
    An optimizer whose state is still empty on the root (no step taken yet) leaves every rank
    with an empty state. Typical use: after loading a checkpoint on rank 0. A collective:
    every rank must call it, with optimizers over the same parameters. The other ranks load
    the state with ``optimizer.load_state_dict``, which moves tensors to the parameters'
    devices.

    A sharded optimizer (``DistributedOptimizer(zero_stage=1|2)``) holds on each rank only
    that rank's shard of the state, which no other rank can use: it gets the root's
    hyperparameters (everything in each param group but its parameters), and its state is
    left as it is when no rank holds any (as after construction). Where some rank does hold
    state, every rank raises ``ValueError``: load the whole state on every rank instead.

    Args:
        optimizer: the optimizer (a ``DistributedOptimizer``, sharded or not, or a plain one).
        root_rank: the rank whose state everyone receives, the same on every rank. Default 0.
        prefix: base of the collectives' names (``<prefix>.noname.<n>``, numbered in call
            order). Default ``"broadcast_optimizer_state"``.
        process_set: run among this ``ProcessSet``'s ranks only (``root_rank`` is still a
            global rank); default None: every rank.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``; ``root_rank`` is not an
            integer.
        ValueError: ``root_rank`` is not a rank; or this rank's param groups hold different
            numbers of parameters than the root's (raised, after the broadcasts, on the ranks
            that differ; the state is then not loaded). With sharded optimizers, raised on
            every rank alike: some rank holds optimizer state (load the whole state on every
            rank with ``optimizer.load_state_dict``, or every rank's
            ``sharded_state_dict()`` with ``load_sharded_state_dict``, or use
            ``mpiddp.Checkpoint``); the ranks' param groups differ; the ranks disagree on
            ``zero_stage``; ``root_rank`` is not in ``process_set``.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collectives finished.
        DuplicateNameError: a collective of the same name is in flight on this rank.
        TensorMismatchError: the ranks disagree on ``root_rank``; raised on every rank.
    """
    runtime.require("broadcast_optimizer_state()")
    root_rank = root_rank_of(root_rank, runtime.size(), "broadcast_optimizer_state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
    base = collective_name(prefix, None, process_set)
    stage = zero_stage_of(optimizer)
    # Every rank takes the same branch: the stages (and, sharded, whether any rank holds
    # state) are agreed first, so that a refusal is raised on every rank, never a hang.
    agreed = allgather_object((stage, _sharded_groups(optimizer) if stage else None,
                               bool(optimizer.state) if stage else False),
                              name=f"{base}.agree", process_set=process_set)
    stages = [entry[0] for entry in agreed]
    if len(set(stages)) > 1:
        raise ValueError(f"broadcast_optimizer_state: the ranks' optimizers differ in "
                         f"zero_stage ({stages}, in rank order)")
    if stage:
        _adopt_root_groups(optimizer, agreed, root_rank, process_set, stage)
        return
    is_root = runtime.rank() == root_rank
    state_dict = optimizer.state_dict()
    local_groups = [len(g["params"]) for g in state_dict["param_groups"]]

    skeleton = None
    root_tensors: list = []
    if is_root:
        state = {key: _skeleton(value, root_tensors)
                 for key, value in state_dict["state"].items()}
        skeleton = {"state": state, "param_groups": state_dict["param_groups"]}
        # Entries of the optimizer's own beside those two (e.g. the PowerSGD memories that
        # DistributedOptimizer(compression=Compression.powersgd(...)) adds): pickled along.
        skeleton["extra"] = {key: value for key, value in state_dict.items()
                             if key not in ("state", "param_groups")}
    skeleton = broadcast_object(skeleton, root_rank, name=f"{base}.skeleton",
                                process_set=process_set)

    root_groups = [len(g["params"]) for g in skeleton["param_groups"]]
    if is_root:
        pairs = list(enumerate(root_tensors))
    else:
        pairs = []
        make = lambda slot: torch.empty(slot.shape, dtype=slot.dtype)  # noqa: E731
        state = {key: _fill(value, pairs, make) for key, value in skeleton["state"].items()}
    handles = [broadcast_async_(tensor, root_rank, name=f"{base}.t{index}",
                                process_set=process_set)
               for index, tensor in sorted(pairs, key=lambda pair: pair[0])]
    for handle in handles:
        synchronize(handle)
    if root_groups != local_groups:   # raised only now, so every rank made the same calls
        raise ValueError(
            f"broadcast_optimizer_state: rank {root_rank} has param groups of sizes "
            f"{root_groups} but rank {runtime.rank()} has {local_groups}: the optimizers "
            "hold different parameters")
    if not is_root:
        optimizer.load_state_dict({**skeleton["extra"], "state": state,
                                   "param_groups": skeleton["param_groups"]})


def _sharded_groups(optimizer) -> list[tuple[int, dict]]:
    """A sharded optimizer's param groups as (parameters, hyperparameters)."""
    full_groups = optimizer.__dict__["_mpiddp"].full_groups
    return [(len(full), {k: v for k, v in group.items() if k not in ("params", "param_names")})
            for group, full in zip(optimizer.param_groups, full_groups)]


def _broadcast_hyperparameters(optimizer: torch.optim.Optimizer, root_rank: int, name: str,
                               process_set: ProcessSet | None = None) -> None:
    """Collective: a sharded optimizer takes ``root_rank``'s hyperparameters, whatever state
    its shards hold (``mpiddp.Checkpoint`` with nothing to restore)."""
    stage = zero_stage_of(optimizer)
    agreed = allgather_object((stage, _sharded_groups(optimizer), False), name=name,
                              process_set=process_set)
    stages = [entry[0] for entry in agreed]
    if len(set(stages)) > 1:
        raise ValueError(f"the ranks' optimizers differ in zero_stage ({stages}, in rank "
                         "order)")
    _adopt_root_groups(optimizer, agreed, root_rank, process_set, stage)


def _adopt_root_groups(optimizer, agreed: list, root_rank: int,
                       process_set: ProcessSet | None, stage: int) -> None:
    """``broadcast_optimizer_state`` of a sharded optimizer, after the ranks' ``agreed``
    (stage, groups, holds state): the same outcome on every rank."""
    ranks = list(range(runtime.size())) if process_set is None or not process_set.ranks \
        else list(process_set.ranks)
    if root_rank not in ranks:
        raise ValueError(f"broadcast_optimizer_state: root_rank={root_rank} is not in the "
                         f"process set (ranks {ranks})")
    holding = [rank for rank, (_, _, holds) in zip(ranks, agreed) if holds]
    if holding:
        raise ValueError(
            f"broadcast_optimizer_state cannot copy a DistributedOptimizer(zero_stage={stage})"
            f"'s state from rank {root_rank}: each rank holds only its own shard (rank(s) "
            f"{holding} hold optimizer state), which no other rank can use. Load the whole "
            "state on every rank with optimizer.load_state_dict(state) (each keeps its "
            "shard), or every rank's sharded_state_dict() with load_sharded_state_dict, or "
            "let mpiddp.Checkpoint save and restore it (docs/sharding.md)")
    root_groups = agreed[ranks.index(root_rank)][1]
    sizes = {rank: [count for count, _ in groups]
             for rank, (_, groups, _) in zip(ranks, agreed)}
    if any(rank_sizes != sizes[root_rank] for rank_sizes in sizes.values()):
        raise ValueError(
            f"broadcast_optimizer_state: the ranks' param groups hold different numbers of "
            f"parameters ({sizes}, by rank): the optimizers hold different parameters")
    for group, (_, hyperparameters) in zip(optimizer.param_groups, root_groups):
        group.update(hyperparameters)
