"""The element types the engine moves, by name, with their NumPy storage and MPI datatype.

bfloat16 has no NumPy type: it is stored as raw ``uint16`` bits and reduced through a
torch view of the same memory (see ``host_reduce``). complex64 and complex128 are reduced and
scaled as their real and imaginary parts (``as_real``: the same memory viewed as float32 or
float64, twice the elements), so the backends and MPI need nothing of their own for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..reduce_ops import ReduceOp


@dataclass(frozen=True)
class DType:
    name: str
    storage: np.dtype       # NumPy dtype that holds the bytes
    mpi: MPI.Datatype       # MPI datatype of one element
    kind: str               # 'float', 'int', 'bool' or 'complex'
    native_reduce: bool     # MPI has predefined reduction ops for this type

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize


DTYPES = {
    d.name: d for d in (
        DType("float16", np.dtype(np.float16), MPI.UINT16_T, "float", False),
        DType("bfloat16", np.dtype(np.uint16), MPI.UINT16_T, "float", False),
        DType("float32", np.dtype(np.float32), MPI.FLOAT, "float", True),
        DType("float64", np.dtype(np.float64), MPI.DOUBLE, "float", True),
        DType("int8", np.dtype(np.int8), MPI.INT8_T, "int", True),
        DType("uint8", np.dtype(np.uint8), MPI.UINT8_T, "int", True),
        DType("int16", np.dtype(np.int16), MPI.INT16_T, "int", True),
        DType("int32", np.dtype(np.int32), MPI.INT32_T, "int", True),
        DType("int64", np.dtype(np.int64), MPI.INT64_T, "int", True),
        DType("bool", np.dtype(np.bool_), MPI.C_BOOL, "bool", True),
        # MPI sees the real parts: a buffer's count comes from its bytes (native.py), and
        # MPI_SUM on float pairs is the complex sum (also where a CUDA-aware MPI reduces on
        # the device, which not every one does for complex types).
        DType("complex64", np.dtype(np.complex64), MPI.FLOAT, "complex", True),
        DType("complex128", np.dtype(np.complex128), MPI.DOUBLE, "complex", True),
    )
}
_REAL_PART = {"complex64": "float32", "complex128": "float64"}


def dtype_named(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(
            f"unsupported dtype {name}; supported: {', '.join(DTYPES)}") from None


def as_real(array, dtype: DType):
    """(``array`` viewed as its real dtype, that dtype) for a complex buffer (NumPy or CuPy:
    the real and imaginary parts interleaved, twice the elements); others unchanged."""
    real = _REAL_PART.get(dtype.name)
    if real is None:
        return array, dtype
    return array.view(DTYPES[real].storage), DTYPES[real]


# bfloat16 bit patterns (the storage is raw uint16).
_BF16_BITS = {"inf": 0x7F80, "-inf": 0xFF80, "one": 0x3F80}


def identity_value(dtype: DType, op: int):
    """The value a rank that has joined contributes to a reduction: it leaves every other
    rank's values unchanged (0 for sums, 1 for products, the type's extremes for min/max).
    Returned as a scalar of the storage type."""
    op = ReduceOp(op)
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM):     # Adasum: a + 0 = a
        return dtype.storage.type(0)
    if dtype.kind == "bool":
        return np.bool_(op == ReduceOp.MIN)          # and: True, or: False
    if dtype.name == "bfloat16":
        key = {ReduceOp.PRODUCT: "one", ReduceOp.MIN: "inf", ReduceOp.MAX: "-inf"}[op]
        return np.uint16(_BF16_BITS[key])
    if op == ReduceOp.PRODUCT:
        return dtype.storage.type(1)
    if dtype.kind == "float":
        return dtype.storage.type(np.inf if op == ReduceOp.MIN else -np.inf)
    info = np.iinfo(dtype.storage)
    return dtype.storage.type(info.max if op == ReduceOp.MIN else info.min)
