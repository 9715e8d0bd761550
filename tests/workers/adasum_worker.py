"""op=Adasum in every collective that takes it, against the float64 reference
(``adasum_reference.py``), on the running engine at any rank count.

Checks (rank 0 prints 'OK <check>' after each): alone and fused tensors of every size class
and floating dtype, each tensor combined with its own dot products; in place, async and
grouped forms; scale factors; orthogonal vectors add and parallel ones average (Adasum's
defining properties); the result the same bits on every rank; a rank that joined
contributes zeros (Adasum's identity); integer and complex tensors refused on every rank;
reducescatter refused with a RuntimeError; a process set. ``HIERARCHICAL=1`` in the
environment: the reference is the hierarchical form (each node's average first).
"""
import os

import numpy as np
import torch

import checks
import mpiddp
from adasum_reference import adasum, node_average_adasum
from reference_data import as64, data

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
LOCAL = mpiddp.local_size()
HIERARCHICAL = os.environ.get("HIERARCHICAL") == "1"
SIZES = [1, 2, 7, 97, 1000, 4099, 40_000]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-5,
             torch.float64: 1e-12}


def ok(check, **values):
    checks.ok(check, RANK, barrier=mpiddp.barrier, **values)


def expected(name, shape, dtype, scale=1.0):
    vectors = [as64(data(r, name, shape, dtype)).ravel() * scale for r in range(SIZE)]
    result = node_average_adasum(vectors, LOCAL) if HIERARCHICAL else adasum(vectors)
    return result.reshape(shape)


def check_close(got, want, dtype, what):
    got = as64(got)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    error = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e}"


def same_bits_everywhere(tensor, what):
    raw = tensor.detach().reshape(-1).view(torch.uint8 if tensor.element_size() == 1 else
                                           {2: torch.int16, 4: torch.int32,
                                            8: torch.int64}[tensor.element_size()])
    gathered = mpiddp.allgather(raw.reshape(1, -1), name=f"bits.{what}")
    assert all(torch.equal(gathered[r], gathered[0]) for r in range(SIZE)), \
        f"{what}: ranks hold different bits"


def alone_and_fused():
    for dtype in DTYPES:
        for n in SIZES:
            name = f"alone.{dtype}.{n}"
            out = mpiddp.allreduce(data(RANK, name, (n,), dtype), op=mpiddp.Adasum, name=name)
            check_close(out, expected(name, (n,), dtype), dtype, name)
            same_bits_everywhere(out, name)
        # Several tensors fused into one buffer: each with its own dot products.
        names = [f"fused.{dtype}.{i}" for i in range(len(SIZES))]
        handles = [mpiddp.allreduce_async(data(RANK, nm, (n,), dtype), op=mpiddp.Adasum,
                                          name=nm) for nm, n in zip(names, SIZES)]
        for nm, n, handle in zip(names, SIZES, handles):
            out = mpiddp.synchronize(handle)
            check_close(out, expected(nm, (n,), dtype), dtype, nm)
    stats = mpiddp.engine_stats()
    assert stats["adasum_batches"] > 0 and stats["fused_batches"] > 0, stats
    ok("adasum alone and fused, every float dtype", batches=stats["adasum_batches"])


def forms():
    dtype = torch.float32
    t = data(RANK, "inplace", (5, 7), dtype)
    mpiddp.allreduce_(t, op=mpiddp.Adasum, name="inplace")
    check_close(t, expected("inplace", (5, 7), dtype), dtype, "in place")
    t = data(RANK, "async_", (33,), dtype)
    mpiddp.synchronize(mpiddp.allreduce_async_(t, op=mpiddp.Adasum, name="async_"))
    check_close(t, expected("async_", (33,), dtype), dtype, "async in place")
    shapes = [(3,), (4, 5), (1000,)]
    group = [data(RANK, f"group.{i}", s, dtype) for i, s in enumerate(shapes)]
    outs = mpiddp.grouped_allreduce(group, op=mpiddp.Adasum, name="group")
    for i, (out, s) in enumerate(zip(outs, shapes)):
        check_close(out, expected(f"group.{i}", s, dtype), dtype, f"grouped {i}")
    t = data(RANK, "scaled", (50,), dtype)
    out = mpiddp.allreduce(t, op=mpiddp.Adasum, name="scaled", prescale_factor=0.5,
                           postscale_factor=3.0)
    check_close(out, 3.0 * expected("scaled", (50,), dtype, scale=0.5), dtype, "scaled")
    ok("adasum in place, async, grouped, scale factors")


def properties():
    """Orthogonal vectors add; parallel ones (any positive multiples) average."""
    if HIERARCHICAL:
        return
    n = 4 * SIZE
    basis = torch.zeros(SIZE, n, dtype=torch.float64)
    for r in range(SIZE):
        basis[r, 4 * r:4 * r + 4] = float(r + 1)
    out = mpiddp.allreduce(basis[RANK].clone(), op=mpiddp.Adasum, name="orthogonal")
    assert torch.allclose(out, basis.sum(0), rtol=1e-12), "orthogonal vectors must add"
    direction = torch.arange(1.0, 11.0, dtype=torch.float64)
    out = mpiddp.allreduce(direction.clone(), op=mpiddp.Adasum, name="parallel")
    assert torch.allclose(out, direction, rtol=1e-12), "equal vectors must stay themselves"
    ok("adasum orthogonal vectors add, equal ones stay")


def refusals():
    for dtype in (torch.int32, torch.complex64):
        text = checks.expect(mpiddp.InvalidInputError,
                             lambda: mpiddp.allreduce(torch.ones(3, dtype=dtype),
                                                      op=mpiddp.Adasum, name=f"bad.{dtype}"),
                             "op=Adasum combines floating-point tensors")
        assert str(dtype).split(".")[1] in text, text
    text = checks.expect(RuntimeError,
                         lambda: mpiddp.reducescatter(torch.ones(SIZE * 2), op=mpiddp.Adasum,
                                                      name="rs.adasum"),
                         "op=Adasum is not defined for reducescatter")
    ok("adasum refused for integers, complex and reducescatter on every rank")


def joined():
    """The last rank joins: it contributes zeros, Adasum's identity."""
    if SIZE < 2 or HIERARCHICAL:
        return
    name = "joined"
    if RANK == SIZE - 1:
        mpiddp.join()
    else:
        out = mpiddp.allreduce(data(RANK, name, (64,), torch.float64), op=mpiddp.Adasum,
                               name=name)
        vectors = [as64(data(r, name, (64,), torch.float64)) for r in range(SIZE - 1)]
        vectors.append(np.zeros(64))
        check_close(out, adasum(vectors), torch.float64, "joined")
        mpiddp.join()
    ok("adasum with a joined rank (zeros)")


def process_set():
    if SIZE < 3 or HIERARCHICAL:
        return
    members = list(range(SIZE - 1))
    subset = mpiddp.add_process_set(members)
    if RANK in members:
        name = "subset"
        out = mpiddp.allreduce(data(RANK, name, (300,), torch.float32), op=mpiddp.Adasum,
                               name=name, process_set=subset)
        want = adasum([as64(data(r, name, (300,), torch.float32)) for r in members])
        check_close(out, want, torch.float32, "process set")
    mpiddp.remove_process_set(subset)
    ok("adasum in a process set")


for check in (alone_and_fused, forms, properties, refusals, joined, process_set):
    check()
mpiddp.shutdown()
