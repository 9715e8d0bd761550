"""The hierarchical all-reduce on emulated nodes: the world is cut into "nodes" of
``ranks_per_node`` consecutive ranks (local and cross communicators built by hand, as
``node_layout`` builds them from shared memory on a real cluster). Every op, dtype,
odd and empty sizes, both cross-node algorithms, the pipelined schedule and Average's
per-chunk scaling, against a float64 NumPy reference.

Usage: hierarchical_worker.py <ranks_per_node>. Prints 'OK ...' on rank 0.
"""
import sys

import numpy as np
import torch
from mpi4py import MPI

from mpiddp.buffers import backend_for
from mpiddp.buffers.dtypes import dtype_named
from mpiddp.collectives.flat import NATIVE, RING
from mpiddp.collectives.hierarchical import hierarchical_allreduce, scratch_elements
from mpiddp.collectives.topology import node_layout
from mpiddp.reduce_ops import ReduceOp
from mpiddp.transport.network import SEGMENT_BYTES, NetworkComm
from mpiddp.torch.core.views import flat_array
from reference_data import as64, data

torch.set_num_threads(1)
world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
PER_NODE = int(sys.argv[1])
assert SIZE % PER_NODE == 0
local = world.Split(color=RANK // PER_NODE, key=RANK)
cross = world.Split(color=local.Get_rank(), key=RANK)
CROSS = cross.Get_size()
host = backend_for("cpu")
OPS = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max,
       ReduceOp.PRODUCT: np.prod}

checked = 0
for name in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"):
    dtype = dtype_named(name)
    torch_dtype = getattr(torch, name)
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        for count in (0, 1, 3, SIZE - 1, 97, 4099):
            # segments > 1: the pipelined schedule (here with blocking transfers)
            for cross_algorithm, segments in ((NATIVE, 1), (RING, 1), (RING, 3)):
                key = f"h.{name}.{op.name}.{count}"
                tensor = data(RANK, key, (count,), torch_dtype, op).contiguous()
                buf = flat_array(tensor)
                scratch = host.empty(max(1, scratch_elements(count, PER_NODE, CROSS, segments)),
                                     dtype)
                postprocess = None
                if op == ReduceOp.AVERAGE:
                    postprocess = lambda part, d=dtype: host.scale_(part, 1.0 / SIZE, d)  # noqa
                hierarchical_allreduce(local, cross, buf, scratch, dtype, op, host.reduce_into,
                                       cross_algorithm, postprocess, segments)
                stacked = np.stack([as64(data(r, key, (count,), torch_dtype, op))
                                    for r in range(SIZE)])
                if op == ReduceOp.AVERAGE:
                    want = stacked.mean(0) if dtype.kind == "float" else \
                        np.trunc(stacked.sum(0) * (1.0 / SIZE))
                else:
                    want = OPS[op](stacked, axis=0)
                tol = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-5}.get(name, 1e-12)
                got = as64(tensor)
                if dtype.kind == "int" and op == ReduceOp.AVERAGE:
                    # per-chunk truncation of the same float64 value: exact
                    tol = 0.0
                assert np.allclose(got, want, rtol=tol, atol=tol), \
                    (key, cross_algorithm, segments, np.max(np.abs(got - want)) if count else 0)
                checked += 1
# Large buffers with the cross-node ring on NetworkComm, as the engine runs it across nodes:
# ring steps above its polite threshold, cut into several messages (SEGMENT_BYTES) with an
# uneven last piece; pipelined too, with uneven segments whose ring steps stay in flight
# while the node-local phases of the next and previous segments run.
network = NetworkComm(cross)
for name in ("float32", "float64"):
    dtype = dtype_named(name)
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        count = 3 * SEGMENT_BYTES // dtype.itemsize * CROSS + 13
        key = f"net.{name}.{op.name}"
        stacked = np.stack([as64(data(r, key, (count,), getattr(torch, name), op))
                            for r in range(SIZE)])
        want = stacked.mean(0) if op == ReduceOp.AVERAGE else stacked.sum(0)
        for segments in (1, 3):
            tensor = data(RANK, key, (count,), getattr(torch, name), op).contiguous()
            scratch = host.empty(scratch_elements(count, PER_NODE, CROSS, segments), dtype)
            postprocess = None
            if op == ReduceOp.AVERAGE:
                postprocess = lambda part, d=dtype: host.scale_(part, 1.0 / SIZE, d)  # noqa
            hierarchical_allreduce(local, network, flat_array(tensor), scratch, dtype, op,
                                   host.reduce_into, RING, postprocess, segments)
            assert np.allclose(as64(tensor), want, rtol=1e-5, atol=1e-5), (key, segments)
            checked += 1
layout = node_layout(world)     # one real node here: never usable
assert not layout.topology.hierarchical_usable and layout.topology.local_size == SIZE
world.Barrier()
if RANK == 0:
    print(f"OK hierarchical all-reduce on {SIZE // PER_NODE} nodes x {PER_NODE} ranks: "
          f"{checked} cases match the float64 reference", flush=True)
