"""Training steps with more gradient names than the response cache's default capacity, side by
side in one launch: the cache as mpiddp sizes it (it grows), fixed at the default 1,024 (as
before it could grow), and set large enough from the start.

A model of ``--params`` small parameters (``--elements`` floats each), one
``DistributedOptimizer``; each variant is its own ``init()`` with its
``MPIDDP_CACHE_CAPACITY``, ``--warmup`` untimed steps (the growth happens there), then
``--steps`` timed ones, in ``--rounds`` interleaved rounds, each round in another order (the
first ``init()`` of a process is slower: an untimed one comes before them all). Prints, per
variant, the median step time, the ratio to the first variant and the slow cycles
(negotiations through rank 0) per timed step.

    mpiexec -n 2 python scripts/benchmark_cache.py
    scripts/local_cluster.sh run 8x1 -- -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1 \\
        python scripts/benchmark_cache.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import mpiddp

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
    mpiddp.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    mpiddp.shutdown()
    return seconds, slow


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1500)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
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
