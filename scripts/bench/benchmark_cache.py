"""Training steps with more gradient names than the response cache's default capacity, side by
side in one launch: the cache as mpiddp sizes it (it grows), fixed at the default 1,024 (as
before it could grow), and set large enough from the start.

A model of ``--params`` small parameters (``--elements`` floats each), one
``DistributedOptimizer``; each variant is its own ``init()`` with its
``MPIDDP_CACHE_CAPACITY``, ``--warmup`` untimed steps (the growth happens there), then
``--steps`` timed ones (and one more: see ``run_variant``), in ``--rounds`` interleaved
rounds, each round in another order (the first ``init()`` of a process is slower: an untimed
one comes before them all). Prints, per
variant, the median step time, the ratio to the first variant and the slow cycles
(negotiations through rank 0) per timed step.

    mpiexec -n 2 python scripts/bench/benchmark_cache.py
    scripts/cluster/local_cluster.sh run 8x1 -- -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1 \\
        python scripts/bench/benchmark_cache.py

``--rank0-work 64,512`` (one process, no MPI) times instead what a slow cycle costs rank 0 for
``--params`` new names from that many ranks: unpickling every rank's requests, checking them
and planning (``CycleProtocol.make_plan``), pickling the plan: the first step of any job, and
every step of one whose names do not fit the cache.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

import torch

import mpiddp
from mpiddp.config import Settings
from mpiddp.engine.protocol import CycleProtocol, SlowMessage
from mpiddp.engine.request import ALLREDUCE, Request

VARIANTS = {"grows (unset)": None, "fixed 1024": "1024", "set 4096": "4096"}


def run_variant(capacity, args) -> tuple[float, float]:
    """(seconds per step, slow cycles per step) of one ``init()`` with ``capacity``."""
    if capacity is None:
        os.environ.pop("MPIDDP_CACHE_CAPACITY", None)
    else:
        os.environ["MPIDDP_CACHE_CAPACITY"] = capacity
    mpiddp.init()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.elements)) for _ in range(args.params)]
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                      named_parameters=[(f"p{i}", p)
                                                        for i, p in enumerate(params)])

    def step():
        opt.zero_grad()
        sum((p * p).sum() for p in params).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    mpiddp.barrier()
    before = mpiddp.engine_stats()["slow_cycles"]      # the steps' own, not the barriers'
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    slow = (mpiddp.engine_stats()["slow_cycles"] - before) / args.steps
    # One more step before anything new: a rank that finished the timed steps and went on to
    # a new name (the barrier, shutdown) would cost every rank a slow cycle, counted above by
    # a rank that reads its stats later.
    step()
    mpiddp.barrier()
    seconds = (time.perf_counter() - start) / (args.steps + 1)
    mpiddp.shutdown()
    return seconds, slow


def rank0_work(ranks: int, names: int, elements: int) -> dict:
    """Rank 0's side of one slow cycle in which ``ranks`` ranks each send ``names`` new
    all-reduce requests (seconds, bytes gathered)."""
    protocol = CycleProtocol(0, ranks, Settings(cache_capacity=max(1024, names)))
    message = SlowMessage(requests=[Request(f"model.layer{i}.weight", ALLREDUCE, "float32",
                                            (elements,), "cpu", op=1) for i in range(names)],
                          shutdown=None, joined=False, pending=None)
    gathered = [pickle.dumps(message) for _ in range(ranks)]
    start = time.perf_counter()
    plan = protocol.make_plan([pickle.loads(blob) for blob in gathered])
    pickle.dumps(plan)
    assert len(plan.responses) == names
    return {"seconds": time.perf_counter() - start, "bytes": sum(map(len, gathered))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1500)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank0-work", default=None, metavar="N,N,...",
                        help="time rank 0's work in a slow cycle at these rank counts instead")
    args = parser.parse_args()
    if args.rank0_work:
        print(f"| ranks | rank 0's work, {args.params} new names (ms) | gathered (kB) |")
        print("|---:|---:|---:|")
        for ranks in map(int, args.rank0_work.split(",")):
            best = min((rank0_work(ranks, args.params, args.elements) for _ in range(3)),
                       key=lambda r: r["seconds"])
            print(f"| {ranks} | {best['seconds'] * 1e3:.0f} | {best['bytes'] / 1e3:.0f} |")
        return
    torch.set_num_threads(1)
    times = {name: [] for name in VARIANTS}
    slows = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    run_variant(VARIANTS[names[0]], argparse.Namespace(**{**vars(args), "steps": 1}))
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            seconds, slow = run_variant(VARIANTS[name], args)
            times[name].append(seconds)
            slows[name].append(slow)
    mpiddp.init()
    if mpiddp.rank() == 0:
        first = statistics.median(times[next(iter(VARIANTS))])
        print(f"# {args.params} parameters of {args.elements} floats, {mpiddp.size()} ranks, "
              f"median of {args.rounds} rounds of {args.steps} steps")
        print("| cache | step (ms) | vs grows | slow cycles a step |")
        print("|---|---:|---:|---:|")
        for name in VARIANTS:
            median = statistics.median(times[name])
            print(f"| {name} | {median * 1e3:.1f} | {median / first:.2f}x | "
                  f"{statistics.median(slows[name]):.1f} |")
    mpiddp.shutdown()


if __name__ == "__main__":
    main()
