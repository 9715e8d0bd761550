"""Elementwise reduction and scaling kernels on host (NumPy) buffers, in place.

float16 and bfloat16 go through torch views of the same memory: NumPy has no bfloat16 and
its float16 arithmetic is several times slower than torch's vectorised kernels.
"""
from __future__ import annotations

import numpy as np

from ..reduce_ops import ReduceOp, combine_function
from .dtypes import DType, as_real

# ops.combine_function's table resolved to NumPy functions once (this runs per reduction).
_NUMPY = {(op, kind): getattr(np, combine_function(op, kind))
          for op in ReduceOp if op != ReduceOp.ADASUM for kind in ("float", "int", "bool")
          if kind != "bool" or op in (ReduceOp.MIN, ReduceOp.MAX)}


def _torch_half_view(array: np.ndarray, dtype: DType):
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype.name == "bfloat16" else tensor


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp, dtype: DType) -> None:
    """``dst = op(dst, src)`` elementwise, in place."""
    if dst.size == 0:
        return
    if dtype.kind == "complex":                  # sums only: part by part
        (dst, dtype), (src, _) = as_real(dst, dtype), as_real(src, dtype)
    if dtype.name in ("float16", "bfloat16"):
        import torch

        d = _torch_half_view(dst, dtype)
        getattr(torch, combine_function(op, dtype.kind))(d, _torch_half_view(src, dtype), out=d)
        return
    _NUMPY[op, dtype.kind](dst, src, out=dst)


def _integer_reciprocal(factor: float) -> int | None:
    """``n`` where ``factor`` is the float64 nearest ``1/n`` for an integer ``n`` from 2 to
    2^24 (so exactly a float32), else None."""
    divisor = round(1.0 / factor)
    return divisor if 2 <= divisor <= 1 << 24 and 1.0 / divisor == factor else None


def scale_(array: np.ndarray, factor: float, dtype: DType, exact: bool = False) -> None:
    """Multiply a numeric buffer by ``factor`` in place (no-op for factor 1).

    A user's scale factor is applied as Horovod does: in the buffer's own precision (float32
    math for the half types), integers in float64 truncated toward zero. ``exact`` (Average's
    ``1/size``) multiplies float32 in float64 and rounds once, which gives the correctly
    rounded quotient instead of rounding ``1/size`` to float32 first."""
    if factor == 1.0 or array.size == 0:
        return
    array, dtype = as_real(array, dtype)         # complex: part by part, as its real dtype
    if dtype.kind == "int":
        # Horovod's rule for integers (Average, pre/post scale factors): scale in float64,
        # truncate toward zero.
        array[...] = (array.astype(np.float64) * factor).astype(array.dtype)
        return
    if dtype.kind != "float":
        raise TypeError(f"cannot scale a {dtype.name} buffer by {factor}")
    if dtype.name in ("float16", "bfloat16"):
        _torch_half_view(array, dtype).mul_(factor)
    elif exact:
        divisor = _integer_reciprocal(factor) if array.dtype == np.float32 else None
        if divisor:
            # Average's 1/size: the float32 quotient x / n, correctly rounded, has the bits
            # of the float64 product rounded once: x / n lies at least 2^-25 / n (relative)
            # from any float32 rounding boundary, the product's two float64 roundings move
            # it by at most 2^-52, so both round alike for any n below 2^27 (subnormals
            # too). A third of the time (docs/dev/benchmark-record.md: 80 -> 25 us per MiB here).
            np.divide(array, np.float32(divisor), out=array)
        else:
            np.multiply(array, np.float64(factor), out=array, casting="unsafe")
    else:
        np.multiply(array, array.dtype.type(factor), out=array)
