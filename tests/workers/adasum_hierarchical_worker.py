"""Hierarchical Adasum on emulated nodes: the world cut into "nodes" of ``ranks_per_node``
consecutive ranks (local and cross communicators built by hand, as ``node_layout`` builds
them from shared memory on a cluster), several tensors fused in one buffer, against the
float64 reference of Adasum across nodes of each node's average.

Usage: adasum_hierarchical_worker.py <ranks_per_node>. Prints 'OK ...' on rank 0.
"""
import itertools
import sys

import numpy as np
import torch
from mpi4py import MPI

from adasum_reference import node_average_adasum
from mpiddp.buffers import backend_for
from mpiddp.buffers.dtypes import dtype_named
from mpiddp.collectives.algorithms import AdasumAllreduce, Links
from mpiddp.torch.core.views import flat_array
from reference_data import as64, data

torch.set_num_threads(1)
world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
PER_NODE = int(sys.argv[1])
local = world.Split(color=RANK // PER_NODE, key=RANK)
cross = world.Split(color=local.Get_rank(), key=RANK)
links = Links(world, local, cross)
host = backend_for("cpu")
algorithm = AdasumAllreduce(hierarchical=True)
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 5e-3}

for name in ("float32", "float64", "float16"):
    dtype, torch_dtype = dtype_named(name), getattr(torch, name)
    for counts in ([1], [3, 1000, 7], [SIZE - 1, 0, 97, 4099], [2] * 9):
        keys = [f"ah.{name}.{len(counts)}.{i}" for i in range(len(counts))]
        parts = [data(RANK, k, (n,), torch_dtype) for k, n in zip(keys, counts)]
        buf = flat_array(torch.cat(parts).contiguous())
        scratch = host.empty(max(1, algorithm.scratch_elements(len(buf), dtype.itemsize, links)),
                             dtype)
        bounds = [0, *itertools.accumulate(counts)]
        algorithm.run(links, buf, scratch, dtype, bounds, host, links)
        got = as64(torch.from_numpy(buf.view(np.float16) if name == "float16" else buf))
        for key, n, lo, hi in zip(keys, counts, bounds, bounds[1:]):
            want = node_average_adasum([as64(data(r, key, (n,), torch_dtype))
                                        for r in range(SIZE)], PER_NODE)
            scale = max(1.0, float(np.max(np.abs(want)))) if n else 1.0
            error = float(np.max(np.abs(got[lo:hi] - want))) / scale if n else 0.0
            assert error <= TOLERANCE[name], f"{key}: relative error {error:.2e}"
        every = world.allgather(buf.tobytes())
        assert all(b == every[0] for b in every), f"{name} {counts}: ranks differ"
if RANK == 0:
    print(f"OK hierarchical adasum, {SIZE // PER_NODE} nodes x {PER_NODE}", flush=True)
