"""Sharded optimizers' halves fused (issue 65; engine/fusion.py ``fusable``,
engine/ring_halves.py): reduce-scatters (and all-gathers) of several buckets submitted
together run as one pass and give each bucket the bits a pass of its own gives, at any rank
count; sums against a float64 NumPy reference. Sizes 0, 1, primes, not divisible by the rank
count; float32 and float64; with prescale and Average. The buckets are cut as a sharded
optimizer cuts them here (``runtime.shard_grid``): flat on one node, by node on nodes of
several ranks (the emulated cluster, tests/test_multinode.py); with the argument ``hybrid``,
sharded within each node and replicated across nodes.
"""
import sys

import numpy as np
import torch

import checks
import mpiddp
from mpiddp.engine.request import ALLGATHER
from mpiddp.torch.ops.requests import reducescatter_entry, ring_allgather_entry, submit_together
from mpiddp import runtime

mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
HYBRID = "hybrid" in sys.argv[1:]
GRID = runtime.shard_grid(None, hybrid=HYBRID)
assert GRID.pieces == (mpiddp.local_size() if HYBRID else SIZE)
CUT = "hybrid" if HYBRID else "by node" if GRID.local_size > 1 else "flat"
SIZES = [0, 1, 7, 97, 1000, 13]


def bucket(index, n, dtype, rank):
    g = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(n, generator=g, dtype=dtype)


def reduce_scatters(tag, buckets, op=mpiddp.Sum, prescale=1.0):
    """Submit the buckets' ring-order reduce-scatters (as ShardedSync does) together;
    returns this rank's chunk of each."""
    entries, outputs = [], []
    for index, flat in enumerate(buckets):
        entry, output = reducescatter_entry(flat.clone(), f"{tag}.rs{index}", op, prescale, 1.0)
        entry.request = entry.request._replace(ring_order=GRID.ring_order, shape=(flat.numel(),))
        entries.append(entry)
        outputs.append(output)
    for handle in submit_together(entries):
        handle.wait()
    return [output() for output in outputs]


def check_reduce_scatters():
    own = GRID.owned
    for dtype in (torch.float32, torch.float64):
        mpiddp.reset_engine_stats()
        buckets = [bucket(i, n, dtype, RANK) for i, n in enumerate(SIZES)]
        together = reduce_scatters(f"together.{dtype}", buckets, prescale=0.5)
        fused = mpiddp.engine_stats()
        apart = [reduce_scatters(f"apart{i}.{dtype}", [flat], prescale=0.5)[0]
                 for i, flat in enumerate(buckets)]
        assert fused["fused_batches"] >= 1 and fused["fused_tensors"] >= 2, fused
        for i, n in enumerate(SIZES):
            assert torch.equal(together[i], apart[i]), (dtype, n)
            everyone = sum(bucket(i, n, dtype, r).double().numpy() for r in range(SIZE)) * 0.5
            bounds = GRID.bounds(n)
            want = everyone[bounds[own]:bounds[own + 1]]
            assert np.allclose(together[i].double().numpy(), want, rtol=1e-6, atol=1e-6)
        average = reduce_scatters(f"average.{dtype}", buckets, op=mpiddp.Average)
        summed = reduce_scatters(f"summed.{dtype}", buckets)
        for a, s in zip(average, summed):
            assert torch.allclose(a, s / SIZE)
    checks.ok("fused sharded reduce-scatters: each bucket's bits as a pass of its own, "
              "sums as float64's", RANK, cut=CUT)


def check_allgathers():
    own = GRID.owned
    for dtype in (torch.float32, torch.float64):
        wholes = [bucket(50 + i, n, dtype, 0) for i, n in enumerate(SIZES)]   # every rank
        outputs = [torch.full((n,), float("nan"), dtype=dtype) for n in SIZES]
        entries = []
        for i, (whole, output) in enumerate(zip(wholes, outputs)):
            bounds = GRID.bounds(whole.numel())
            chunk = whole[bounds[own]:bounds[own + 1]].clone()
            entry = ring_allgather_entry(chunk, output, f"gather.{dtype}.{i}", GRID.ring_order)
            assert entry.request.kind == ALLGATHER
            entries.append(entry)
        mpiddp.reset_engine_stats()
        for handle in submit_together(entries):
            handle.wait()
        stats = mpiddp.engine_stats()
        assert stats["fused_batches"] >= 1, stats
        for whole, output in zip(wholes, outputs):
            assert torch.equal(whole, output)
    checks.ok("fused sharded all-gathers: every bucket whole on every rank", RANK)


check_reduce_scatters()
check_allgathers()
