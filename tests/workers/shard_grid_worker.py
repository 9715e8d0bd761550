"""A sharded bucket cut by node (collectives/shard_grid.py) on emulated nodes: the world is
cut into "nodes" of ``ranks_per_node`` consecutive ranks (local and cross communicators built
by hand, as ``node_layout`` builds them from shared memory on a real cluster).

The reduce-scatter leaves every rank the float64 reference's sum of its piece, the pieces of
all the ranks tile the bucket, the sums are bitwise those of the hierarchical all-reduce with
the cross-node ring (the unsharded path's order), and the all-gather puts every piece back
on every rank. Odd and empty sizes, float32 and float64.

Usage: shard_grid_worker.py <ranks_per_node>. Prints 'OK ...' on rank 0.
"""
import sys

import numpy as np
import torch
from mpi4py import MPI

from mpiddp.buffers import backend_for
from mpiddp.buffers.dtypes import dtype_named
from mpiddp.collectives.flat import RING
from mpiddp.collectives.hierarchical import hierarchical_allreduce, scratch_elements
from mpiddp.collectives.shard_grid import ShardGrid, sharded_allgather, sharded_reduce_scatter
from mpiddp.reduce_ops import ReduceOp
from mpiddp.torch.core.views import flat_array
from reference_data import as64, data

torch.set_num_threads(1)
world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
PER_NODE = int(sys.argv[1])
local = world.Split(color=RANK // PER_NODE, key=RANK)
cross = world.Split(color=local.Get_rank(), key=RANK)
GRID = ShardGrid(local.Get_rank(), local.Get_size(), cross.Get_rank(), cross.Get_size())
host = backend_for("cpu")

owners = world.allgather(GRID.owned)
assert sorted(owners) == list(range(SIZE)), owners
checked = 0
for name in ("float32", "float64"):
    dtype, torch_dtype = dtype_named(name), getattr(torch, name)
    reduce_into = lambda dst, src, d=dtype: host.reduce_into(dst, src, ReduceOp.SUM, d)  # noqa
    for count in (0, 1, SIZE - 1, 97, 4099):
        key = f"grid.{name}.{count}"
        mine = data(RANK, key, (count,), torch_dtype).contiguous()
        bounds = GRID.bounds(count)
        assert len(bounds) == SIZE + 1 and bounds[0] == 0 and bounds[-1] == count
        lo, hi = bounds[GRID.owned], bounds[GRID.owned + 1]

        sharded = mine.clone()
        scratch = host.empty(max(1, GRID.scratch_elements(bounds)), dtype)
        sharded_reduce_scatter(GRID, local, cross, flat_array(sharded), scratch, bounds,
                               reduce_into)
        want = sum(as64(data(r, key, (count,), torch_dtype)) for r in range(SIZE))
        assert np.allclose(as64(sharded)[lo:hi], want[lo:hi], rtol=1e-5, atol=1e-5), key

        whole = mine.clone()
        scratch = host.empty(max(1, scratch_elements(count, PER_NODE, cross.Get_size(), 1)),
                             dtype)
        hierarchical_allreduce(local, cross, flat_array(whole), scratch, dtype, ReduceOp.SUM,
                               host.reduce_into, RING)
        assert torch.equal(sharded[lo:hi], whole[lo:hi]), key

        gathered = torch.full((count,), float("nan"), dtype=torch_dtype)
        gathered[lo:hi] = sharded[lo:hi]
        sharded_allgather(GRID, local, cross, flat_array(gathered), bounds)
        assert torch.equal(gathered, whole), key
        checked += 1
world.Barrier()
if RANK == 0:
    print(f"OK sharded halves cut by node on {SIZE // PER_NODE} nodes x {PER_NODE} ranks: "
          f"{checked} cases, the hierarchical all-reduce's bits", flush=True)
