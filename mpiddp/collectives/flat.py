"""All-reduce over one communicator as it is: our ring, or the MPI library's own."""
from __future__ import annotations

from ..buffers.dtypes import DType
from ..reduce_ops import ReduceOp
from .native import native_allreduce
from .ring import ring_allreduce

RING, NATIVE, HALVING_DOUBLING = "ring", "native", "halving_doubling"
RECURSIVE_DOUBLING = "recursive_doubling"


def flat_allreduce(transport, buf, scratch, dtype: DType, op: ReduceOp, algorithm: str,
                   reduce_kernel, postprocess=None) -> None:
    """All-reduce ``buf`` in place over ``transport`` with ``algorithm`` (``RING`` or
    ``NATIVE``). ``reduce_kernel(dst, src, op, dtype)`` does the local arithmetic;
    ``postprocess(array)``, an elementwise step such as Average's scaling, is applied to the
    result (by the ring only to the chunk it owns, before the all-gather). ``scratch`` holds
    ``ceil(len(buf) / size)`` elements for the ring (the native algorithm needs none)."""
    if algorithm == RING:
        ring_allreduce(transport, buf, scratch,
                       lambda dst, src: reduce_kernel(dst, src, op, dtype), postprocess)
        return
    native_allreduce(transport, buf, dtype, op, reduce_kernel)
    if postprocess is not None:
        postprocess(buf)
