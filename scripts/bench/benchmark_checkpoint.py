"""Save and restore time and memory of ``mpiddp.Checkpoint``: the whole file (the optimizer
state consolidated onto rank 0, which writes it) against ``sharded=True`` (every rank writes
its part; the manifest last), for one float32 model and Adam state at a ``zero_stage``.

    export MALLOC_MMAP_THRESHOLD_=65536
    mpiexec -n 4 python scripts/bench/benchmark_checkpoint.py --stage 2 --dir /tmp/ckpt-bench
    mpiexec -n 4 python scripts/bench/benchmark_checkpoint.py --stage 3 --layers 12 --width 1024

The model is ``--layers`` ``nn.Linear(W, W)`` (12 x 1024: 12.6M parameters, 50 MB; with
Adam's two moments a 151 MB checkpoint), one Adam step taken so that the state exists. Each
form is saved ``--repeats`` times, then restored as many times (into the same model and
optimizer); per operation it reports the wall time (the slowest rank's: the time the job is
held; every save is durable, fsync'd) and, per rank, the peak resident memory above what the
rank held before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; mapped
file pages count, as the kernel counts them). Rank 0 prints a table of medians and the
largest memory over the ranks, and ``--json`` keeps every number. ``MALLOC_MMAP_THRESHOLD_``
makes every large tensor a mapping of its own, returned to the system when freed: otherwise
an operation reuses the heap an earlier one freed and its peak reads as zero.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
from torch import nn

import mpiddp


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measured(operation) -> tuple[float, float]:
    """(seconds, peak MiB above the start) of ``operation()`` on this rank; every rank starts
    together."""
    mpiddp.barrier()
    before = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                    # VmHWM := VmRSS
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
    return seconds, (rss_kib("VmHWM") - before) / 1024


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("benchmark_checkpoint.py: MALLOC_MMAP_THRESHOLD_ is not set: the memory peaks "
              "read low (see the docstring)", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="checkpoint-bench")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4), named_parameters=model.named_parameters(),
        zero_stage=args.stage, model=model if args.stage == 3 else None)
    model(torch.randn(4, args.width)).sum().backward()
    optimizer.step()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    mpiddp.barrier()
    params = sum(p.numel() for p in model.parameters())

    results: dict = {}
    for form in ("whole", "sharded"):
        ckpt = mpiddp.Checkpoint(os.path.join(args.dir, f"{form}.pt"), model=model,
                                 optimizer=optimizer, sharded=form == "sharded")
        for name, operation in (("save", lambda: ckpt.save(1)), ("restore", ckpt.restore)):
            runs = [measured(operation) for _ in range(args.repeats)]
            everyone = mpiddp.allgather_object(runs)
            results[f"{form} {name}"] = {
                "seconds": [max(r[i][0] for r in everyone) for i in range(args.repeats)],
                "peak_mib_by_rank": [max(m for _, m in r) for r in everyone]}
    if rank == 0:
        size_mb = os.path.getsize(os.path.join(args.dir, "whole.pt")) / 1e6
        print(f"{size} ranks, zero_stage={args.stage}: {params / 1e6:.1f}M parameters, "
              f"about {size_mb:.0f} MB a checkpoint; medians of {args.repeats}")
        print(f"{'':18}{'seconds':>9}{'peak MiB rank 0':>17}{'max other rank':>16}")
        for what, result in results.items():
            peaks = result["peak_mib_by_rank"]
            print(f"{what:18}{statistics.median(result['seconds']):9.3f}{peaks[0]:17.0f}"
                  f"{max(peaks[1:], default=0):16.0f}")
        whole, sharded = (statistics.median(results[f"{f} save"]["seconds"])
                          for f in ("whole", "sharded"))
        print(f"sharded save / whole save: {sharded / whole:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "stage": args.stage, "parameters": params,
                           "results": results}, f, indent=1)
    mpiddp.shutdown()


if __name__ == "__main__":
    main()
