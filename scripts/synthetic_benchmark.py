"""Training throughput on synthetic data: mpiddp against torch DistributedDataParallel.

In the spirit of Horovod's ``pytorch_synthetic_benchmark.py``: every rank trains the same
model on random data; we time forward + backward + optimizer step and report samples/sec per
rank and in total. In the same run, on the same model, batch and data, it also times

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the gloo backend (torch's CPU
  backend; torch.distributed is initialised from the MPI rank/size with a TCP store whose
  port rank 0 picks and broadcasts through mpi4py), and
* ``single``: one process alone (rank 0 trains while the other ranks wait without using CPU),
  the baseline for scaling efficiency = total / (ranks x single).

Measurements are interleaved (mpiddp, ddp, single, then ddp, single, mpiddp, ...) so that a
change in the machine's background load hits every variant alike; each number is the median
over ``--iters`` timed rounds of ``--steps`` steps (after ``--warmup`` steps per variant and
one untimed step per round). mpiddp runs only during its own rounds (``init()`` before,
``shutdown()`` after), so its idle engine costs the other variants nothing. "CPU ms/step" is
the CPU time of a rank's whole process (every thread) per step.

    mpiexec -n 2 python scripts/synthetic_benchmark.py --model cnn --batch-size 32
    mpiexec -n 2 python scripts/synthetic_benchmark.py --model mlp --batch-size 16

Models (plain torch, no torchvision): ``cnn`` is ResNet-18 (11.7 M parameters, 47 MB of
gradients; ``--image-size`` sets the input resolution and with it the compute per sample);
``mlp`` is six 2048x2048 linear layers (25 M parameters, 100 MB of gradients, little compute:
communication-bound).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpiddp


# ---- models -------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout: 7x7 stem, max-pool, 4 stages of 2 basic blocks."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages, inplanes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(inplanes, planes, stride),
                                        BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def mlp(width: int = 2048, depth: int = 6) -> nn.Module:
    layers = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build(args):
    """(model, input batch, target batch) for this rank; same initial weights everywhere."""
    torch.manual_seed(0)
    if args.model == "cnn":
        model = ResNet18(num_classes=1000)
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        target = torch.randint(0, 1000, (args.batch_size,))
    else:
        model = mlp(args.width, args.depth)
        data = torch.randn(args.batch_size, args.width)
        target = torch.randint(0, args.width, (args.batch_size,))
    return model, data, target


# ---- the variants -------------------------------------------------------------------------
class Variant:
    """One way of training: ``step()`` runs forward, backward and the optimizer step."""

    def __init__(self, name, model, optimizer, data, target):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.data, self.target = data, target

    def step(self):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(self.data), self.target)
        loss.backward()
        self.optimizer.step()


def make_mpiddp(args, bucket_cap_mb: float, name: str) -> Variant:
    model, data, target = build(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compression = getattr(mpiddp.Compression, args.compression)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=compression,
                                            bucket_cap_mb=bucket_cap_mb)
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    return Variant(name, model, optimizer, data, target)


def init_torch_distributed(single_node: bool, backend: str = "gloo") -> None:
    """torch.distributed from the MPI rank and size; rank 0 picks a free port for the TCP
    store and broadcasts it, with its address when the job spans several nodes: MASTER_ADDR
    if set (as torch's launchers use it), else its host name's address."""
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if single_node else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        address = (host, port)
    else:
        address = None
    host, port = comm.bcast(address, root=0)
    store = dist.TCPStore(host, port, size, is_master=rank == 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)


def make_ddp(args, bucket_cap_mb: float, name: str) -> Variant:
    from torch.nn.parallel import DistributedDataParallel

    model, data, target = build(args)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if args.compression != "none":   # the same compression on both sides
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[args.compression]
        ddp_model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    return Variant(name, ddp_model, optimizer, data, target)


def make_single(args) -> Variant:
    model, data, target = build(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Variant("single", model, optimizer, data, target)


def wait_quietly(request) -> None:
    """Wait without spinning (a spinning waiter would take a core from a working rank)."""
    while not request.Test():
        time.sleep(0.002)


def barrier() -> None:
    from mpi4py import MPI

    wait_quietly(MPI.COMM_WORLD.Ibarrier())


def cpu_seconds() -> float:
    """CPU time of this process, all threads (compute, autograd, engine, gloo)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_round(variant: Variant, steps: int, rank: int) -> tuple[float, float]:
    """(samples/sec, CPU ms per step) of this rank over ``steps`` steps, after one untimed
    step ('single': rank 0 trains alone while the others wait without using CPU)."""
    barrier()
    if variant.name == "single" and rank != 0:
        barrier()
        return float("nan"), float("nan")
    variant.step()
    if variant.name != "single":
        barrier()
    start, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        variant.step()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if variant.name == "single":
        barrier()
    return variant.data.shape[0] * steps / elapsed, 1e3 * cpu / steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per rank per step (default: 32 for cnn, 16 for mlp)")
    p.add_argument("--image-size", type=int, default=64, help="cnn input resolution")
    p.add_argument("--width", type=int, default=2048, help="mlp layer width")
    p.add_argument("--depth", type=int, default=6, help="mlp layers")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--iters", type=int, default=4, help="timed rounds per variant")
    p.add_argument("--variants", default="mpiddp,ddp,single",
                   help="comma-separated: mpiddp, ddp (torch DDP over gloo), single (one "
                        "process, the scaling baseline); mpiddp:MB / ddp:MB set the bucket "
                        "size of that variant (e.g. mpiddp:0,mpiddp:1000,ddp,ddp:1000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / ranks on the node)")
    p.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                   help="gradient compression on both sides: mpiddp's Compression.fp16 / "
                        ".bf16, DDP's fp16_compress_hook / bf16_compress_hook")
    p.add_argument("--fp16-allreduce", dest="compression", action="store_const",
                   const="fp16", help="the same as --compression fp16 (Horovod's flag)")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="bandwidth of each node's link (Gbit/s): also report each variant's "
                        "step time against the perfect-overlap bound max(one-process step, "
                        "wire time)")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0,
                   help="mpiddp: DistributedOptimizer(bucket_cap_mb=...)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 32 if args.model == "cnn" else 16
    return args


def report_bound(args, result: dict, names: list, nodes: int, params: int) -> None:
    """Step time of each variant against max(one-process step, wire time): with perfect
    overlap a step costs its compute or its traffic, whichever is longer. Wire time: each
    node's link carries 2 (n - 1) / n of the gradient bytes each way (ring or hierarchical
    all-reduce across n nodes), at ``--link-gbit``."""
    wire_bytes = params * (4 if args.compression == "none" else 2) * 2 * (nodes - 1) / max(nodes, 1)
    wire = wire_bytes / (args.link_gbit * 1e9 / 8)
    single_step = args.batch_size / result["variants"]["single"]["per_rank"]
    bound = max(single_step, wire)
    result["bound"] = {"wire_s": wire, "single_step_s": single_step, "bound_s": bound}
    print(f"perfect-overlap bound: max(one-process step {single_step:.3f} s, wire time "
          f"{wire:.3f} s over {nodes} node(s) at {args.link_gbit:g} Gbit/s) = {bound:.3f} s")
    for name in names:
        if name != "single":
            step = args.batch_size / result["variants"][name]["per_rank"]
            result["variants"][name]["of_bound"] = bound / step
            print(f"  {name}: {step:.3f} s per step = {100 * bound / step:.0f}% of the bound")


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = node.Get_size()
    node.Free()
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n.split(":")[0] not in ("mpiddp", "ddp", "single")]
    if unknown or len(set(names)) != len(names):
        raise SystemExit(f"bad --variants {args.variants!r}: use mpiddp[:MB], ddp[:MB], single")
    if args.compression == "bf16" and not torch.cuda.is_available():
        # torch's bf16_compress_hook refuses anything but NCCL/XCCL: nothing to compare with.
        if rank == 0 and any(n.startswith("ddp") for n in names):
            print("ddp left out: its bf16_compress_hook needs CUDA and NCCL (or XPU)",
                  flush=True)
        names = [n for n in names if not n.startswith("ddp")]

    # mpiddp runs only during its own rounds (init ... shutdown), so that its idle engine
    # (a heartbeat cycle every MPIDDP_CYCLE_TIME ms) costs the other variants nothing.
    variants = {}
    for name in names:
        kind, _, cap = name.partition(":")
        if kind == "ddp":
            import torch.distributed as dist
            if not dist.is_initialized():
                init_torch_distributed(local_size == size)
            variants[name] = make_ddp(args, float(cap or args.ddp_bucket_mb), name)
        elif kind == "single":
            variants[name] = make_single(args)
        else:
            mpiddp.init()
            variants[name] = make_mpiddp(args, float(cap or args.bucket_cap_mb), name)
    params = sum(p.numel() for p in next(iter(variants.values())).model.parameters())
    if rank == 0:
        print(f"model {args.model}"
              + (f" (ResNet-18, {args.image_size}x{args.image_size} images)"
                 if args.model == "cnn" else f" ({args.depth}x{args.width}x{args.width})")
              + f": {params / 1e6:.1f} M parameters, {params * 4 / 1e6:.0f} MB of gradients; "
              f"batch {args.batch_size} per rank; {size} rank(s), {threads} thread(s) each; "
              f"{args.iters} interleaved rounds of {args.steps} steps after {args.warmup} "
              "warm-up steps", flush=True)

    for name, variant in variants.items():
        for _ in range(args.warmup):
            if name != "single" or rank == 0:
                variant.step()
    mpiddp.shutdown()
    stats = {}
    rates = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for it in range(args.iters):
        order = names[it % len(names):] + names[:it % len(names)]   # rotate: no position bias
        for name in order:
            if name.startswith("mpiddp"):
                mpiddp.init()
                mpiddp.reset_engine_stats()
            rate, cpu_ms = time_round(variants[name], args.steps, rank)
            rates[name].append(rate)
            cpu[name].append(cpu_ms)
            if name.startswith("mpiddp"):
                stats[name] = mpiddp.engine_stats()
                mpiddp.shutdown()
        if rank == 0:
            print(f"round {it + 1}/{args.iters}: " + ", ".join(
                f"{name} {rates[name][-1]:.1f}" for name in names) + " samples/s on rank 0",
                flush=True)

    everyone = comm.gather(rates, root=0)
    cpu_all = comm.gather(cpu, root=0)
    if rank != 0:
        return 0
    result = {"model": args.model, "batch_size": args.batch_size, "ranks": size,
              "threads": threads, "image_size": args.image_size, "params": params,
              "iters": args.iters, "steps": args.steps, "variants": {}}
    width = max(8, *(len(n) for n in names))
    print(f"\n{'variant':{width}s} {'samples/s per rank':>19s} {'total':>8s} "
          f"{'efficiency':>11s} {'CPU ms/step':>12s}")
    single = None
    if "single" in names:
        single = statistics.median(everyone[0]["single"])
    for name in names:
        if name == "single":
            totals = everyone[0]["single"]
        else:   # the job's throughput in each round: the sum over ranks
            totals = [sum(everyone[r][name][i] for r in range(size)) for i in range(args.iters)]
        total = statistics.median(totals)
        ranks_here = 1 if name == "single" else size
        efficiency = total / (size * single) if single and name != "single" else None
        # CPU time per step and rank (all threads), median over rounds, mean over ranks
        cpu_ms = statistics.mean(statistics.median(cpu_all[r][name])
                                 for r in range(ranks_here))
        result["variants"][name] = {"total": total, "per_rank": total / ranks_here,
                                    "rounds": totals, "efficiency": efficiency,
                                    "cpu_ms_per_step": cpu_ms}
        print(f"{name:{width}s} {total / ranks_here:19.1f} {total:8.1f} "
              f"{'-' if efficiency is None else f'{efficiency:.2f}':>11s} {cpu_ms:12.0f}"
              f"   (rounds: {', '.join(f'{t:.1f}' for t in totals)})")
    print()
    result["ratios"] = {}
    for a in (n for n in names if n.startswith("mpiddp")):
        for b in (n for n in names if n.startswith("ddp")):
            va, vb = result["variants"][a], result["variants"][b]
            ratio = va["total"] / vb["total"]
            per_round = [x / y for x, y in zip(va["rounds"], vb["rounds"])]
            result["ratios"][f"{a} / {b}"] = ratio
            print(f"{a} / {b} (gloo) throughput: {ratio:.2f}x (ratio of medians; per round "
                  f"{', '.join(f'{x:.2f}' for x in per_round)})")
    if args.link_gbit and single:
        report_bound(args, result, names, size // local_size, params)
    steps = args.steps + 1
    for name, st in stats.items():
        print(f"{name} engine on rank 0, last round, per step: {st['cycles'] / steps:.0f} "
              f"cycles, {st['allreduce_batches'] / steps:.0f} reductions "
              f"({st['fused_batches'] / steps:.0f} fused), "
              f"{st['allreduce_bytes'] / steps / 1e6:.0f} MB")
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
