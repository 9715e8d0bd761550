"""Docstring text the tensor collectives share (``mpiddp.docstrings`` explains the ``{name}``
lines that name these snippets; ``$kind`` is the collective's kind in generated names)."""
from __future__ import annotations

from ...docstrings import RUNTIME_SNIPPETS

SNIPPETS = dict(RUNTIME_SNIPPETS)
SNIPPETS.update({
    # ---- Args -----------------------------------------------------------------------------
    "arg_reduce_tensor": "tensor: the tensor to reduce.",
    "arg_reduce_tensors": """\
tensors: a non-empty list or tuple of tensors (dtypes and devices may differ).""",
    "arg_average": """\
average: the older Horovod spelling of ``op``: True for Average, False for Sum.
    Default None: use ``op``.""",
    "arg_name": """\
name: identifies the collective across ranks: the same on every rank, not in flight
    on this rank. Default None: the next generated ``$kind.noname.<n>``.""",
    "arg_group_name": """\
name: base name; tensor i is named ``<name>.<i>``, the same on every rank, none in
    flight on this rank. Default None: the next generated ``$kind.noname.<n>``.""",
    "arg_op": "op: ``Average`` (the default, for None), ``Sum``, ``Min``, ``Max`` or ``Product``.",
    "arg_scale_factors": """\
prescale_factor: multiply every rank's input by this before the reduction
    (integers: in float64, truncated). Default 1.0.
postscale_factor: multiply the result by this (integers: in float64, truncated); Average
    divides by ``size()`` on top. Default 1.0.""",
    "arg_compression": """\
compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the dtype the
    tensor travels in (cast back afterwards), as Horovod's ``compression``.""",
    "arg_process_set": """\
process_set: run among this ``ProcessSet``'s ranks only (``add_process_set``);
    default None: every rank. Only its ranks may call it.""",
    "arg_gather_tensor": """\
tensor: this rank's part, at least one dimension; dimension 0 may differ between
    ranks, the other dimensions, dtype and device type may not.""",
    "arg_broadcast": """\
tensor: the values to send on ``root_rank``; on the other ranks, a tensor of the
    same shape, dtype and device type whose values are ignored.
root_rank: the rank whose values everyone receives, the same on every rank. Any
    integer (also a NumPy integer or a 0-d integer tensor), not a bool.""",
    "arg_reducescatter_tensor": "tensor: at least one dimension, the same shape on every rank.",
    "arg_alltoall": """\
tensor: the rows to send, at least one dimension; dimension 0 may differ between
    ranks, the other dimensions, dtype and device type may not.
splits: how many rows of ``tensor`` go to each rank, in rank order: ``size()``
    non-negative integers adding up to ``tensor.shape[0]`` (a sequence or a 1-d
    integer tensor). Default None: equal shares, which needs ``tensor.shape[0]``
    divisible by ``size()``.""",
    # ---- Returns --------------------------------------------------------------------------
    "returns_alltoall": """\
A new tensor holding the rows every rank sent to this one, concatenated in rank
order; with ``splits`` given, ``(output, received_splits)`` where
``received_splits`` is an int32 tensor of the row counts received from each rank.""",
    "returns_reducescatter": """\
A new tensor holding this rank's rows of the reduction: dimension 0 split as
evenly as possible, the first ``tensor.shape[0] % size()`` ranks taking one row more
(a rank may get 0 rows).""",
    # ---- Raises ---------------------------------------------------------------------------
    "raises_tensor_type": """\
TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
    device.""",
    "raises_allreduce_input": """\
TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
    device.
ValueError: both ``op`` and ``average`` given; unknown ``op``; ``op`` not defined
    for the dtype (anything but Min/Max on bool, anything but Sum/Average on complex);
    scale factors other than 1.0 on a bool tensor; ``name`` not a non-empty string;
    a cuda tensor not on this rank's GPU.""",
    "raises_grouped_allreduce_input": """\
TypeError: an item is not a ``torch.Tensor``, or has an unsupported dtype or device.
ValueError: ``tensors`` is not a non-empty list or tuple; both ``op`` and
    ``average`` given; unknown ``op``; ``op`` not defined for a dtype (anything but
    Min/Max on bool, anything but Sum/Average on complex); scale factors other than 1.0 on
    a bool tensor; ``name`` not a
    non-empty string; a cuda tensor not on this rank's GPU.
DuplicateNameError: a name ``<name>.<i>`` is already in flight on this rank;
    nothing is submitted then.""",
    "raises_broadcast_input": """\
TypeError: ``tensor`` is not a ``torch.Tensor`` or has an unsupported dtype or
    device; ``root_rank`` is not an integer.
ValueError: ``root_rank`` is not in ``0..size()-1``; ``name`` not a non-empty
    string; a cuda tensor not on this rank's GPU.""",
    "raises_reducescatter_input": """\
TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
    device.
ValueError: ``tensor`` is a scalar (0-d); unknown ``op``; ``op`` not defined for
    the dtype (anything but Min/Max on bool, anything but Sum/Average on complex); scale
    factors other than 1.0 on a bool tensor; ``name`` not a non-empty
    string; a cuda tensor not on this rank's GPU.""",
    "raises_alltoall_input": """\
TypeError: ``tensor`` is not a ``torch.Tensor``, or has an unsupported dtype or
    device.
ValueError: ``tensor`` is a scalar (0-d); ``splits`` is not ``size()``
    non-negative counts adding up to ``tensor.shape[0]``; no ``splits`` and rows not
    divisible by ``size()``; ``name`` not a non-empty string; a cuda tensor not on
    this rank's GPU.""",
    "raises_duplicate_name": """\
DuplicateNameError: ``name`` is already in flight on this rank.""",
    # An asynchronous call: errors at submission (the rest come from ``synchronize``).
    "raises_submitted": """\
NotInitializedError: before ``init()``.
EngineShutdownError: after ``shutdown()`` or once the engine has stopped.""",
    # A blocking call: submission and completion.
    "raises_completed": """\
NotInitializedError: before ``init()``.
EngineShutdownError: after ``shutdown()``, or the engine stopped before the
    collective finished.
TensorMismatchError: the ranks disagree on this collective (raised on every rank).""",
    "raises_joined": """\
MpiddpError: some ranks have called ``join()`` (only allreduce runs then).""",
    "raises_grouped_blocking": """\
ValueError: ``tensors`` is not a non-empty list or tuple.
InvalidInputError: some rank rejected an item (raised on every rank).
TensorMismatchError: the ranks disagree on an item (raised on every rank).""",
})
