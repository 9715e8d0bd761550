"""Autotune end to end (MPIDDP_AUTOTUNE=1 and a short search, set by the test): a "training
loop" of all-reduces of tensors from 1 KiB to 2 MiB, with integer values whose sums float32
holds exactly, until every rank has applied the search's final settings. Every result is
checked exactly; every rank reports what it applied at which cycle (the test compares them).

Usage: autotune_worker.py <max steps>. Prints 'OK autotune' with every rank's report on rank 0.
"""
import sys

import torch
from mpi4py import MPI

import mpiddp
from checks import ok
from mpiddp.runtime import current

torch.set_num_threads(1)
MAX_STEPS = int(sys.argv[1])
mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
engine = current.require("test").engine
SIZES = [256, 1024, 4096, 16384, 65536, 262144, 524288]      # float32 elements
world = MPI.COMM_WORLD

steps = 0
while steps < MAX_STEPS:
    tensors = [torch.full((n,), float(rank + 1 + i + steps % 5)) for i, n in enumerate(SIZES)]
    handles = [mpiddp.allreduce_async(t, name=f"grad.{i}", op=mpiddp.Sum)
               for i, t in enumerate(tensors)]
    for i, handle in enumerate(handles):
        out = mpiddp.synchronize(handle)
        want = sum(r + 1 + i + steps % 5 for r in range(size))
        assert torch.equal(out, torch.full_like(out, float(want))), \
            f"step {steps} tensor {i}: {out[:4]} != {want}"
    steps += 1
    # Every rank stops at the same step: once all have applied the final settings.
    if world.allreduce(int(engine.autotune_finished), op=MPI.MIN):
        break

assert engine.autotune_finished, f"the search did not end within {MAX_STEPS} steps"
retunes = [(cycle, r.sample, r.final, r.knobs.fusion_threshold, r.knobs.cycle_time,
            r.knobs.ring_threshold, r.knobs.hierarchical) for cycle, r in engine.retunes]
algorithms = engine.executor.algorithms
applied = [engine.executor.fusion_threshold, engine.policy.heartbeat * 1000,
           algorithms.ring_threshold]
mpiddp.shutdown()
everyone = world.gather({"steps": steps, "retunes": retunes, "applied": applied})
ok("autotune", rank, ranks=everyone)
