"""From torch tensors to engine requests: input checks, one entry builder per collective,
and submission.

An entry builder checks this rank's input on the calling thread and describes the request
(``engine.request.Entry``): its metadata, a flat view of the tensor's memory (no copy when it
is contiguous), where the result goes and, for device tensors, the event the engine waits for.
``submit_checked`` turns a rejected input into an agreed error instead of a lonely exception
(see ``mpiddp.torch.ops.async_ops``). ``allreduce_request_`` and ``submit_together`` are the
building blocks framework glue (``DistributedOptimizer``) uses to submit many at once.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import runtime
from ...buffers.dtypes import dtype_named
from ...engine.handle import Handle
from ...engine.request import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER, Entry,
                              Request)
from ...reduce_ops import ReduceOp, check_op_for_dtype
from ...runtime import ProcessSet
from .handles import TensorHandle
from ..core.naming import collective_name
from ..core.streams import caller_stream, ready_event as stream_ready_event, record_use
from ..core.views import device_name, dtype_name, flat_array, resizable_array

__all__ = ["allreduce_request_", "submit_together"]

# What an entry builder returns: the entries to submit, and what ``synchronize`` returns.
Built = tuple[list[Entry], Callable[[], object]]


# ---- input checks --------------------------------------------------------------------------
def check_tensor(tensor, name: str) -> str:
    """The engine's dtype name of ``tensor``; TypeError for a non-tensor or unsupported dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor, not {type(tensor).__name__}")
    return dtype_name(tensor, name)


def resolve_op(op, average) -> ReduceOp:
    """The reduction from ``op`` or Horovod's older ``average`` (default: Average)."""
    if average is None and type(op) is ReduceOp:
        return op
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the older average=, not both")
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}: use Average, Sum, Min, Max or Product") \
            from None


def check_scaling(dtype: str, prescale: float, postscale: float, name: str) -> None:
    if (prescale != 1.0 or postscale != 1.0) and dtype_named(dtype).kind == "bool":
        raise ValueError(f"prescale/postscale factors need a numeric tensor, but "
                         f"'{name}' is {dtype}")


def check_dims(tensor: torch.Tensor, name: str, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension; "
                         f"'{name}' is a scalar (use tensor.reshape(1))")


def group_names(kind: str, tensors, name: Optional[str], what: str,
                process_set: Optional[ProcessSet]) -> list[str]:
    """Names of a grouped call's items, ``<base>.<i>``."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what} takes a non-empty list of tensors")
    base = collective_name(kind, name, process_set)
    return [f"{base}.{i}" for i in range(len(tensors))]


# ---- building entries ---------------------------------------------------------------------
def plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values as they read, in order: contiguous, and no
    lazy conjugation or negation (autograd hands over ``W.mH``'s gradient as a conjugate
    view; its memory holds the values unconjugated)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a plain copy of it (``plain``)."""
    return tensor if plain(tensor) else tensor.resolve_conj().resolve_neg().contiguous()


def _entry(request: Request, tensor: torch.Tensor, output=None, allocate=None) -> Entry:
    return Entry(request, flat_array(tensor), output, Handle(request.name),
                 allocate=allocate, ready_event=stream_ready_event(tensor))


def _output_allocator(like: torch.Tensor, holder: dict):
    """An ``Entry.allocate`` that makes the output once the engine knows its shape (kept in
    ``holder['output']``). It runs on the engine thread inside the backend's
    ``allocating()``, so the output belongs to the engine stream that writes it; the caller's
    stream, taken now, is recorded as its other user."""
    stream = caller_stream(like)

    def allocate(shape):
        output = holder["output"] = torch.empty(shape, dtype=like.dtype, device=like.device)
        record_use(output, stream)
        return flat_array(output)
    return allocate


def allreduce_entry(tensor, output, name: str, op: ReduceOp, prescale: float,
                    postscale: float, ready_event=None) -> Entry:
    """Check ``tensor`` and describe its all-reduce into ``output`` (which may be
    ``tensor`` itself: in place). ``ready_event``: recorded where ``tensor`` was produced
    (default: now, on the current stream)."""
    dtype = check_tensor(tensor, name)
    check_op_for_dtype(op, dtype_named(dtype).kind, dtype, name)
    check_scaling(dtype, prescale, postscale, name)
    request = Request(name, ALLREDUCE, dtype, tuple(tensor.shape), device_name(tensor),
                      op=int(op), prescale=float(prescale), postscale=float(postscale))
    source = tensor if output is tensor else contiguous(tensor)
    if ready_event is None:     # after the copy contiguous() may have queued
        ready_event = stream_ready_event(source)
    if output is tensor:        # in place on contiguous memory: one view serves both
        view = flat_array(tensor)
        return Entry(request, view, view, Handle(name), ready_event=ready_event)
    return Entry(request, flat_array(source), flat_array(output), Handle(name),
                 ready_event=ready_event)


def allreduce_output(tensor: torch.Tensor, in_place: bool):
    """(output tensor, what ``synchronize`` returns) of an all-reduce of ``tensor``. In place
    on a tensor that is not ``plain`` (non-contiguous, a conjugate view): reduce a plain copy
    and write it back (``copy_`` honours the view), never silently wrong data."""
    if in_place and plain(tensor):
        return tensor, lambda: tensor
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if in_place:
        return output, lambda: tensor.copy_(output)
    return output, lambda: output


def allgather_entry(tensor, name: str) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Check ``tensor`` and describe its all-gather; returns (entry, the output getter)."""
    dtype = check_tensor(tensor, name)
    check_dims(tensor, name, "allgather")
    holder: dict = {}
    request = Request(name, ALLGATHER, dtype, tuple(tensor.shape), device_name(tensor))
    entry = _entry(request, contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return entry, lambda: holder["output"]


def ring_allgather_entry(chunk: torch.Tensor, output: torch.Tensor, name: str,
                         ring_order: int, resizable: bool = False) -> Entry:
    """A sharded optimizer's gather (``Request.ring_order``: how the bucket is cut): ``chunk``
    is this rank's piece of the flat ``output``, which receives every rank's. ``output`` may be
    the parameter itself, with ``chunk`` a view of its own elements. ``resizable``: leave
    ``output``'s storage resizable (stage 3 frees it between uses)."""
    dtype = check_tensor(chunk, name)
    request = Request(name, ALLGATHER, dtype, (output.numel(),), device_name(chunk),
                      ring_order=ring_order)
    view = resizable_array(output) if resizable else flat_array(output)
    return Entry(request, flat_array(chunk), view, Handle(name), allocate=lambda shape: view,
                 ready_event=stream_ready_event(chunk))


def broadcast_entry(tensor, root: int, name: str, in_place: bool) -> Built:
    """Check ``tensor`` and describe its broadcast from ``root`` (a rank of the engine)."""
    dtype = check_tensor(tensor, name)
    request = Request(name, BROADCAST, dtype, tuple(tensor.shape), device_name(tensor),
                      root=root)
    output, finalize = allreduce_output(tensor, in_place)
    entry = _entry(request, contiguous(tensor), flat_array(output))
    if output is tensor:
        entry.input = entry.output
    return [entry], finalize


def reducescatter_entry(tensor, name: str, op, prescale_factor: float,
                        postscale_factor: float) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Check ``tensor`` and describe its reduce-scatter; returns (entry, the output getter)."""
    reduce_op = resolve_op(op, None)
    dtype = check_tensor(tensor, name)
    check_dims(tensor, name, "reducescatter")
    if reduce_op == ReduceOp.ADASUM:
        raise ValueError(f"op=Adasum is not defined for reducescatter '{name}': Adasum "
                         "combines whole tensors (use allreduce with op=Adasum, or op=Sum / "
                         "op=Average here)")
    check_op_for_dtype(reduce_op, dtype_named(dtype).kind, dtype, name)
    check_scaling(dtype, prescale_factor, postscale_factor, name)
    holder: dict = {}
    request = Request(name, REDUCESCATTER, dtype, tuple(tensor.shape), device_name(tensor),
                      op=int(reduce_op), prescale=float(prescale_factor),
                      postscale=float(postscale_factor))
    entry = _entry(request, contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return entry, lambda: holder["output"]


def alltoall_entry(tensor, splits, name: str, size: int) -> Built:
    """Check ``tensor`` and ``splits`` (rows for each of ``size`` ranks) and describe the
    all-to-all; ``synchronize`` returns the output, with the received counts when
    ``splits`` was given."""
    dtype = check_tensor(tensor, name)
    check_dims(tensor, name, "alltoall")
    rows = tensor.shape[0]
    counts = splits
    if counts is None:
        if rows % size:
            raise ValueError(f"alltoall of '{name}': {rows} rows do not split evenly over "
                             f"{size} ranks; pass splits=")
        counts = [rows // size] * size
    counts = [int(s) for s in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if len(counts) != size or any(s < 0 for s in counts) or sum(counts) != rows:
        raise ValueError(f"alltoall of '{name}': splits {counts} must be {size} "
                         f"non-negative row counts adding up to the tensor's {rows} rows")
    holder: dict = {}
    request = Request(name, ALLTOALL, dtype, tuple(tensor.shape), device_name(tensor),
                      splits=tuple(counts))
    entry = _entry(request, contiguous(tensor), allocate=_output_allocator(tensor, holder))

    def finalize():
        received = torch.tensor(entry.handle.info, dtype=torch.int32)
        return (holder["output"], received) if splits is not None else holder["output"]

    return [entry], finalize


# ---- submitting ---------------------------------------------------------------------------
def nothing():
    return None


def submit_checked(engine, kind: str, names: list[str], build: Callable[[], Built]
                   ) -> TensorHandle:
    """Run ``build()``, which checks this rank's input and returns (entries, finalize), and
    submit the entries. When this rank rejects its input (``build`` raises TypeError or
    ValueError), raising here alone would leave the other ranks waiting forever for a
    collective this rank never submits: it submits ``names`` marked invalid instead, and every
    rank's handle raises the agreed ``InvalidInputError`` naming this rank and its reason."""
    try:
        entries, finalize = build()
    except (TypeError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        entries = []
        for name in names:
            entry = Entry(Request(name, kind, "invalid", (), invalid=reason), None, None,
                          Handle(name))
            entry.rejected = exc
            entries.append(entry)
        finalize = nothing
    return TensorHandle(engine.submit_many(entries), finalize)


def allreduce_request_(tensor: torch.Tensor, name: str, op: ReduceOp | int = ReduceOp.AVERAGE,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       priority: int = 0, cycle_bytes: int = 0,
                       ready_event: Optional["torch.cuda.Event"] = None) -> Entry:
    """Check ``tensor`` and describe an in-place all-reduce of it named ``name``, without
    submitting it: a building block for framework glue (``DistributedOptimizer``) that
    submits many at once with ``submit_together``. Does not need ``init()``.

    Args:
        tensor: a contiguous tensor, reduced in place once submitted.
        name: the request's name; the same on every rank, not in flight when submitted.
        op: the reduction (default ``Average``), as for ``allreduce``.
        prescale_factor: multiply by this before the reduction (not on bool).
            Default 1.0.
        postscale_factor: multiply the result by this (not on bool). Default 1.0.
        priority: 0 (default) runs in submission order; > 0 lets the engine run it by
            urgency, 1 first (the same on every rank; see ``Request.priority``).
        cycle_bytes: with a priority, the most bytes of prioritized all-reduces a cycle
            runs (``Request.cycle_bytes``); 0 (default): ``MPIDDP_PRIORITY_CYCLE_BYTES``.
        ready_event: for a CUDA tensor, a ``torch.cuda.Event`` recorded on the stream that
            produced it, where it was produced (a gradient's hook); default None: recorded
            now on the current stream.

    Returns:
        The request, to pass to ``submit_together``.

    Raises:
        ValueError: ``tensor`` is not contiguous (or is a conjugate view); ``op`` is not a
            ``ReduceOp`` value or does not apply to the dtype (anything but Min/Max on bool;
            anything but Sum/Average on complex);
            scale factors other than 1.0 on a bool tensor; a cuda tensor not
            on this rank's GPU.
        TypeError: unsupported dtype or device.
    """
    if not plain(tensor):
        raise ValueError(f"allreduce_request_ of '{name}' needs a contiguous tensor without "
                         "lazy conjugation (tensor.resolve_conj().contiguous())")
    entry = allreduce_entry(tensor, tensor, name, ReduceOp(op), prescale_factor,
                            postscale_factor, ready_event)
    if priority:
        entry.request = entry.request._replace(priority=int(priority),
                                               cycle_bytes=int(cycle_bytes))
    return entry


def submit_together(entries: list[Entry],
                    process_set: ProcessSet | None = None) -> list[TensorHandle]:
    """Submit requests made by ``allreduce_request_`` in one go: the engine takes them in the
    same cycle, so one negotiation covers them all and they fuse together.

    Args:
        entries: requests from ``allreduce_request_``, with distinct names.
        process_set: submit to this ``ProcessSet``'s engine; default None: every rank's.

    Returns:
        One ``TensorHandle`` per entry, in order; ``synchronize`` on it returns None (the
        result is in the entry's tensor).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
        DuplicateNameError: a name is already in flight on this rank, or appears twice in
            ``entries``; nothing is submitted then.
    """
    engine, _ = runtime.engine_for(process_set, "submit_together()")
    return [TensorHandle([handle], nothing) for handle in engine.submit_many(entries)]
