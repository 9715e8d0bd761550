"""Recursive halving-doubling all-reduce on any rank count (powers of two and the fold of the
others): every op, dtype, odd, tiny (fewer elements than ranks) and empty sizes, Average's
per-chunk scaling, against a float64 NumPy reference; the same bits on every rank; large
buffers through ``NetworkComm`` (transfers in pieces, left in flight, as across nodes).

Prints 'OK ...' on rank 0.
"""
import numpy as np
import torch
from mpi4py import MPI

from mpiddp.buffers import backend_for
from mpiddp.buffers.dtypes import dtype_named
from mpiddp.collectives.halving_doubling import halving_doubling_allreduce, scratch_elements
from mpiddp.reduce_ops import ReduceOp
from mpiddp.transport.network import SEGMENT_BYTES, NetworkComm
from mpiddp.torch.core.views import flat_array
from reference_data import as64, data

torch.set_num_threads(1)
world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
host = backend_for("cpu")
OPS = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max,
       ReduceOp.PRODUCT: np.prod}
TOLERANCE = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-5}


def reference(key, count, torch_dtype, op, dtype):
    stacked = np.stack([as64(data(r, key, (count,), torch_dtype, op)) for r in range(SIZE)])
    if op == ReduceOp.AVERAGE:
        return stacked.mean(0) if dtype.kind == "float" else np.trunc(stacked.sum(0) / SIZE)
    return OPS[op](stacked, axis=0)


def check(comm, name, op, count, key):
    dtype, torch_dtype = dtype_named(name), getattr(torch, name)
    tensor = data(RANK, key, (count,), torch_dtype, op).contiguous()
    buf = flat_array(tensor)
    scratch = host.empty(max(1, scratch_elements(count, SIZE)), dtype)
    postprocess = None
    if op == ReduceOp.AVERAGE:
        postprocess = lambda part: host.scale_(part, 1.0 / SIZE, dtype)  # noqa: E731
    halving_doubling_allreduce(comm, buf, scratch,
                               lambda dst, src: host.reduce_into(dst, src, op, dtype),
                               postprocess)
    got, want = as64(tensor), reference(key, count, torch_dtype, op, dtype)
    tol = 0.0 if dtype.kind == "int" and op == ReduceOp.AVERAGE else \
        TOLERANCE.get(name, 1e-12)
    assert np.allclose(got, want, rtol=tol, atol=tol), \
        (key, np.max(np.abs(got - want)) if count else 0)
    # Every rank holds the same bits (each element summed once, by its chunk's owner).
    raw = np.ascontiguousarray(buf).view(np.uint8)
    first = raw.copy()
    world.Bcast(first, root=0)
    assert np.array_equal(raw, first), (key, "ranks differ")


checked = 0
for name in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"):
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        for count in (0, 1, SIZE - 1, SIZE + 1, 97, 4099):
            check(world, name, op, count, f"hd.{name}.{op.name}.{count}")
            checked += 1
# Large buffers on NetworkComm: steps above its polite threshold, cut into several messages
# (SEGMENT_BYTES) with an uneven last piece, the fold's whole buffers among them.
network = NetworkComm(world)
for name in ("float32", "float64"):
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        count = 3 * SEGMENT_BYTES // dtype_named(name).itemsize + 13
        check(network, name, op, count, f"hd.net.{name}.{op.name}")
        checked += 1
if RANK == 0:
    print(f"OK halving-doubling all-reduce on {SIZE} ranks: {checked} cases", flush=True)
