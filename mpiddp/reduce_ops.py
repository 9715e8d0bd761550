"""Reduction operations shared by every layer (plain values, no dependencies)."""
from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How ``allreduce`` and ``reducescatter`` combine the ranks' tensors, elementwise.

    Re-exported as ``mpiddp.Average``, ``Sum``, ``Min``, ``Max`` and ``Product``; any of these
    (or its integer value) is accepted wherever an ``op`` is.

    * ``AVERAGE``: sum, then one multiplication by ``1 / size()`` (ranks that called
      ``join()`` count in ``size()`` and contribute zeros). On integer tensors the scaled
      sum is computed in float64 and truncated toward zero, as Horovod does.
    * ``SUM``, ``PRODUCT``: numeric dtypes (not bool).
    * ``MIN``, ``MAX``: every dtype but complex; on bool they are logical and / logical or.
    * complex64 and complex128 reduce with ``SUM`` and ``AVERAGE`` only (as real and
      imaginary parts, each summed).
    * ``ADASUM`` (``mpiddp.Adasum``): Horovod's scale-invariant combination (Maleki et al.,
      2021): two ranks' tensors ``a`` and ``b`` give ``a (1 - a.b / 2|a|^2) + b (1 - a.b /
      2|b|^2)`` (orthogonal ones add, parallel ones average), per tensor, ranks paired as a
      tree (``collectives/adasum.py``, docs/adasum.md). ``allreduce`` and its forms and
      ``DistributedOptimizer`` take it, on float16, bfloat16, float32 and float64; not the
      reduce-scatter.
    """

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5      # Horovod's Adasum: not elementwise (collectives/adasum.py)


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

ADASUM_FLOAT_ONLY = (
    "op=Adasum combines floating-point tensors (float16, bfloat16, float32, float64) by their "
    "dot products")


# The one reduction table: the elementwise function that combines two ranks' values, by its
# NumPy name (CuPy and torch use the same names). Average sums; the division comes after.
_COMBINE = {ReduceOp.AVERAGE: "add", ReduceOp.SUM: "add", ReduceOp.MIN: "minimum",
            ReduceOp.MAX: "maximum", ReduceOp.PRODUCT: "multiply"}
_BOOL_COMBINE = {ReduceOp.MIN: "logical_and", ReduceOp.MAX: "logical_or"}
# Complex buffers are reduced as their real and imaginary parts (a view of the real dtype):
# only sums are elementwise on those.
_COMPLEX_COMBINE = {ReduceOp.AVERAGE: "add", ReduceOp.SUM: "add"}
_TABLES = {"bool": _BOOL_COMBINE, "complex": _COMPLEX_COMBINE}


def combine_function(op: ReduceOp, dtype_kind: str) -> str:
    """The NumPy/CuPy/torch name of the function that reduces ``op`` on ``dtype_kind``
    values ('float', 'int', 'bool' or 'complex')."""
    return _TABLES.get(dtype_kind, _COMBINE)[ReduceOp(op)]


def reducible_ops(dtype_kind: str) -> tuple[ReduceOp, ...]:
    """The elementwise ops the buffer backends (host and device) can reduce on ``dtype_kind``
    values: those ``combine_function`` has a function for. Adasum, not elementwise, is never
    among them (its own algorithm reduces it)."""
    return tuple(_TABLES.get(dtype_kind, _COMBINE))


def check_op_for_dtype(op: ReduceOp, dtype_kind: str, dtype_name: str, tensor_name: str) -> None:
    """Raise ``ValueError`` for an (op, dtype) pair that has no sensible meaning."""
    if op == ReduceOp.ADASUM:
        if dtype_kind != "float":
            raise ValueError(f"{ADASUM_FLOAT_ONLY}: '{tensor_name}' is {dtype_name}")
        return
    if dtype_kind == "bool" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise ValueError(
            f"op={op.name.title()} is not defined for bool tensor '{tensor_name}': "
            "use op=Min (logical and) or op=Max (logical or)")
    if dtype_kind == "complex" and op not in _COMPLEX_COMBINE:
        raise ValueError(
            f"op={op.name.title()} is not defined for complex tensor '{tensor_name}' "
            f"({dtype_name}): complex tensors reduce with op=Sum or op=Average")
