"""Topology and the hierarchical all-reduce on an emulated cluster
(scripts/cluster/local_cluster.sh).

Usage: multinode_worker.py <nodes> <ranks per node>. Prints 'OK ...' on rank 0.
"""
import socket
import sys

import torch

import mpiddp
from mpiddp.collectives.cost_model import priority_cycle_bytes
from mpiddp.runtime import current
from mpiddp.transport import pacing_for
from mpiddp.transport.pacing import MAX_SLEEP_SECONDS

torch.set_num_threads(1)
NODES, PER_NODE = int(sys.argv[1]), int(sys.argv[2])
mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
assert size == NODES * PER_NODE
# hydra fills the nodes in order: ranks 0..P-1 on the first node, and so on
assert (mpiddp.local_rank(), mpiddp.local_size()) == (rank % PER_NODE, PER_NODE)
assert (mpiddp.cross_rank(), mpiddp.cross_size()) == (rank // PER_NODE, NODES)
hosts = mpiddp.allgather_object(socket.gethostname())
assert len(set(hosts)) == NODES, hosts
if rank == 0:
    print(f"OK topology {NODES}x{PER_NODE}: local and cross ranks per node, hosts "
          f"{sorted(set(hosts))}", flush=True)

# The links were measured at start, and transfers across nodes wait as the measured rate says
# (1 Gbit/s links: sleeps of 1-2 ms between bursts of tests, not blocking; transport/pacing.py).
engine = current.require("test").engine
executor = engine.executor
assert executor.pacing == pacing_for(executor.link.seconds_per_byte), vars(executor)
assert 0.5e-3 <= executor.pacing.max_sleep_s <= MAX_SLEEP_SECONDS, executor.pacing
# Forward overlap's cycle budget is sized from the same links, the same on every rank, and
# the engine's protocol runs with it.
budget = priority_cycle_bytes(NODES, executor.link)
assert executor.priority_cycle_bytes == engine.protocol.settings.priority_cycle_bytes == budget
assert mpiddp.allgather_object(budget) == [budget] * size
if rank == 0:
    print(f"OK links measured ({executor.link.describe()}): {executor.pacing.describe()}; "
          f"cycle budget {budget} B", flush=True)

# Every fused buffer hierarchically (MPIDDP_HIERARCHICAL_ALLREDUCE=1 in the launch) where the
# layout allows it, with every op and odd sizes, against the exact result.
mpiddp.reset_engine_stats()
for op in (mpiddp.Sum, mpiddp.Average, mpiddp.Max):
    for count in (1, 7, 1000, 300_001):
        tensor = torch.arange(count, dtype=torch.float64) + rank
        got = mpiddp.allreduce(tensor, op=op, name=f"h.{op.name}.{count}")
        base = torch.arange(count, dtype=torch.float64)
        want = {mpiddp.Sum: base * size + sum(range(size)),
                mpiddp.Average: base + sum(range(size)) / size,
                mpiddp.Max: base + size - 1}[op]
        assert torch.allclose(got, want), (op, count)
stats = mpiddp.engine_stats()
expected = PER_NODE > 1 and NODES > 1
assert (stats["hierarchical_batches"] > 0) == expected, stats
if rank == 0:
    print(f"OK all-reduce across {NODES} nodes, hierarchical: {stats['hierarchical_batches']} "
          f"batches", flush=True)

# A large buffer (16 MiB) where the hierarchical all-reduce applies goes in pipelined segments
# whose cross-node ring steps stay in flight over the real network; exact sums of integers
# held in float32.
before = mpiddp.engine_stats()
tensor = (torch.arange(4 << 20, dtype=torch.float32) % 1000) * (rank + 1)
got = mpiddp.allreduce(tensor, op=mpiddp.Sum, name="pipelined.16m")
assert torch.equal(got, (torch.arange(4 << 20, dtype=torch.float32) % 1000)
                   * (size * (size + 1) // 2))
pipelined = mpiddp.engine_stats()["pipelined_batches"] - before["pipelined_batches"]
assert pipelined == (1 if expected else 0), pipelined
if rank == 0:
    print(f"OK a 16 MiB all-reduce across nodes, pipelined: {bool(pipelined)}", flush=True)

# Across nodes, with MPIDDP_RING_THRESHOLD unset, a 512 KiB buffer takes one of our
# algorithms (the ring, halving-doubling, recursive doubling where the measured latency is
# high, or the hierarchical all-reduce), not native MPI_Allreduce: the network threshold is
# 256 KiB.
before = mpiddp.engine_stats()
got = mpiddp.allreduce(torch.ones(128 * 1024), op=mpiddp.Sum, name="ring_threshold.512k")
assert torch.all(got == size)
after = mpiddp.engine_stats()
assert after["native_batches"] == before["native_batches"], (before, after)
OWN = ("ring_batches", "halving_doubling_batches", "recursive_doubling_batches",
       "hierarchical_batches")
assert sum(after[k] for k in OWN) > sum(before[k] for k in OWN), (before, after)
if rank == 0:
    print("OK a 512 KiB all-reduce across nodes takes our algorithm (network threshold)",
          flush=True)

# One rank per node at a power of two from 4: with the links measured, the buffers between the
# threshold against MPI_Allreduce and the ring's take recursive halving-doubling (the ring's
# bytes in 2 log2 N steps), over real TCP here; larger ones the ring.
if PER_NODE == 1 and NODES >= 4 and NODES & (NODES - 1) == 0:
    choice = current.require("test").engine.executor.algorithms
    assert choice.link is not None and \
        choice.ring_threshold < choice.halving_doubling_limit, vars(choice)
    for nbytes, algorithm in (((choice.ring_threshold + choice.halving_doubling_limit) // 2,
                               "halving_doubling"),
                              (choice.halving_doubling_limit * 2, "ring")):
        count = nbytes // 4
        before = mpiddp.engine_stats()
        # Small integers, exact in float32 at any N and size (an arange of millions times
        # the rank sum is not, and the algorithms add in different orders).
        values = torch.arange(count, dtype=torch.float32) % 1000
        got = mpiddp.allreduce(values * (rank + 1), op=mpiddp.Sum, name=f"own.{count}")
        want = values * (size * (size + 1) // 2)
        assert torch.equal(got, want), (algorithm, nbytes, (got - want).abs().max())
        after = mpiddp.engine_stats()
        key = f"{algorithm}_batches"
        assert after[key] == before[key] + 1, (algorithm, nbytes, after)
    if rank == 0:
        print(f"OK across {NODES} nodes, halving-doubling up to "
              f"{choice.halving_doubling_limit} bytes, the ring above", flush=True)

# Uneven data across nodes: odd ranks make one more all-reduce (small, and large enough for
# the ring's polite steps), then every rank joins; joined ranks contribute zeros.
for step in range(2 + rank % 2):
    for count in (7, 300_001):
        tensor = torch.full((count,), float(rank + 1), dtype=torch.float32)
        got = mpiddp.allreduce(tensor, op=mpiddp.Sum, name=f"uneven.{step}.{count}")
        want = sum(r + 1 for r in range(size) if 2 + r % 2 > step)
        assert torch.all(got == want), (step, count, got[:3], want)
last = mpiddp.join()
if rank == 0:
    print(f"OK joined ranks across nodes (last to join: rank {last})", flush=True)
mpiddp.shutdown()
