"""The asynchronous tensor collectives: each returns a ``TensorHandle`` at once.

Each call checks its input on the calling thread, wraps the tensor's memory without copying
when it is contiguous, and submits a named request to the engine (``requests.py``). Names
default to ``<kind>.noname.<n>``: ranks that call the same collectives in the same order get
the same names.

Rules shared by every call here and by the blocking calls built on them (``collectives.py``):

* Collectives: every rank must make the call, under the same name, with the same dtype,
  device type, op, scale factors and root, and the same shape (for ``allgather`` and
  ``alltoall``: the same shape beyond dimension 0). Ranks may submit in different orders;
  the engine matches requests by name. A disagreement fails that request on every rank with
  ``TensorMismatchError`` (raised by ``synchronize``); the engine goes on serving.
* Tensors: cpu, or cuda on this rank's GPU (CuPy needed); dtypes float16, bfloat16,
  float32, float64, int8, uint8, int16, int32, int64, bool, complex64 and complex128 (Sum
  and Average; a conjugate view is reduced as it reads, through a copy). The engine reads
  (and, in place, writes) the tensor's memory directly: leave it alone until ``synchronize``
  returns. For a cuda tensor the engine first waits for the work queued on the current
  stream at the call.
* Bad input never leaves the other ranks waiting: a rank that rejects its own input (the
  ``TypeError``/``ValueError`` causes each call lists) submits the request marked invalid
  instead of raising alone, and every rank's ``synchronize`` raises ``InvalidInputError`` (a
  ``ValueError`` and ``RuntimeError``) naming each rejecting rank and its reason; on a rank
  whose own check was a type check it is ``InvalidInputTypeError``, also a ``TypeError``.
  Only a bad ``name`` (or a non-list for the grouped calls) is raised locally at once.
* ``synchronize(handle)`` waits and returns the result, ``poll(handle)`` tells whether it is
  ready.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ... import runtime
from ...engine.request import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER
from ...reduce_ops import ReduceOp
from ...runtime import ProcessSet
from .handles import TensorHandle, synchronize
from ..core.naming import collective_name, root_rank as check_root
from .requests import (allgather_entry, allreduce_entry, allreduce_output, alltoall_entry,
                       broadcast_entry, check_tensor, group_names, reducescatter_entry,
                       resolve_op, submit_checked)
from .shared_docs import SNIPPETS
from ...docstrings import shared_doc

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather_async", "grouped_allgather_async",
           "broadcast_async", "broadcast_async_", "reducescatter_async",
           "grouped_reducescatter_async", "alltoall_async", "sparse_allreduce_async"]


def _doc(kind: str = "allreduce"):
    return shared_doc(SNIPPETS, kind=kind)


# ---- allreduce -------------------------------------------------------------------------
def _allreduce_async(tensor, in_place, average, name, op, prescale_factor, postscale_factor,
                     process_set) -> TensorHandle:
    engine, in_set = runtime.engine_for(process_set, "allreduce()")
    name = collective_name(ALLREDUCE, name, in_set)

    def build():
        check_tensor(tensor, name)
        output, finalize = allreduce_output(tensor, in_place)
        return [allreduce_entry(tensor, output, name, resolve_op(op, average),
                                prescale_factor, postscale_factor)], finalize

    return submit_checked(engine, ALLREDUCE, [name], build)


@_doc()
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks (default op: Average) into a new tensor.

    A non-contiguous ``tensor`` is copied at the call; a contiguous one is read in place
    until the handle completes.

    Args:
        {arg_reduce_tensor}
        {arg_average}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new contiguous tensor of the same
        shape, dtype and device holding the reduction.

    Raises:
        {raises_allreduce_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    return _allreduce_async(tensor, False, average, name, op, prescale_factor, postscale_factor,
                            process_set)


@_doc()
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks in place (default op: Average).

    A non-contiguous ``tensor`` is reduced in a contiguous copy, written back into it by
    ``synchronize``.

    Args:
        {arg_reduce_tensor}
        {arg_average}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns ``tensor`` holding the reduction.

    Raises:
        {raises_allreduce_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    return _allreduce_async(tensor, True, average, name, op, prescale_factor, postscale_factor,
                            process_set)


def _grouped_async(tensors, in_place, average, name, op, prescale_factor, postscale_factor,
                   process_set) -> TensorHandle:
    engine, in_set = runtime.engine_for(process_set, "grouped_allreduce()")
    names = group_names(ALLREDUCE, tensors, name, "grouped_allreduce", in_set)

    def build():
        reduce_op = resolve_op(op, average)
        entries, finalizers = [], []
        for item, tensor in zip(names, tensors):
            check_tensor(tensor, item)
            output, finalize = allreduce_output(tensor, in_place)
            entries.append(allreduce_entry(tensor, output, item, reduce_op, prescale_factor,
                                           postscale_factor))
            finalizers.append(finalize)
        return entries, lambda: [finalize() for finalize in finalizers]

    return submit_checked(engine, ALLREDUCE, names, build)


@_doc()
def grouped_allreduce_async(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                            average: bool | None = None, name: str | None = None,
                            op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing a list of tensors across ranks (default op: Average) into new tensors.

    The tensors are submitted together, so one negotiation covers them and they fuse
    together where dtype and device agree (up to ``MPIDDP_FUSION_THRESHOLD`` bytes).

    Args:
        {arg_reduce_tensors}
        {arg_average}
        {arg_group_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a list of new contiguous tensors, in
        the order of ``tensors``.

    Raises:
        {raises_grouped_allreduce_input}
        {raises_submitted}
    """
    return _grouped_async(tensors, False, average, name, op, prescale_factor, postscale_factor,
                          process_set)


@_doc()
def grouped_allreduce_async_(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                             average: bool | None = None, name: str | None = None,
                             op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing a list of tensors across ranks in place (default op: Average).

    The tensors are submitted together, so one negotiation covers them and they fuse
    together where dtype and device agree (up to ``MPIDDP_FUSION_THRESHOLD`` bytes).

    Args:
        {arg_reduce_tensors}
        {arg_average}
        {arg_group_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a list of the input tensors, holding
        the reductions.

    Raises:
        {raises_grouped_allreduce_input}
        {raises_submitted}
    """
    return _grouped_async(tensors, True, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: ReduceOp | int | None = None,
                           process_set: ProcessSet | None = None) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor (e.g. an ``nn.Embedding(sparse=True)`` gradient)
    by gathering every rank's indices and values, as Horovod does: the bytes moved grow with
    the rows actually touched, not with the dense size.

    Args:
        tensor: a sparse COO tensor, the same dense shape on every rank.
        name: base name (``<name>.indices`` and ``<name>.values``). Default None: generated.
        op: ``Average`` (default: the values are divided by the number of ranks) or ``Sum``.
        process_set: run among this ``ProcessSet``'s ranks only; default None: every rank.

    Returns:
        A function (Horovod's handle); calling it waits and returns the reduced sparse tensor
        (uncoalesced: indices that several ranks touched appear once per rank, and add up in
        ``to_dense()`` or ``coalesce()``).

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor.
        ValueError: ``op`` is neither Average nor Sum.
        NotInitializedError, EngineShutdownError, DuplicateNameError: as for ``allgather``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("sparse_allreduce_async takes a sparse COO tensor; use allreduce for "
                        "dense ones")
    reduce_op = resolve_op(op, None)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, not "
                         f"{reduce_op.name.title()}")
    base = collective_name("sparse_allreduce", name, process_set)
    coo = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along dimension 0: gather the indices as rows (one per value).
    indices = allgather_async(coo.indices().t().contiguous(), f"{base}.indices", process_set)
    values = allgather_async(coo.values().contiguous(), f"{base}.values", process_set)

    def handle() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if reduce_op == ReduceOp.AVERAGE:
            gathered_values = gathered_values / runtime.set_size(process_set)
        # The indices are every rank's own coalesced ones of a tensor of this shape (the
        # shapes agreed in the negotiation): saying so spares a check, and torch's warning
        # that it was skipped implicitly.
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       check_invariants=False)

    return handle


# ---- gathers, broadcast, reduce-scatter, all-to-all -------------------------------------
@_doc("allgather")
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes may differ).

    Args:
        {arg_gather_tensor}
        {arg_name}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new tensor of shape
        ``(sum of every rank's dimension 0, *tensor.shape[1:])``, rank 0's rows first.

    Raises:
        {raises_tensor_type}
        ValueError: ``tensor`` is a scalar (0-d); ``name`` not a non-empty string; a cuda
            tensor not on this rank's GPU.
        {raises_duplicate_name}
        {raises_submitted}
    """
    engine, in_set = runtime.engine_for(process_set, "allgather()")
    name = collective_name(ALLGATHER, name, in_set)

    def build():
        entry, output = allgather_entry(tensor, name)
        return [entry], output

    return submit_checked(engine, ALLGATHER, [name], build)


def grouped_allgather_async(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                            name: str | None = None,
                            process_set: ProcessSet | None = None) -> TensorHandle:
    """Start all-gathering each tensor of a list, submitted together (one negotiation).

    Args:
        tensors: the tensors; each as for ``allgather`` (its first dimension may differ
            across ranks).
        name: base name: item ``i`` is ``<name>.<i>``. Default None: generated.
        process_set: run among this ``ProcessSet``'s ranks only; default None: every rank.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns the list of gathered tensors.

    Raises:
        ValueError: ``tensors`` is not a non-empty list or tuple. Bad items fail on every rank
            as ``InvalidInputError`` at ``synchronize`` (see the module docstring).
        NotInitializedError, EngineShutdownError, DuplicateNameError: as for ``allgather``.
    """
    engine, in_set = runtime.engine_for(process_set, "grouped_allgather()")
    names = group_names(ALLGATHER, tensors, name, "grouped_allgather", in_set)

    def build():
        made = [allgather_entry(t, n) for t, n in zip(tensors, names)]
        return [entry for entry, _ in made], lambda: [output() for _, output in made]

    return submit_checked(engine, ALLGATHER, names, build)


def _broadcast_async(tensor, root_rank, name, in_place, process_set) -> TensorHandle:
    engine, in_set = runtime.engine_for(process_set, "broadcast()")
    name = collective_name(BROADCAST, name, in_set)

    def build():
        check_tensor(tensor, name)
        what = f"broadcast of '{name}'"
        table = runtime.require("broadcast()").process_sets
        root = table.rank_in_set(in_set, check_root(root_rank, runtime.size(), what), what)
        return broadcast_entry(tensor, root, name, in_place)

    return submit_checked(engine, BROADCAST, [name], build)


@_doc("broadcast")
def broadcast_async(tensor: torch.Tensor, root_rank: int,
                    name: str | None = None,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start sending ``root_rank``'s ``tensor`` to every rank, into a new tensor.

    Args:
        {arg_broadcast}
        {arg_name}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new contiguous tensor holding
        ``root_rank``'s values (on ``root_rank`` too); ``tensor`` is unchanged.

    Raises:
        {raises_broadcast_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    return _broadcast_async(tensor, root_rank, name, False, process_set)


@_doc("broadcast")
def broadcast_async_(tensor: torch.Tensor, root_rank: int,
                     name: str | None = None,
                     process_set: ProcessSet | None = None) -> TensorHandle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place.

    Args:
        {arg_broadcast}
        {arg_name}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns ``tensor`` holding ``root_rank``'s
        values (a non-contiguous ``tensor`` is written back at ``synchronize``).

    Raises:
        {raises_broadcast_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    return _broadcast_async(tensor, root_rank, name, True, process_set)


@_doc("reducescatter")
def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks (default op: Average) and keep rank r's share
    of dimension 0 (rows split as evenly as possible, the first ranks taking one extra).

    Args:
        {arg_reducescatter_tensor}
        {arg_name}
        {arg_op}
        {arg_scale_factors}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns:
        {returns_reducescatter}

    Raises:
        {raises_reducescatter_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    engine, in_set = runtime.engine_for(process_set, "reducescatter()")
    name = collective_name(REDUCESCATTER, name, in_set)

    def build():
        entry, output = reducescatter_entry(tensor, name, op, prescale_factor,
                                            postscale_factor)
        return [entry], output

    return submit_checked(engine, REDUCESCATTER, [name], build)


def grouped_reducescatter_async(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                                name: str | None = None,
                                op: ReduceOp | int | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reduce-scattering each tensor of a list, submitted together.

    Args:
        tensors: the tensors; each as for ``reducescatter``.
        name: base name: item ``i`` is ``<name>.<i>``. Default None: generated.
        op: as for ``reducescatter`` (default Average).
        prescale_factor: multiply every input by this first. Default 1.0.
        postscale_factor: multiply every result by this. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only; default None: every rank.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns the list of this rank's shares.

    Raises:
        ValueError: ``tensors`` is not a non-empty list or tuple. Bad items fail on every rank
            as ``InvalidInputError`` at ``synchronize``.
        NotInitializedError, EngineShutdownError, DuplicateNameError: as for
            ``reducescatter``.
    """
    engine, in_set = runtime.engine_for(process_set, "grouped_reducescatter()")
    names = group_names(REDUCESCATTER, tensors, name, "grouped_reducescatter", in_set)

    def build():
        made = [reducescatter_entry(t, n, op, prescale_factor, postscale_factor)
                for t, n in zip(tensors, names)]
        return [entry for entry, _ in made], lambda: [output() for _, output in made]

    return submit_checked(engine, REDUCESCATTER, names, build)


@_doc("alltoall")
def alltoall_async(tensor: torch.Tensor,
                   splits: Optional[Sequence[int] | torch.Tensor] = None,
                   name: str | None = None,
                   process_set: ProcessSet | None = None) -> TensorHandle:
    """Start sending ``splits[d]`` rows of ``tensor`` to each rank ``d`` (default: equal
    shares) and receiving what every rank sends here, concatenated in rank order.

    Args:
        {arg_alltoall}
        {arg_name}
        {arg_process_set}

    Returns:
        A ``TensorHandle``; ``synchronize`` returns:
        {returns_alltoall}

    Raises:
        {raises_alltoall_input}
        {raises_duplicate_name}
        {raises_submitted}
    """
    engine, in_set = runtime.engine_for(process_set, "alltoall()")
    name = collective_name(ALLTOALL, name, in_set)
    return submit_checked(engine, ALLTOALL, [name],
                          lambda: alltoall_entry(tensor, splits, name, engine.size))
