"""The blocking tensor collectives: each is ``synchronize`` of its asynchronous twin
(``async_ops.py``, whose docstring holds the rules every call shares), and goes through
autograd (``autograd.py``) when its input requires a gradient.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import runtime
from ...docstrings import shared_doc
from ...engine.request import BARRIER
from ...reduce_ops import ReduceOp
from ...runtime import ProcessSet
from . import autograd
from .async_ops import (allgather_async, allreduce_async, allreduce_async_, alltoall_async,
                        broadcast_async, broadcast_async_, grouped_allgather_async,
                        grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter_async, reducescatter_async)
from ..compression import Compression, Compressor
from ..core.sharded_registry import live_sharded_optimizers
from .handles import synchronize
from ..core.naming import collective_name
from .requests import resolve_op
from .shared_docs import SNIPPETS

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
           "grouped_allgather", "broadcast", "broadcast_", "reducescatter",
           "grouped_reducescatter", "alltoall", "barrier", "join"]


def _doc(kind: str = "allreduce"):
    return shared_doc(SNIPPETS, kind=kind)


def _needs_grad(*tensors) -> bool:
    """The call must be recorded for autograd (see ``autograd.py``)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def _is_group(tensors) -> bool:
    return isinstance(tensors, (list, tuple))


@_doc()
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: ReduceOp | int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default op: Average) and return the result as a new
    tensor; ``tensor`` is unchanged. Blocks until done.

    Args:
        {arg_reduce_tensor}
        {arg_average}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_compression}
        {arg_process_set}

    Returns:
        A new contiguous tensor of the same shape, dtype and device.

    Raises:
        {raises_allreduce_input}
        {raises_duplicate_name}
        {raises_completed}
    """
    wire, context = compression.compress(tensor)
    if _needs_grad(wire):
        reduced = autograd.Allreduce.apply(wire, resolve_op(op, average), name,
                                           prescale_factor, postscale_factor, process_set)
    else:
        reduced = synchronize(allreduce_async(wire, average, name, op, prescale_factor,
                                              postscale_factor, process_set))
    return compression.decompress(reduced, context)


@_doc()
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place (default op: Average) and return it.
    Blocks until done.

    Args:
        {arg_reduce_tensor}
        {arg_average}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        ``tensor``, holding the reduction.

    Raises:
        {raises_allreduce_input}
        {raises_duplicate_name}
        {raises_completed}
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


@_doc()
def grouped_allreduce(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                      average: bool | None = None, name: str | None = None,
                      compression: Compressor = Compression.none, op: ReduceOp | int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Reduce a list of tensors across ranks (default op: Average), fused where possible;
    return the results as new tensors. Blocks until done.

    Args:
        {arg_reduce_tensors}
        {arg_average}
        {arg_group_name}
        {arg_op}
        {arg_scale_factors}
        {arg_compression}
        {arg_process_set}

    Returns:
        A list of new contiguous tensors, in the order of ``tensors``.

    Raises:
        {raises_grouped_allreduce_input}
        {raises_completed}
    """
    if not _is_group(tensors):
        return synchronize(grouped_allreduce_async(tensors))     # raises the usual error
    compressed = [compression.compress(t) for t in tensors]
    wires = [wire for wire, _ in compressed]
    if _needs_grad(*wires):
        reduced = autograd.GroupedAllreduce.apply(resolve_op(op, average), name,
                                                  prescale_factor, postscale_factor,
                                                  process_set, *wires)
    else:
        reduced = synchronize(grouped_allreduce_async(wires, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


@_doc()
def grouped_allreduce_(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                       average: bool | None = None, name: str | None = None,
                       op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Reduce a list of tensors across ranks in place (default op: Average), fused where
    possible. Blocks until done.

    Args:
        {arg_reduce_tensors}
        {arg_average}
        {arg_group_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A list of the input tensors, holding the reductions.

    Raises:
        {raises_grouped_allreduce_input}
        {raises_completed}
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


@_doc("allgather")
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (sizes may differ) and return
    the result on every rank. Blocks until done.

    Args:
        {arg_gather_tensor}
        {arg_name}
        {arg_process_set}

    Returns:
        A new tensor of shape ``(sum of every rank's dimension 0, *tensor.shape[1:])``,
        rank 0's rows first.

    Raises:
        {raises_tensor_type}
        ValueError: ``tensor`` is a scalar (0-d); ``name`` not a non-empty string; a cuda
            tensor not on this rank's GPU.
        {raises_duplicate_name}
        {raises_completed}
        {raises_joined}
    """
    if _needs_grad(tensor):
        return autograd.Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                      name: str | None = None,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """All-gather each tensor of a list (submitted together); see ``grouped_allgather_async``.

    Args:
        tensors: the tensors; each as for ``allgather``.
        name: base name: item ``i`` is ``<name>.<i>``. Default None: generated.
        process_set: run among this ``ProcessSet``'s ranks only; default None: every rank.

    Returns:
        The gathered tensors, in order.

    Raises:
        ValueError: ``tensors`` is not a non-empty list or tuple.
        InvalidInputError: some rank rejected an item (raised on every rank).
        TensorMismatchError: the ranks disagree on an item (raised on every rank).
        NotInitializedError, EngineShutdownError, DuplicateNameError: as for ``allgather``.
    """
    if _is_group(tensors) and _needs_grad(*tensors):
        return list(autograd.GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


@_doc("broadcast")
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s ``tensor`` on every rank; ``tensor`` is
    unchanged. Blocks until done.

    Args:
        {arg_broadcast}
        {arg_name}
        {arg_process_set}

    Returns:
        A new contiguous tensor holding ``root_rank``'s values.

    Raises:
        {raises_broadcast_input}
        {raises_duplicate_name}
        {raises_completed}
        {raises_joined}
    """
    if _needs_grad(tensor):
        return autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


@_doc("broadcast")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values, in place, and return it. Blocks
    until done.

    Args:
        {arg_broadcast}
        {arg_name}
        {arg_process_set}

    Returns:
        ``tensor``, holding ``root_rank``'s values.

    Raises:
        {raises_broadcast_input}
        {raises_duplicate_name}
        {raises_completed}
        {raises_joined}
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


@_doc("reducescatter")
def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default op: Average) and return this rank's share of
    dimension 0. Blocks until done.

    Args:
        {arg_reducescatter_tensor}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        {returns_reducescatter}

    Raises:
        {raises_reducescatter_input}
        {raises_duplicate_name}
        {raises_completed}
        {raises_joined}
    """
    if _needs_grad(tensor):
        return autograd.Reducescatter.apply(tensor, resolve_op(op, None), name,
                                            prescale_factor, postscale_factor, process_set)
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                          name: str | None = None, op: ReduceOp | int | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Reduce-scatter each tensor of a list (submitted together).

    Args:
        tensors: the tensors; each as for ``reducescatter``.
        name: base name: item ``i`` is ``<name>.<i>``. Default None: generated.
        op: as for ``reducescatter`` (default Average).
        prescale_factor: multiply every input by this first. Default 1.0.
        postscale_factor: multiply every result by this. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only; default None: every rank.

    Returns:
        This rank's share of each reduced tensor, in order.

    Raises:
        ValueError: ``tensors`` is not a non-empty list or tuple.
        InvalidInputError: some rank rejected an item (raised on every rank).
        TensorMismatchError: the ranks disagree on an item (raised on every rank).
        NotInitializedError, EngineShutdownError, DuplicateNameError: as for
            ``reducescatter``.
    """
    if _is_group(tensors) and _needs_grad(*tensors):
        return list(autograd.GroupedReducescatter.apply(resolve_op(op, None), name,
                                                        prescale_factor, postscale_factor,
                                                        process_set, *tensors))
    return synchronize(grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                   postscale_factor, process_set))


@_doc("alltoall")
def alltoall(tensor: torch.Tensor, splits: Optional[Sequence[int] | torch.Tensor] = None,
             name: str | None = None, process_set: ProcessSet | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-to-all exchange: send ``splits[d]`` rows of ``tensor`` to each rank ``d`` and
    return what every rank sent here. Blocks until done.

    Args:
        {arg_alltoall}
        {arg_name}
        {arg_process_set}

    Returns:
        {returns_alltoall}

    Raises:
        {raises_alltoall_input}
        {raises_duplicate_name}
        {raises_completed}
        {raises_joined}
    """
    if _needs_grad(tensor):
        output, received = autograd.Alltoall.apply(tensor, splits, name, process_set)
        return output if splits is None else (output, received)
    return synchronize(alltoall_async(tensor, splits, name, process_set))


@_doc("barrier")
def barrier(process_set: ProcessSet | None = None, name: str | None = None) -> None:
    """Return once every rank has called ``barrier`` with this name.

    Agreed like any other collective: it completes when every rank has submitted it, whatever
    other collectives are still in flight (synchronize those first if they must be done).

    Args:
        {arg_name}
        {arg_process_set}

    Raises:
        ValueError: ``name`` is not a non-empty string.
        {raises_duplicate_name}
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before every rank
            arrived.
        MpiddpError: some ranks have called ``join()``.
    """
    if isinstance(process_set, str):        # barrier("name"): the name given first
        process_set, name = name, process_set
    engine, in_set = runtime.engine_for(process_set, "barrier()")
    engine.barrier(collective_name(BARRIER, name, in_set)).wait()


def join(device: int = -1) -> int:
    """Declare this rank out of data (uneven inputs) and block until every rank has joined.

    Meanwhile this rank takes part in the other ranks' allreduces, contributing values that
    change nothing (zeros to sums; Average still divides by ``size()``, joined ranks
    included); any other collective submitted by the remaining ranks fails with
    ``MpiddpError``. Synchronize this rank's own collectives before calling it.

    Args:
        device: accepted for Horovod compatibility (``hvd.join(hvd.local_rank())``), where it
            is the GPU for the zero tensors a joined rank contributes; mpiddp makes those in
            the engine's own buffers, so it is not used.

    Returns:
        The rank that joined last (the highest of those that joined in the same cycle).

    Raises:
        TypeError: ``device`` is not an integer.
        ValueError: a sharded optimizer (``zero_stage``) is alive on this rank.
        MpiddpError: this rank still has collectives in flight.
        RuntimeError: another thread of this rank is already in ``join()``.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before every rank
            joined.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) takes a device index, not {type(device).__name__}")
    sharded = live_sharded_optimizers()
    if sharded:
        raise ValueError(
            f"join() with a DistributedOptimizer(zero_stage=...) ({', '.join(sharded)}): a "
            "joined rank cannot take part in the reduce-scatters and gathers of its shards. "
            "Give every rank the same number of batches (e.g. drop_last=True in the "
            "sampler), or use zero_stage=0")
    engine = runtime.require_engine("join()")
    runtime.complete_deferred_work()     # forward overlap's updates need the other ranks now
    return engine.join().wait()
