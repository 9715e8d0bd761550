"""The tensor API: collectives on torch tensors, synchronous and asynchronous.

Each call checks its input on the calling thread, wraps the tensor's memory without copying
when it is contiguous, and submits a named request to the engine.
Names default to ``<op>.noname.<n>``: ranks that call the same collectives in the same
order get the same names.

Rules shared by every call here:

* Collectives: every rank must make the call, under the same name, with the same dtype,
  device type, op, scale factors and root, and the same shape (for ``allgather`` and
  ``alltoall``: the same shape beyond dimension 0). Ranks may submit in different orders;
  the engine matches requests by name. A disagreement fails that request on every rank with
  ``TensorMismatchError`` (raised by ``synchronize``); the engine goes on serving.
* Tensors: cpu, or cuda on this rank's GPU (CuPy needed); dtypes float16, bfloat16,
  float32, float64, int8, uint8, int32, int64, bool. The engine reads (and, in place,
  writes) the tensor's memory directly: leave it alone until ``synchronize`` returns. For a
  cuda tensor the engine first waits for the work queued on the current stream at the call.
* Bad input never leaves the other ranks waiting: a rank that rejects its own input (the
  ``TypeError``/``ValueError`` causes each call lists) submits the request marked invalid
  instead of raising alone, and every rank's ``synchronize`` raises ``InvalidInputError`` (a
  ``ValueError`` and ``RuntimeError``) naming each rejecting rank and its reason; on a rank
  whose own check was a type check it is ``InvalidInputTypeError``, also a ``TypeError``.
  Only a bad ``name`` (or a non-list for the grouped calls) is raised locally at once.
* ``*_async`` calls return a ``TensorHandle`` at once; ``synchronize(handle)`` waits and
  returns the result, ``poll(handle)`` tells whether it is ready. A blocking call with an
  ``_async`` twin is ``synchronize`` of that twin.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .. import runtime
from ..buffers.dtypes import dtype_named
from ..engine.handle import Handle
from ..engine.request import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                              REDUCESCATTER, Entry, Request)
from ..ops import ReduceOp, check_op_for_dtype
from ..process_sets import ProcessSet, engine_for, set_id, set_rank_of, set_size
from .compression import Compression, Compressor
from .naming import collective_name, root_rank as check_root
from .views import device_name, dtype_name, flat_array

__all__ = ["TensorHandle", "synchronize", "poll",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather", "allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
           "barrier", "join", "allreduce_request_", "submit_together",
           "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "sparse_allreduce_async"]


class TensorHandle:
    """What the ``*_async`` calls return; pass it to ``synchronize`` or ``poll``.

    Made by mpiddp, not by users. One handle may cover several engine requests (a grouped
    all-reduce); it is done when all of them are.
    """

    __slots__ = ("_handles", "_finalize", "_value", "_finished")

    def __init__(self, handles: list[Handle], finalize: Callable[[], object]):
        self._handles = handles
        self._finalize = finalize
        self._finished = False
        self._value = None

    def done(self) -> bool:
        """Whether every request of this handle has finished (successfully or not).

        Returns:
            True when ``wait()`` would return or raise without blocking.
        """
        return all(h.done() for h in self._handles)

    def wait(self) -> Any:
        """Block until every request has finished, then return the result (``synchronize``
        is the public spelling). Later calls return the same result (or raise the same
        error).

        Returns:
            The result of the collective (see the ``*_async`` call that made the handle).

        Raises:
            MpiddpError: the first error of this handle's requests (``TensorMismatchError``,
                ``EngineShutdownError``, ...), raised once all of them have finished.
        """
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
        """The engine names of this handle's requests, in submission order."""
        return [h.name for h in self._handles]

    def __repr__(self) -> str:
        return f"<mpiddp.TensorHandle {self.names} {'done' if self.done() else 'pending'}>"


def synchronize(handle: TensorHandle) -> Any:
    """Wait for an asynchronous collective and return its output.

    Waits for every request of the handle, also after one failed, so that no reduction
    still writes into a tensor afterwards. Calling it again on the same handle returns the
    same output (or raises the same error).

    Args:
        handle: what an ``*_async`` call (or ``submit_together``) returned.

    Returns:
        The collective's output: a tensor (in-place calls: the input tensor itself), a list
        of tensors for grouped all-reduces, ``(output, received_splits)`` for ``alltoall``
        with ``splits``, None for handles of ``submit_together``.

    Raises:
        TypeError: ``handle`` is not a ``TensorHandle``.
        TensorMismatchError: the ranks disagreed on the request (shape, dtype, op, root,
            scale factors, device type or collective kind); raised on every rank.
        MpiddpError: a collective other than allreduce while some ranks have called
            ``join()``.
        EngineShutdownError: the engine stopped before the request finished (``shutdown()``
            on some rank, a stall timeout or a failure); the message gives the cause.
    """
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async call, "
                        f"not {type(handle).__name__}")
    return handle.wait()


def poll(handle: TensorHandle) -> bool:
    """Whether an asynchronous collective has finished, without waiting.

    Args:
        handle: what an ``*_async`` call (or ``submit_together``) returned.

    Returns:
        True when ``synchronize(handle)`` would return (or raise) without waiting.

    Raises:
        TypeError: ``handle`` is not a ``TensorHandle``.
    """
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
    if (prescale != 1.0 or postscale != 1.0) and dtype_named(dtype).kind == "bool":
        raise ValueError(f"prescale/postscale factors need a numeric tensor, but "
                         f"'{name}' is {dtype}")


def _needs_grad(*tensors) -> bool:
    """The call must be recorded for autograd (see ``torch/autograd.py``)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _ready_event(tensor: torch.Tensor):
    """For device tensors: an event on the producing stream the engine waits for."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _submit(engine, entries: list[Entry], finalize: Callable[[], object]) -> TensorHandle:
    return TensorHandle(engine.submit_many(entries), finalize)


def _submit_checked(engine, kind: str, names: list[str],
                    build: Callable[[], tuple[list[Entry], Callable[[], object]]]) -> TensorHandle:
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
        finalize = _nothing
    return _submit(engine, entries, finalize)


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


def allreduce_request_(tensor: torch.Tensor, name: str, op: ReduceOp | int = ReduceOp.AVERAGE,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Entry:
    """Check ``tensor`` and describe an in-place all-reduce of it named ``name``, without
    submitting it: a building block for framework glue (``DistributedOptimizer``) that
    submits many at once with ``submit_together``. Does not need ``init()``.

    Args:
        tensor: a contiguous tensor, reduced in place once submitted.
        name: the request's name; the same on every rank, not in flight when submitted.
        op: the reduction (default ``Average``), as for ``allreduce``.
        prescale_factor: multiply by this before the reduction (floating-point only).
            Default 1.0.
        postscale_factor: multiply the result by this (floating-point only). Default 1.0.

    Returns:
        The request, to pass to ``submit_together``.

    Raises:
        ValueError: ``tensor`` is not contiguous; ``op`` is not a ``ReduceOp`` value or
            does not apply to the dtype (anything but Min/Max on bool);
            scale factors other than 1.0 on a bool tensor; a cuda tensor not
            on this rank's GPU.
        TypeError: unsupported dtype or device.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"allreduce_request_ of '{name}' needs a contiguous tensor")
    return _allreduce_entry(tensor, tensor, name, ReduceOp(op), prescale_factor,
                            postscale_factor)


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
    engine, _ = engine_for(process_set, "submit_together()")
    return [TensorHandle([handle], _nothing) for handle in engine.submit_many(entries)]


def _nothing():
    return None


def _allreduce_async(tensor, in_place, average, name, op, prescale_factor, postscale_factor,
                     process_set):
    engine, in_set = engine_for(process_set, "allreduce()")
    name = collective_name(ALLREDUCE, name, scope=in_set.process_set_id)

    def build():
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
        return [_allreduce_entry(tensor, output, name, _resolve_op(op, average),
                                 prescale_factor, postscale_factor)], finalize

    return _submit_checked(engine, ALLREDUCE, [name], build)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks (default op: Average) into a new tensor.

    A non-contiguous ``tensor`` is copied at the call; a contiguous one is read in place
    until the handle completes.

    Args:
        tensor: the tensor to reduce.
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new contiguous tensor of the same
        shape, dtype and device holding the reduction.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: both ``op`` and ``average`` given; unknown ``op``; ``op`` not defined
            for the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty string;
            a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _allreduce_async(tensor, False, average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks in place (default op: Average).

    A non-contiguous ``tensor`` is reduced in a contiguous copy, written back into it by
    ``synchronize``.

    Args:
        tensor: the tensor to reduce.
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns ``tensor`` holding the reduction.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: both ``op`` and ``average`` given; unknown ``op``; ``op`` not defined
            for the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty string;
            a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _allreduce_async(tensor, True, average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: ReduceOp | int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default op: Average) and return the result as a new
    tensor; ``tensor`` is unchanged. Blocks until done.

    Args:
        tensor: the tensor to reduce.
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the dtype the
            tensor travels in (cast back afterwards), as Horovod's ``compression``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A new contiguous tensor of the same shape, dtype and device.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: both ``op`` and ``average`` given; unknown ``op``; ``op`` not defined
            for the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty string;
            a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
    """
    wire, context = compression.compress(tensor)
    if _needs_grad(wire):
        from . import autograd

        reduced = autograd.Allreduce.apply(wire, _resolve_op(op, average), name,
                                           prescale_factor, postscale_factor, process_set)
    else:
        reduced = synchronize(allreduce_async(wire, average, name, op, prescale_factor,
                                              postscale_factor, process_set))
    return compression.decompress(reduced, context)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place (default op: Average) and return it.
    Blocks until done.

    Args:
        tensor: the tensor to reduce.
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        ``tensor``, holding the reduction.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: both ``op`` and ``average`` given; unknown ``op``; ``op`` not defined
            for the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty string;
            a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped_async(tensors, in_place, average, name, op, prescale_factor, postscale_factor,
                   process_set):
    engine, in_set = engine_for(process_set, "grouped_allreduce()")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("grouped_allreduce takes a non-empty list of tensors")
    base = collective_name(ALLREDUCE, name, scope=in_set.process_set_id)
    names = [f"{base}.{i}" for i in range(len(tensors))]

    def build():
        reduce_op = _resolve_op(op, average)
        entries, outputs = [], []
        for item, tensor in zip(names, tensors):
            _check_tensor(tensor, item)
            output = tensor if in_place and tensor.is_contiguous() else torch.empty_like(
                tensor, memory_format=torch.contiguous_format)
            entries.append(_allreduce_entry(tensor, output, item, reduce_op, prescale_factor,
                                            postscale_factor))
            outputs.append(output)

        def finalize():
            if in_place:
                return [t if t is o else t.copy_(o) for t, o in zip(tensors, outputs)]
            return outputs

        return entries, finalize

    return _submit_checked(engine, ALLREDUCE, names, build)


def grouped_allreduce_async(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                            average: bool | None = None, name: str | None = None,
                            op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing a list of tensors across ranks (default op: Average) into new tensors.

    The tensors are submitted together, so one negotiation covers them and they fuse
    together where dtype and device agree (up to ``MPIDDP_FUSION_THRESHOLD`` bytes).

    Args:
        tensors: a non-empty list or tuple of tensors (dtypes and devices may differ).
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: base name; tensor i is named ``<name>.<i>``, the same on every rank, none in
            flight on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's inputs by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a list of new contiguous tensors, in
        the order of ``tensors``.

    Raises:
        TypeError: an item is not a ``torch.Tensor``, or has an unsupported dtype or device.
        ValueError: ``tensors`` is not a non-empty list or tuple; both ``op`` and
            ``average`` given; unknown ``op``; ``op`` not defined for a dtype (Average on
            integers, anything but Min/Max on bool); scale factors other than 1.0 on a
            non-floating-point tensor; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: a name ``<name>.<i>`` is already in flight on this rank;
            nothing is submitted then.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _grouped_async(tensors, False, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def grouped_allreduce_async_(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                             average: bool | None = None, name: str | None = None,
                             op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing a list of tensors across ranks in place (default op: Average).

    The tensors are submitted together, so one negotiation covers them and they fuse
    together where dtype and device agree (up to ``MPIDDP_FUSION_THRESHOLD`` bytes).

    Args:
        tensors: a non-empty list or tuple of tensors (dtypes and devices may differ).
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: base name; tensor i is named ``<name>.<i>``, the same on every rank, none in
            flight on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's inputs by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a list of the input tensors, holding
        the reductions.

    Raises:
        TypeError: an item is not a ``torch.Tensor``, or has an unsupported dtype or device.
        ValueError: ``tensors`` is not a non-empty list or tuple; both ``op`` and
            ``average`` given; unknown ``op``; ``op`` not defined for a dtype (Average on
            integers, anything but Min/Max on bool); scale factors other than 1.0 on a
            non-floating-point tensor; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: a name ``<name>.<i>`` is already in flight on this rank;
            nothing is submitted then.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _grouped_async(tensors, True, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def grouped_allreduce(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                      average: bool | None = None, name: str | None = None,
                      compression: Compressor = Compression.none, op: ReduceOp | int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Reduce a list of tensors across ranks (default op: Average), fused where possible;
    return the results as new tensors. Blocks until done.

    Args:
        tensors: a non-empty list or tuple of tensors (dtypes and devices may differ).
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: base name; tensor i is named ``<name>.<i>``, the same on every rank, none in
            flight on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's inputs by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the dtype the
            tensor travels in (cast back afterwards), as Horovod's ``compression``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A list of new contiguous tensors, in the order of ``tensors``.

    Raises:
        TypeError: an item is not a ``torch.Tensor``, or has an unsupported dtype or device.
        ValueError: ``tensors`` is not a non-empty list or tuple; both ``op`` and
            ``average`` given; unknown ``op``; ``op`` not defined for a dtype (Average on
            integers, anything but Min/Max on bool); scale factors other than 1.0 on a
            non-floating-point tensor; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: a name ``<name>.<i>`` is already in flight on this rank;
            nothing is submitted then.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
    """
    if not isinstance(tensors, (list, tuple)):
        return synchronize(grouped_allreduce_async(tensors))     # raises the usual error
    compressed = [compression.compress(t) for t in tensors]
    wires = [wire for wire, _ in compressed]
    if _needs_grad(*wires):
        from . import autograd

        reduced = autograd.GroupedAllreduce.apply(_resolve_op(op, average), name,
                                                  prescale_factor, postscale_factor,
                                                  process_set, *wires)
    else:
        reduced = synchronize(grouped_allreduce_async(wires, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def grouped_allreduce_(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
                       average: bool | None = None, name: str | None = None,
                       op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Reduce a list of tensors across ranks in place (default op: Average), fused where
    possible. Blocks until done.

    Args:
        tensors: a non-empty list or tuple of tensors (dtypes and devices may differ).
        average: the older Horovod spelling of ``op``: True for Average, False for Sum.
            Default None: use ``op``.
        name: base name; tensor i is named ``<name>.<i>``, the same on every rank, none in
            flight on this rank. Default None: the next generated ``allreduce.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's inputs by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A list of the input tensors, holding the reductions.

    Raises:
        TypeError: an item is not a ``torch.Tensor``, or has an unsupported dtype or device.
        ValueError: ``tensors`` is not a non-empty list or tuple; both ``op`` and
            ``average`` given; unknown ``op``; ``op`` not defined for a dtype (Average on
            integers, anything but Min/Max on bool); scale factors other than 1.0 on a
            non-floating-point tensor; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: a name ``<name>.<i>`` is already in flight on this rank;
            nothing is submitted then.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ---- gathers, broadcast, reduce-scatter, all-to-all -------------------------------------
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
    reduce_op = _resolve_op(op, None)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, not "
                         f"{reduce_op.name.title()}")
    base = collective_name("sparse_allreduce", name, scope=set_id(process_set))
    coo = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along dimension 0: gather the indices as rows (one per value).
    indices = allgather_async(coo.indices().t().contiguous(), f"{base}.indices", process_set)
    values = allgather_async(coo.values().contiguous(), f"{base}.values", process_set)

    def handle() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if reduce_op == ReduceOp.AVERAGE:
            gathered_values = gathered_values / set_size(process_set)
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape)

    return handle


def _output_allocator(like: torch.Tensor, holder: dict):
    def allocate(shape):
        holder["output"] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return flat_array(holder["output"])
    return allocate


def _needs_dim(tensor: torch.Tensor, name: str, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension; "
                         f"'{name}' is a scalar (use tensor.reshape(1))")


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes may differ).

    Args:
        tensor: this rank's part, at least one dimension; dimension 0 may differ between
            ranks, the other dimensions, dtype and device type may not.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allgather.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new tensor of shape
        ``(sum of every rank's dimension 0, *tensor.shape[1:])``, rank 0's rows first.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); ``name`` not a non-empty string; a cuda
            tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    engine, in_set = engine_for(process_set, "allgather()")
    name = collective_name(ALLGATHER, name, scope=in_set.process_set_id)

    def build():
        entry, output = _allgather_entry(tensor, name)
        return [entry], output

    return _submit_checked(engine, ALLGATHER, [name], build)


def _allgather_entry(tensor, name: str) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Check ``tensor`` and describe its all-gather; returns (entry, the output getter)."""
    dtype = _check_tensor(tensor, name)
    _needs_dim(tensor, name, "allgather")
    holder: dict = {}
    request = Request(name, ALLGATHER, dtype, tuple(tensor.shape), device_name(tensor))
    entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return entry, lambda: holder["output"]


def _group_names(kind: str, tensors, name: Optional[str], what: str,
                 scope: Optional[int]) -> list[str]:
    """Names of a grouped call's items, ``<base>.<i>`` (the same rule as grouped_allreduce)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what} takes a non-empty list of tensors")
    base = collective_name(kind, name, scope=scope)
    return [f"{base}.{i}" for i in range(len(tensors))]


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
    engine, in_set = engine_for(process_set, "grouped_allgather()")
    names = _group_names(ALLGATHER, tensors, name, "grouped_allgather", in_set.process_set_id)

    def build():
        made = [_allgather_entry(t, n) for t, n in zip(tensors, names)]
        return [entry for entry, _ in made], lambda: [output() for _, output in made]

    return _submit_checked(engine, ALLGATHER, names, build)


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
    if isinstance(tensors, (list, tuple)) and _needs_grad(*tensors):
        from . import autograd

        return list(autograd.GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (sizes may differ) and return
    the result on every rank. Blocks until done.

    Args:
        tensor: this rank's part, at least one dimension; dimension 0 may differ between
            ranks, the other dimensions, dtype and device type may not.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``allgather.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A new tensor of shape ``(sum of every rank's dimension 0, *tensor.shape[1:])``,
        rank 0's rows first.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); ``name`` not a non-empty string; a cuda
            tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
        MpiddpError: some ranks have called ``join()`` (only allreduce runs then).
    """
    if _needs_grad(tensor):
        from . import autograd

        return autograd.Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def _broadcast_async(tensor, root_rank, name, in_place, process_set):
    engine, process_set = engine_for(process_set, "broadcast()")
    name = collective_name(BROADCAST, name, scope=process_set.process_set_id)

    def build():
        dtype = _check_tensor(tensor, name)
        what = f"broadcast of '{name}'"
        root = set_rank_of(process_set, check_root(root_rank, runtime.size(), what), what)
        request = Request(name, BROADCAST, dtype, tuple(tensor.shape), device_name(tensor),
                          root=root)
        if in_place and tensor.is_contiguous():
            output, finalize = tensor, (lambda: tensor)
        else:
            output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            finalize = (lambda: tensor.copy_(output)) if in_place else (lambda: output)
        entry = _entry(request, _contiguous(tensor), flat_array(output))
        if output is tensor:
            entry.input = entry.output
        return [entry], finalize

    return _submit_checked(engine, BROADCAST, [name], build)


def broadcast_async(tensor: torch.Tensor, root_rank: int,
                    name: str | None = None,
                    process_set: ProcessSet | None = None) -> TensorHandle:
    """Start sending ``root_rank``'s ``tensor`` to every rank, into a new tensor.

    Args:
        tensor: the values to send on ``root_rank``; on the other ranks, a tensor of the
            same shape, dtype and device type whose values are ignored.
        root_rank: the rank whose values everyone receives, the same on every rank. Any
            integer (also a NumPy integer or a 0-d integer tensor), not a bool.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``broadcast.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new contiguous tensor holding
        ``root_rank``'s values (on ``root_rank`` too); ``tensor`` is unchanged.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` or has an unsupported dtype or
            device; ``root_rank`` is not an integer.
        ValueError: ``root_rank`` is not in ``0..size()-1``; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _broadcast_async(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int,
                     name: str | None = None,
                     process_set: ProcessSet | None = None) -> TensorHandle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place.

    Args:
        tensor: the values to send on ``root_rank``; on the other ranks, a tensor of the
            same shape, dtype and device type whose values are ignored.
        root_rank: the rank whose values everyone receives, the same on every rank. Any
            integer (also a NumPy integer or a 0-d integer tensor), not a bool.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``broadcast.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns ``tensor`` holding ``root_rank``'s
        values (a non-contiguous ``tensor`` is written back at ``synchronize``).

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` or has an unsupported dtype or
            device; ``root_rank`` is not an integer.
        ValueError: ``root_rank`` is not in ``0..size()-1``; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    return _broadcast_async(tensor, root_rank, name, True, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s ``tensor`` on every rank; ``tensor`` is
    unchanged. Blocks until done.

    Args:
        tensor: the values to send on ``root_rank``; on the other ranks, a tensor of the
            same shape, dtype and device type whose values are ignored.
        root_rank: the rank whose values everyone receives, the same on every rank. Any
            integer (also a NumPy integer or a 0-d integer tensor), not a bool.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``broadcast.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A new contiguous tensor holding ``root_rank``'s values.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` or has an unsupported dtype or
            device; ``root_rank`` is not an integer.
        ValueError: ``root_rank`` is not in ``0..size()-1``; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
        MpiddpError: some ranks have called ``join()`` (only allreduce runs then).
    """
    if _needs_grad(tensor):
        from . import autograd

        return autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values, in place, and return it. Blocks
    until done.

    Args:
        tensor: the values to send on ``root_rank``; on the other ranks, a tensor of the
            same shape, dtype and device type whose values are ignored.
        root_rank: the rank whose values everyone receives, the same on every rank. Any
            integer (also a NumPy integer or a 0-d integer tensor), not a bool.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``broadcast.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        ``tensor``, holding ``root_rank``'s values.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` or has an unsupported dtype or
            device; ``root_rank`` is not an integer.
        ValueError: ``root_rank`` is not in ``0..size()-1``; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
        MpiddpError: some ranks have called ``join()`` (only allreduce runs then).
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        process_set: ProcessSet | None = None) -> TensorHandle:
    """Start reducing ``tensor`` across ranks (default op: Average) and keep rank r's share
    of dimension 0 (rows split as evenly as possible, the first ranks taking one extra).

    Args:
        tensor: at least one dimension, the same shape on every rank.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``reducescatter.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new tensor holding this rank's rows
        of the reduction: dimension 0 split as evenly as possible, the first
        ``tensor.shape[0] % size()`` ranks taking one row more (a rank may get 0 rows).

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); unknown ``op``; ``op`` not defined for
            the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    engine, in_set = engine_for(process_set, "reducescatter()")
    name = collective_name(REDUCESCATTER, name, scope=in_set.process_set_id)

    def build():
        entry, output = _reducescatter_entry(tensor, name, op, prescale_factor,
                                             postscale_factor)
        return [entry], output

    return _submit_checked(engine, REDUCESCATTER, [name], build)


def _reducescatter_entry(tensor, name: str, op, prescale_factor: float,
                         postscale_factor: float) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Check ``tensor`` and describe its reduce-scatter; returns (entry, the output getter)."""
    reduce_op = _resolve_op(op, None)
    dtype = _check_tensor(tensor, name)
    _needs_dim(tensor, name, "reducescatter")
    check_op_for_dtype(reduce_op, dtype_named(dtype).kind, dtype, name)
    _check_scaling(dtype, prescale_factor, postscale_factor, name)
    holder: dict = {}
    request = Request(name, REDUCESCATTER, dtype, tuple(tensor.shape), device_name(tensor),
                      op=int(reduce_op), prescale=float(prescale_factor),
                      postscale=float(postscale_factor))
    entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))
    return entry, lambda: holder["output"]


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
    engine, in_set = engine_for(process_set, "grouped_reducescatter()")
    names = _group_names(REDUCESCATTER, tensors, name, "grouped_reducescatter",
                         in_set.process_set_id)

    def build():
        made = [_reducescatter_entry(t, n, op, prescale_factor, postscale_factor)
                for t, n in zip(tensors, names)]
        return [entry for entry, _ in made], lambda: [output() for _, output in made]

    return _submit_checked(engine, REDUCESCATTER, names, build)


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
    if isinstance(tensors, (list, tuple)) and _needs_grad(*tensors):
        from . import autograd

        return list(autograd.GroupedReducescatter.apply(_resolve_op(op, None), name,
                                                        prescale_factor, postscale_factor,
                                                        process_set, *tensors))
    return synchronize(grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                   postscale_factor, process_set))


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default op: Average) and return this rank's share of
    dimension 0. Blocks until done.

    Args:
        tensor: at least one dimension, the same shape on every rank.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``reducescatter.noname.<n>``.
        op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply every rank's input by this before the reduction
            (integers: in float64, truncated). Default 1.0.
        postscale_factor: multiply the result by this (integers: in float64, truncated); Average
            divides by ``size()`` on top. Default 1.0.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A new tensor holding this rank's rows of the reduction: dimension 0 split as
        evenly as possible, the first ``tensor.shape[0] % size()`` ranks taking one row more
        (a rank may get 0 rows).

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); unknown ``op``; ``op`` not defined for
            the dtype (anything but Min/Max on bool); scale factors
            other than 1.0 on a bool tensor; ``name`` not a non-empty
            string; a cuda tensor not on this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
        MpiddpError: some ranks have called ``join()`` (only allreduce runs then).
    """
    if _needs_grad(tensor):
        from . import autograd

        return autograd.Reducescatter.apply(tensor, _resolve_op(op, None), name,
                                            prescale_factor, postscale_factor, process_set)
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor,
                                           process_set))


def alltoall_async(tensor: torch.Tensor,
                   splits: Optional[Sequence[int] | torch.Tensor] = None,
                   name: str | None = None,
                   process_set: ProcessSet | None = None) -> TensorHandle:
    """Start sending ``splits[d]`` rows of ``tensor`` to each rank ``d`` (default: equal
    shares) and receiving what every rank sends here, concatenated in rank order.

    Args:
        tensor: the rows to send, at least one dimension; dimension 0 may differ between
            ranks, the other dimensions, dtype and device type may not.
        splits: how many rows of ``tensor`` go to each rank, in rank order: ``size()``
            non-negative integers adding up to ``tensor.shape[0]`` (a sequence or a 1-d
            integer tensor). Default None: equal shares, which needs ``tensor.shape[0]``
            divisible by ``size()``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``alltoall.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A ``TensorHandle``; ``synchronize`` returns a new tensor holding the rows every
        rank sent to this one, concatenated in rank order; with ``splits`` given,
        ``(output, received_splits)`` where ``received_splits`` is an int32 tensor of the
        row counts received from each rank.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); ``splits`` is not ``size()``
            non-negative counts adding up to ``tensor.shape[0]``; no ``splits`` and rows not
            divisible by ``size()``; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()`` or once the engine has stopped.
    """
    engine, in_set = engine_for(process_set, "alltoall()")
    name = collective_name(ALLTOALL, name, scope=in_set.process_set_id)

    def build():
        dtype = _check_tensor(tensor, name)
        _needs_dim(tensor, name, "alltoall")
        size, rows = engine.size, tensor.shape[0]
        counts = splits
        if counts is None:
            if rows % size:
                raise ValueError(f"alltoall of '{name}': {rows} rows do not split evenly over "
                                 f"{size} ranks; pass splits=")
            counts = [rows // size] * size
        counts = [int(s) for s in
                  (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
        if len(counts) != size or any(s < 0 for s in counts) or sum(counts) != rows:
            raise ValueError(f"alltoall of '{name}': splits {counts} must be {size} "
                             f"non-negative row counts adding up to the tensor's {rows} rows")
        holder: dict = {}
        request = Request(name, ALLTOALL, dtype, tuple(tensor.shape), device_name(tensor),
                          splits=tuple(counts))
        entry = _entry(request, _contiguous(tensor), allocate=_output_allocator(tensor, holder))

        def finalize():
            received = torch.tensor(entry.handle.info, dtype=torch.int32)
            return (holder["output"], received) if splits is not None else holder["output"]

        return [entry], finalize

    return _submit_checked(engine, ALLTOALL, [name], build)


def alltoall(tensor: torch.Tensor, splits: Optional[Sequence[int] | torch.Tensor] = None,
             name: str | None = None, process_set: ProcessSet | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-to-all exchange: send ``splits[d]`` rows of ``tensor`` to each rank ``d`` and
    return what every rank sent here. Blocks until done.

    Args:
        tensor: the rows to send, at least one dimension; dimension 0 may differ between
            ranks, the other dimensions, dtype and device type may not.
        splits: how many rows of ``tensor`` go to each rank, in rank order: ``size()``
            non-negative integers adding up to ``tensor.shape[0]`` (a sequence or a 1-d
            integer tensor). Default None: equal shares, which needs ``tensor.shape[0]``
            divisible by ``size()``.
        name: identifies the collective across ranks: the same on every rank, not in flight
            on this rank. Default None: the next generated ``alltoall.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Returns:
        A new tensor holding the rows every rank sent to this one, concatenated in rank
        order; with ``splits`` given, ``(output, received_splits)`` where
        ``received_splits`` is an int32 tensor of the row counts received from each rank.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
            device.
        ValueError: ``tensor`` is a scalar (0-d); ``splits`` is not ``size()``
            non-negative counts adding up to ``tensor.shape[0]``; no ``splits`` and rows not
            divisible by ``size()``; ``name`` not a non-empty string; a cuda tensor not on
            this rank's GPU.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the
            collective finished.
        TensorMismatchError: the ranks disagree on this collective (raised on every rank).
        MpiddpError: some ranks have called ``join()`` (only allreduce runs then).
    """
    if _needs_grad(tensor):
        from . import autograd

        output, received = autograd.Alltoall.apply(tensor, splits, name, process_set)
        return output if splits is None else (output, received)
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def barrier(process_set: ProcessSet | None = None, name: str | None = None) -> None:
    """Return once every rank has called ``barrier`` with this name.

    Agreed like any other collective: it completes when every rank has submitted it, whatever
    other collectives are still in flight (synchronize those first if they must be done).

    Args:
        name: identifies the barrier across ranks: the same on every rank, not in flight on
            this rank. Default None: the next generated ``barrier.noname.<n>``.
        process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
            default None: every rank. Only its ranks may call it.

    Raises:
        ValueError: ``name`` is not a non-empty string.
        DuplicateNameError: ``name`` is already in flight on this rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before every rank
            arrived.
        MpiddpError: some ranks have called ``join()``.
    """
    if isinstance(process_set, str):        # barrier("name"): the name given first
        process_set, name = name, process_set
    engine, in_set = engine_for(process_set, "barrier()")
    engine.barrier(collective_name(BARRIER, name, scope=in_set.process_set_id)).wait()


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
        MpiddpError: this rank still has collectives in flight.
        RuntimeError: another thread of this rank is already in ``join()``.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before every rank
            joined.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) takes a device index, not {type(device).__name__}")
    handle = runtime.require_engine("join()").join()
    return handle.wait()
