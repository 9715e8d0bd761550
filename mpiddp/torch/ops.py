"""The tensor API: collectives on torch tensors, synchronous and asynchronous.

Each call checks its input on the calling thread (clear errors at once), wraps the tensor's
memory without copying when it is contiguous, and submits a named request to the engine.
Names default to ``<op>.noname.<n>``: ranks that call the same collectives in the same
order get the same names.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import runtime
from ..buffers.dtypes import dtype_named
from ..engine.handle import Handle
from ..engine.request import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                              REDUCESCATTER, Entry, Request)
from ..ops import ReduceOp, check_op_for_dtype
from .naming import collective_name, root_rank as check_root
from .views import device_name, dtype_name, flat_array

class TensorHandle:
    """What the ``*_async`` calls return; pass it to ``synchronize`` or ``poll``."""

    __slots__ = ("_handles", "_finalize", "_value", "_finished")

    def __init__(self, handles: list[Handle], finalize: Callable[[], object]):
        self._handles = handles
        self._finalize = finalize
        self._finished = False
        self._value = None

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self):
        if not self._finished:
            error = None
            for handle in self._handles:    # wait for all: none may still write afterwards
                try:
                    handle.wait()
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error
            self._value = self._finalize()
            self._finished = True
        return self._value

    @property
    def names(self) -> list[str]:
        return [h.name for h in self._handles]

    def __repr__(self) -> str:
        return f"<mpiddp.TensorHandle {self.names} {'done' if self.done() else 'pending'}>"


def synchronize(handle: TensorHandle):
    """Wait for an asynchronous collective; return its output (or raise its error)."""
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async call, "
                        f"not {type(handle).__name__}")
    return handle.wait()


def poll(handle: TensorHandle) -> bool:
    """True when ``synchronize(handle)`` would return without waiting."""
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"poll() takes a handle returned by an *_async call, "
                        f"not {type(handle).__name__}")
    return handle.done()


def _check_tensor(tensor, name: str) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor, not {type(tensor).__name__}")
    return dtype_name(tensor, name)


def _resolve_op(op, average) -> ReduceOp:
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


def _check_scaling(dtype: str, prescale: float, postscale: float, name: str) -> None:
    if (prescale != 1.0 or postscale != 1.0) and dtype_named(dtype).kind != "float":
        raise ValueError(f"prescale/postscale factors need a floating-point tensor, but "
                         f"'{name}' is {dtype}")


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _ready_event(tensor: torch.Tensor):
    """For device tensors: an event on the producing stream the engine waits for."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _submit(entries: list[Entry], finalize: Callable[[], object]) -> TensorHandle:
    engine = runtime.require_engine(entries[0].request.kind + "()")
    return TensorHandle(engine.submit_many(entries), finalize)


def _entry(request: Request, tensor: torch.Tensor, output=None, allocate=None) -> Entry:
    return Entry(request, flat_array(tensor), output, Handle(request.name),
                 allocate=allocate, ready_event=_ready_event(tensor))


# ---- allreduce -------------------------------------------------------------------------
def _allreduce_entry(tensor, output, name, op, prescale, postscale) -> Entry:
    dtype = _check_tensor(tensor, name)
    check_op_for_dtype(op, dtype_named(dtype).kind, dtype, name)
    _check_scaling(dtype, prescale, postscale, name)
    request = Request(name, ALLREDUCE, dtype, tuple(tensor.shape), device_name(tensor),
                      op=int(op), prescale=float(prescale), postscale=float(postscale))
    if output is tensor:        # in place on contiguous memory: one view serves both
        view = flat_array(tensor)
        return Entry(request, view, view, Handle(name), ready_event=_ready_event(tensor))
    return _entry(request, _contiguous(tensor), flat_array(output))


def allreduce_request_(tensor: torch.Tensor, name: str, op=ReduceOp.AVERAGE,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Entry:
    """Check ``tensor`` (contiguous) and describe an in-place all-reduce of it named ``name``,
    without submitting it: a building block for framework glue (``DistributedOptimizer``)
    that submits many at once with ``submit_together``."""
    if not tensor.is_contiguous():
        raise ValueError(f"allreduce_request_ of '{name}' needs a contiguous tensor")
    return _allreduce_entry(tensor, tensor, name, ReduceOp(op), prescale_factor,
                            postscale_factor)


def submit_together(entries: list) -> list:
    """Submit requests made by ``allreduce_request_`` in one go: the engine takes them in the
    same cycle, so one negotiation covers them all and they fuse together. Returns one
    ``TensorHandle`` per entry, in order."""
    engine = runtime.require_engine("submit_together()")
    return [TensorHandle([handle], _nothing) for handle in engine.submit_many(entries)]


def _nothing():
    return None


def _allreduce_async(tensor, in_place, average, name, op, prescale_factor, postscale_factor):
    runtime.require_engine("allreduce()")
    name = collective_name(ALLREDUCE, name)
    op = _resolve_op(op, average)
    _check_tensor(tensor, name)
    if in_place and tensor.is_contiguous():
        output = tensor
        finalize = lambda: tensor  # noqa: E731
    elif in_place:
        # Reduce into a contiguous copy, then write it back: never silently wrong data.
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        finalize = lambda: tensor.copy_(output)  # noqa: E731
    else:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        finalize = lambda: output  # noqa: E731
    entry = _allreduce_entry(tensor, output, name, op, prescale_factor, postscale_factor)
    return _submit([entry], finalize)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0) -> TensorHandle:
    """Start reducing ``tensor`` across ranks (default op: Average) into a new tensor."""
    return _allreduce_async(tensor, False, average, name, op, prescale_factor, postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0) -> TensorHandle:
    """Start reducing ``tensor`` across ranks in place."""
    return _allreduce_async(tensor, True, average, name, op, prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return the result as a new tensor."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                       postscale_factor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def _grouped_async(tensors, in_place, average, name, op, prescale_factor, postscale_factor):
    runtime.require_engine("grouped_allreduce()")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("grouped_allreduce takes a non-empty list of tensors")
    base = collective_name(ALLREDUCE, name)
    op = _resolve_op(op, average)
    entries, outputs = [], []
    for i, tensor in enumerate(tensors):
        item = f"{base}.{i}"
        _check_tensor(tensor, item)
        output = tensor if in_place and tensor.is_contiguous() else torch.empty_like(
            tensor, memory_format=torch.contiguous_format)
        entries.append(_allreduce_entry(tensor, output, item, op, prescale_factor,
                                        postscale_factor))
        outputs.append(output)

    def finalize():
        if in_place:
            return [t if t is o else t.copy_(o) for t, o in zip(tensors, outputs)]
        return outputs

    return _submit(entries, finalize)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0) -> TensorHandle:
    """Start reducing a list of tensors, submitted together so they fuse together."""
    return _grouped_async(tensors, False, average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0) -> TensorHandle:
    return _grouped_async(tensors, True, average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0) -> list:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor))


# ---- gathers, broadcast, reduce-scatter, all-to-all -------------------------------------
def _output_allocator(like: torch.Tensor, holder: dict):
    def allocate(shape):
        holder["output"] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return flat_array(holder["output"])
    return allocate


def _needs_dim(tensor: torch.Tensor, name: str, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension; "
                         f"'{name}' is a scalar (use tensor.reshape(1))")


def allgather_async(tensor, name=None) -> TensorHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    runtime.require_engine("allgather()")
    name = collective_name(ALLGATHER, name)
    dtype = _check_tensor(tensor, name)
    _needs_dim(tensor, name, "allgather")
    holder: dict = {}
    request = Request(name, ALLGATHER, dtype, tuple(tensor.shape), device_name(tensor))
    entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return _submit([entry], lambda: holder["output"])


def allgather(tensor, name=None) -> torch.Tensor:
    return synchronize(allgather_async(tensor, name))


def _broadcast_async(tensor, root_rank, name, in_place):
    rt = runtime.require("broadcast()")
    name = collective_name(BROADCAST, name)
    dtype = _check_tensor(tensor, name)
    root_rank = check_root(root_rank, rt.comm.Get_size(), f"broadcast of '{name}'")
    request = Request(name, BROADCAST, dtype, tuple(tensor.shape), device_name(tensor),
                      root=root_rank)
    if in_place and tensor.is_contiguous():
        output, finalize = tensor, (lambda: tensor)
    else:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        finalize = (lambda: tensor.copy_(output)) if in_place else (lambda: output)
    entry = _entry(request, _contiguous(tensor), flat_array(output))
    if output is tensor:
        entry.input = entry.output
    return _submit([entry], finalize)


def broadcast_async(tensor, root_rank, name=None) -> TensorHandle:
    return _broadcast_async(tensor, root_rank, name, in_place=False)


def broadcast_async_(tensor, root_rank, name=None) -> TensorHandle:
    return _broadcast_async(tensor, root_rank, name, in_place=True)


def broadcast(tensor, root_rank, name=None) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s ``tensor`` on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def broadcast_(tensor, root_rank, name=None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values, in place."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def reducescatter_async(tensor, name=None, op=None, prescale_factor=1.0,
                        postscale_factor=1.0) -> TensorHandle:
    """Start reducing ``tensor`` across ranks and keep rank r's share of dimension 0
    (rows split as evenly as possible, the first ranks taking one extra)."""
    runtime.require_engine("reducescatter()")
    name = collective_name(REDUCESCATTER, name)
    op = _resolve_op(op, None)
    dtype = _check_tensor(tensor, name)
    _needs_dim(tensor, name, "reducescatter")
    check_op_for_dtype(op, dtype_named(dtype).kind, dtype, name)
    _check_scaling(dtype, prescale_factor, postscale_factor, name)
    holder: dict = {}
    request = Request(name, REDUCESCATTER, dtype, tuple(tensor.shape), device_name(tensor),
                      op=int(op), prescale=float(prescale_factor),
                      postscale=float(postscale_factor))
    entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return _submit([entry], lambda: holder["output"])


def reducescatter(tensor, name=None, op=None, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor))


def alltoall_async(tensor, splits: Optional[Sequence[int]] = None, name=None) -> TensorHandle:
    """Start sending ``splits[d]`` rows of ``tensor`` to each rank ``d`` (default: equal
    shares) and receiving what every rank sends here, concatenated in rank order."""
    rt = runtime.require("alltoall()")
    name = collective_name(ALLTOALL, name)
    dtype = _check_tensor(tensor, name)
    _needs_dim(tensor, name, "alltoall")
    size, rows = rt.comm.Get_size(), tensor.shape[0]
    explicit = splits is not None
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall of '{name}': {rows} rows do not split evenly over "
                             f"{size} ranks; pass splits=")
        splits = [rows // size] * size
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"alltoall of '{name}': splits {splits} must be {size} non-negative "
                         f"row counts adding up to the tensor's {rows} rows")
    holder: dict = {}
    request = Request(name, ALLTOALL, dtype, tuple(tensor.shape), device_name(tensor),
                      splits=tuple(splits))
    entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))

    def finalize():
        received = torch.tensor(entry.handle.info, dtype=torch.int32)
        return (holder["output"], received) if explicit else holder["output"]

    return _submit([entry], finalize)


def alltoall(tensor, splits=None, name=None):
    """All-to-all exchange; returns the output, or (output, received splits) when ``splits``
    is given."""
    return synchronize(alltoall_async(tensor, splits, name))


def barrier(name=None) -> None:
    """Return once every rank has called barrier (ordered with the other collectives)."""
    engine = runtime.require_engine("barrier()")
    engine.barrier(collective_name(BARRIER, name)).wait()


def join() -> int:
    """Declare this rank out of data: it keeps taking part in the other ranks' allreduces with
    zeros until every rank has joined. Returns the rank that joined last."""
    handle = runtime.require_engine("join()").join()
    return handle.wait()
