"""All-reduce benchmark: mpiddp (ring, halving-doubling and auto, through the engine) against native
MPI_Allreduce (mpi4py, same MPI) and torch.distributed gloo, side by side in one run.

    mpiexec -n 2 python scripts/bench/benchmark_allreduce.py
    mpiexec -n 4 python scripts/bench/benchmark_allreduce.py --max-size 64M --json out.json

Prints, per message size and method: time per all-reduce (mean over iterations, slowest rank),
algbw = size / time and busbw = algbw * 2(N-1)/N (as nccl-tests reports), busbw relative
to MPI_Allreduce, and the CPU seconds the whole process used per GB all-reduced (the mean
over ranks: spinning while waiting counts) with the part of it spent in user space (the rest is
the kernel's: mostly the sockets' copies, alike for every method; a method that costs more
CPU per byte than another in user space does it in its own code or its MPI library's).
Each method's result is checked against the exact sum before timing.
A separate latency section times a synchronous 4 KiB mpiddp.allreduce (median of many).
``--pieces K`` adds a table of lists of K tensors of each size handed over at once (what a
training step's small gradients are: the engine fuses them into one cycle) against one MPI
call per tensor, blocking or all started at once.
``--json`` also writes every row and the latency for scripts/bench/plot_scaling.py.
``--adasum`` compares ``op=Adasum`` with the engine's ``op=Average`` instead (both through the
engine, the same sizes; the baseline is the average); the check then expects each method's
own result for the ranks' constant vectors (Adasum of parallel vectors: pairwise averages in
its pairing tree).

    mpiexec -n 2 python scripts/bench/benchmark_allreduce.py --device cuda

benchmarks device buffers instead (needs a GPU, CuPy and a CUDA torch; see docs/gpu.md): the
engine on CUDA tensors; the same ring through mpiddp's pinned-memory staging communicator and,
when MPI is CUDA-aware, through the direct one; MPI_Allreduce staged, direct, and through a
plain ``tensor.cpu()`` copy; and torch.distributed NCCL instead of gloo.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from mpi4py import MPI

import mpiddp
from mpiddp.collectives.topology import node_layout

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEVICE = "cpu"      # --device


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def human(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def init_gloo(comm: MPI.Comm, backend: str = "gloo") -> None:
    """torch.distributed over ``backend``, across nodes too (synthetic_benchmark's rendezvous)."""
    from synthetic_benchmark import init_torch_distributed

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    single_node = local.Get_size() == comm.Get_size()
    local.Free()
    init_torch_distributed(single_node, backend)


def no_setup(tensor) -> None:
    """A method that needs nothing set before it runs."""


def use_algorithm(algorithm: str):
    """The setup of a method through the engine: every fused all-reduce by ``algorithm``."""
    def setup(tensor):
        mpiddp.set_allreduce_algorithm(algorithm)
    return setup


def engine(algorithm: str):
    """(setup, run): one synchronous in-place mpiddp.allreduce_ by ``algorithm``."""
    return use_algorithm(algorithm), lambda t: mpiddp.allreduce_(t, name="bench", op=mpiddp.Sum)


def hierarchical_applies(comm: MPI.Comm) -> bool:
    """Whether the hierarchical all-reduce applies to ``comm`` (the engine's own test:
    several nodes, the same number of ranks, more than one, on each)."""
    layout = node_layout(comm)
    layout.local.Free()
    layout.cross.Free()
    return layout.topology.hierarchical_usable


def make_methods(comm: MPI.Comm, with_gloo: bool):
    """name -> (setup(tensor), run(tensor)). Every run all-reduces (sums) the tensor in place."""
    def native_run(tensor):
        comm.Allreduce(MPI.IN_PLACE, [tensor.numpy(), MPI.FLOAT], MPI.SUM)

    methods = {"mpiddp ring": engine("ring"),
               "mpiddp halving-doubling": engine("halving_doubling"),
               "mpiddp auto": engine("auto"), "MPI_Allreduce": (no_setup, native_run)}
    if hierarchical_applies(comm):
        methods["mpiddp hierarchical"] = engine("hierarchical")
    if with_gloo:
        import torch.distributed as dist
        methods["torch gloo"] = (no_setup, lambda t: dist.all_reduce(t))
    return methods


def adasum_of_constants(size: int) -> float:
    """Adasum of rank r's vector full of r + 1 (parallel vectors: each pair averages), in
    mpiddp's pairing: the first 2E ranks pair first, then neighbours (docs/adasum.md)."""
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    level = [(2 * i + 1 + 2 * i + 2) / 2 for i in range(extra)] + \
        [float(r + 1) for r in range(2 * extra, size)]
    while len(level) > 1:
        level = [(level[i] + level[i + 1]) / 2 for i in range(0, len(level), 2)]
    return level[0]


def make_adasum_methods(comm: MPI.Comm):
    """name -> (setup, run, expected value): Adasum against the average, both by the engine."""
    def run(op):
        return lambda t: mpiddp.allreduce_(t, name=f"bench.{op.name}", op=op)
    auto = use_algorithm("auto")
    return {"mpiddp average": (auto, run(mpiddp.Average), (comm.size + 1) / 2),
            "mpiddp adasum": (auto, run(mpiddp.Adasum), adasum_of_constants(comm.size))}


def make_piece_methods(comm: MPI.Comm, pieces: int):
    """The same bytes as ``pieces`` equal tensors reduced together, as a list of small
    gradients is: the engine fuses what it is handed at once, MPI takes one call per tensor
    (blocking, or all started non-blocking and then waited for). name -> (setup, run)."""
    names = [f"piece{i}" for i in range(pieces)]

    def rows(tensor):
        return tensor.view(pieces, -1)

    def engine_each(tensor):
        handles = [mpiddp.allreduce_async_(row, name=name, op=mpiddp.Sum)
                   for row, name in zip(rows(tensor), names)]
        for handle in handles:
            mpiddp.synchronize(handle)

    def engine_grouped(tensor):
        mpiddp.grouped_allreduce_(list(rows(tensor)), name="pieces", op=mpiddp.Sum)

    def native_each(tensor):
        for row in rows(tensor):
            comm.Allreduce(MPI.IN_PLACE, [row.numpy(), MPI.FLOAT], MPI.SUM)

    def native_started(tensor):
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, [row.numpy(), MPI.FLOAT], MPI.SUM)
                             for row in rows(tensor)])

    auto = use_algorithm("auto")
    return {f"mpiddp, {pieces} allreduce_async_": (auto, engine_each),
            f"mpiddp, grouped_allreduce_ of {pieces}": (auto, engine_grouped),
            f"MPI_Allreduce x {pieces}": (no_setup, native_each),
            f"MPI_Iallreduce x {pieces}, Waitall": (no_setup, native_started)}


def make_cuda_methods(comm: MPI.Comm, with_nccl: bool):
    """Device buffers (float32 sum, in place, on this rank's GPU). Every run returns with the
    result in the tensor and the device idle, so the timings compare like with like."""
    import torch.distributed as dist

    from mpiddp.buffers import backend_for
    from mpiddp.buffers.device import CupyCopier
    from mpiddp.buffers.dtypes import dtype_named
    from mpiddp.transport.staging import DirectComm, StagedComm
    from mpiddp.collectives.ring import ring_allreduce
    from mpiddp.torch.core.views import flat_array

    backend = backend_for("cuda")
    f32 = dtype_named("float32")
    private = comm.Dup()
    copier = CupyCopier(backend.state(backend.device_id()))
    staged = StagedComm(private, copier)
    comms = {"staged": staged}
    if mpiddp.mpi_cuda_aware():
        comms["direct"] = DirectComm(private, copier.sync, staged)
    scratch = {}

    def ring(kind):
        def run(tensor):
            buf = flat_array(tensor)
            n = max(1, -(-len(buf) // comm.size))
            if n not in scratch:
                scratch[n] = backend.empty(n, f32)
            torch.cuda.current_stream().synchronize()          # the tensor is ready
            ring_allreduce(comms[kind], buf, scratch[n],
                           lambda dst, src: backend.reduce_into(dst, src, mpiddp.Sum, f32))
            backend.after_unpack("cuda")
        return run

    def mpi(kind):
        def run(tensor):
            buf = flat_array(tensor)
            torch.cuda.current_stream().synchronize()
            if kind == "staged":
                staged.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
                backend.after_unpack("cuda")
            else:
                private.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
        return run

    def host_copy(tensor):
        host = tensor.cpu()
        private.Allreduce(MPI.IN_PLACE, [host.numpy(), MPI.FLOAT], MPI.SUM)
        tensor.copy_(host)
        torch.cuda.current_stream().synchronize()

    methods = {"mpiddp ring": engine("ring"), "mpiddp auto": engine("auto")}
    for kind in comms:
        methods[f"ring {kind}"] = (no_setup, ring(kind))
    # the baseline ("MPI_Allreduce"): direct when MPI is CUDA-aware, else mpiddp's staging
    methods["MPI_Allreduce"] = (no_setup, mpi("direct" if "direct" in comms else "staged"))
    if "direct" in comms:
        methods["MPI_Allreduce staged"] = (no_setup, mpi("staged"))
    methods["MPI_Allreduce via tensor.cpu()"] = (no_setup, host_copy)
    if with_nccl:
        def nccl(tensor):
            dist.all_reduce(tensor)
            torch.cuda.current_stream().synchronize()
        methods["torch nccl"] = (no_setup, nccl)
    return methods


def check(comm, name, setup, run, count, want=None):
    tensor = torch.full((count,), float(comm.rank + 1), device=DEVICE)
    setup(tensor)
    run(tensor)
    want = comm.size * (comm.size + 1) / 2 if want is None else want
    if count and not (torch.all(tensor == want)):
        raise SystemExit(f"{name}: wrong result at {count * 4} bytes (want {want}, "
                         f"got {tensor[:4].tolist()})")


def time_method(comm, setup, run, count, seconds, min_iters):
    tensor = torch.zeros(count, device=DEVICE)
    setup(tensor)
    run(tensor)                                   # warm-up: buffers allocated, pages touched
    comm.Barrier()
    start = time.perf_counter()
    run(tensor)
    one = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    iters = max(min_iters, min(2000, int(seconds / max(one, 1e-6))))
    comm.Barrier()
    before, cpu = os.times(), time.process_time()
    start = time.perf_counter()
    for _ in range(iters):
        run(tensor)
    elapsed = time.perf_counter() - start
    cpu, after = time.process_time() - cpu, os.times()
    # CPU of the whole process (every thread: the engine's, gloo's) per GB all-reduced, and
    # the part of it in user space (the kernel's part is mostly the sockets' copies, which
    # every method pays alike), the means over ranks. (os.times counts in clock ticks, 10 ms:
    # good for the split, too coarse for the total.)
    user, system = after.user - before.user, after.system - before.system
    cpu_per_gb = comm.allreduce(cpu / max(1, iters * count * 4) * 1e9, op=MPI.SUM) / comm.size
    user_share = comm.allreduce(user / max(user + system, 1e-9), op=MPI.SUM) / comm.size
    return comm.allreduce(elapsed, op=MPI.MAX) / iters, cpu_per_gb, user_share


def table(comm, methods: dict, baseline: str, sizes: list, args, pieces: int = 1) -> list:
    """Time every method at every size (``pieces`` tensors of that size each), print the
    rows on rank 0 and return them."""
    factor = 2 * (comm.size - 1) / comm.size if comm.size > 1 else 0.0
    if comm.rank == 0:
        print(f"| size | method | time (us) | algbw (GB/s) | busbw (GB/s) | busbw vs {baseline} "
              "| CPU s/GB | user |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for nbytes in sizes:
        count = nbytes // 4 * pieces
        results = {}
        for name, (setup, run, *want) in methods.items():
            check(comm, name, setup, run, count, *want)
            results[name] = time_method(comm, setup, run, count, args.seconds, args.min_iters)
        if comm.rank == 0:
            base = results[baseline][0]
            for name, (seconds, cpu_per_gb, user_share) in results.items():
                algbw = nbytes * pieces / seconds / 1e9
                rows.append({"bytes": nbytes, "method": name, "seconds": seconds,
                             "busbw_gb_s": algbw * factor, "vs_mpi": base / seconds,
                             "cpu_s_per_gb": cpu_per_gb, "cpu_user_share": user_share})
                print(f"| {human(nbytes)} | {name} | {seconds * 1e6:.1f} | {algbw:.3f} | "
                      f"{algbw * factor:.3f} | {base / seconds:.2f} | {cpu_per_gb:.2f} | "
                      f"{user_share:.0%} |", flush=True)
    return rows


def latency(comm, nbytes=4096, iters=3000):
    """Median time of a synchronous mpiddp.allreduce of ``nbytes``, negotiation included."""
    mpiddp.set_allreduce_algorithm("auto")
    tensor = torch.zeros(nbytes // 4, device=DEVICE)
    samples = []
    for i in range(iters + 300):
        start = time.perf_counter()
        mpiddp.allreduce_(tensor, name="latency", op=mpiddp.Sum)
        if i >= 300:
            samples.append(time.perf_counter() - start)
    return comm.allreduce(float(np.median(samples)), op=MPI.MAX), \
        comm.allreduce(float(np.mean(samples)), op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="256M")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per method and size")
    parser.add_argument("--min-iters", type=int, default=3)
    parser.add_argument("--no-gloo", action="store_true",
                        help="leave out torch.distributed (gloo, or NCCL with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: benchmark device buffers (docs/gpu.md)")
    parser.add_argument("--pieces", type=int, default=0, metavar="K",
                        help="also time lists of K tensors of each size (up to "
                             "--pieces-max-size), all handed over at once, against one MPI call "
                             "per tensor (host only)")
    parser.add_argument("--pieces-max-size", default="256K")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--adasum", action="store_true",
                        help="op=Adasum against op=Average, both through the engine")
    args = parser.parse_args()
    if args.pieces > 1 and args.device == "cuda":
        parser.error("--pieces times host tensors only")

    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    mpiddp.init()                   # on CUDA machines this also picks the rank's GPU
    comm = MPI.COMM_WORLD
    if not args.no_gloo:
        init_gloo(comm, "nccl" if DEVICE == "cuda" else "gloo")
    baseline = "MPI_Allreduce"
    if args.adasum:
        methods, baseline = make_adasum_methods(comm), "mpiddp average"
    elif DEVICE == "cuda":
        methods = make_cuda_methods(comm, not args.no_gloo)
    else:
        methods = make_methods(comm, not args.no_gloo)
    size, rank = comm.size, comm.rank
    if rank == 0:
        where = "" if DEVICE == "cpu" else (
            f"CUDA tensors on {torch.cuda.get_device_name()}, CUDA-aware MPI: "
            f"{'yes' if mpiddp.mpi_cuda_aware() else 'no'}, ")
        print(f"# all-reduce benchmark: {size} ranks, float32 sum, {where}"
              f"{MPI.Get_library_version().splitlines()[0].strip()}, "
              f"torch {torch.__version__}, {os.cpu_count()} cores")
    sizes = []
    nbytes = parse_size(args.min_size)
    while nbytes <= parse_size(args.max_size):
        sizes.append(nbytes)
        nbytes *= 4
    rows = table(comm, methods, baseline, sizes, args)
    piece_rows = []
    if args.pieces > 1:
        if rank == 0:
            print(f"\n{args.pieces} tensors of each size at once (a list of gradients): time "
                  "per list, bandwidth of the whole list, against one blocking MPI_Allreduce "
                  "per tensor")
        piece_sizes = [n for n in sizes if n <= parse_size(args.pieces_max_size)]
        piece_rows = table(comm, make_piece_methods(comm, args.pieces),
                           f"MPI_Allreduce x {args.pieces}", piece_sizes, args, args.pieces)
    median, mean = latency(comm)
    if rank == 0:
        print(f"\nsynchronous 4 KiB mpiddp.allreduce of a {DEVICE} tensor (engine, "
              "negotiation included): "
              f"median {median * 1e6:.1f} us, mean {mean * 1e6:.1f} us (slowest rank)")
        print(f"engine stats rank 0: {mpiddp.engine_stats()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "device": DEVICE, "rows": rows,
                           "pieces": args.pieces if piece_rows else 0, "piece_rows": piece_rows,
                           "latency_4k_s": {"median": median, "mean": mean}}, f, indent=1)
    mpiddp.shutdown()


if __name__ == "__main__":
    main()
