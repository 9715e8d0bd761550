"""Training throughput on synthetic data: mpiddp against torch DistributedDataParallel.

In the spirit of Horovod's ``pytorch_synthetic_benchmark.py``: every rank trains the same
model on random data; we time forward + backward + optimizer step and report samples/sec per
rank and in total. In the same run, on the same model, batch and data, it also times

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the gloo backend (torch's CPU
  backend; torch.distributed is initialised from the MPI rank/size with a TCP store whose
  port rank 0 picks and broadcasts through mpi4py), and
* ``fsdp2`` (with ``--variants``): FSDP2, ``torch.distributed.fsdp.fully_shard`` over the same
  gloo group with ``reshard_after_forward=True`` (parameters sharded too, ZeRO-3 style),
  applied per block of the model (``fsdp_units``), then on the root, and
* ``horovod`` (with ``--variants``): Horovod's ``horovod.torch.DistributedOptimizer`` with its
  defaults, over the same MPI (run from a venv that has Horovod built against the same torch
  and MPI: ``scripts/horovod/build_horovod.sh``, docs/benchmarks.md), and
* ``single``: one process alone (rank 0 trains while the other ranks wait without using CPU),
  the baseline for scaling efficiency = total / (ranks x single).

Measurements are interleaved (mpiddp, ddp, single, then ddp, single, mpiddp, ...) so that a
change in the machine's background load hits every variant alike; each number is the median
over ``--iters`` timed rounds of ``--steps`` steps (after ``--warmup`` steps per variant and
one untimed step per round). mpiddp runs only during its own rounds (``init()`` before,
``shutdown()`` after), so its idle engine costs the other variants nothing; Horovod likewise
(``hvd.init()`` / ``hvd.shutdown()``: its background thread negotiates every cycle).
"CPU ms/step" is the CPU time of a rank's whole process (every thread) per step.

    mpiexec -n 2 python scripts/bench/synthetic_benchmark.py --model cnn --batch-size 32
    mpiexec -n 2 python scripts/bench/synthetic_benchmark.py --model mlp --batch-size 16
    mpiexec -n 2 python scripts/bench/synthetic_benchmark.py --model cnn --device cuda

``--device cuda`` trains ``cnn`` or ``mlp`` on the GPUs (local rank k on ``cuda:k``, round-robin
when ranks outnumber GPUs; DDP still over gloo, which reduces CUDA tensors through the host,
because NCCL refuses two ranks on one GPU); steps are timed to the end of their GPU work.

Models (plain torch, no torchvision): ``cnn`` is ResNet-18 (11.7 M parameters, 47 MB of
gradients; ``--image-size`` sets the input resolution and with it the compute per sample);
``mlp`` is six 2048x2048 linear layers (25 M parameters, 100 MB of gradients, little compute:
communication-bound).

Simulated accelerators (``scripts/bench/simulated_models.py``): ``sim-resnet50``, ``sim-resnet18``,
``sim-vgg16`` and ``sim-bert`` have a real model's parameter tensors, but their layers only
wait (``time.sleep``: no CPU, GIL released) for their share of a one-process step, as a host
thread waits for a GPU. The step is ``--step-time`` seconds, or a multiple of the estimated
wire time of the gradients (``--regime``, with ``--link-gbit``), or what a GPU measured
(``--device-profile``). It leaves out PCIe copies, device memory traffic and kernel launches
(docs/benchmarks.md, "Simulated accelerators"):

    mpiexec -n 2 python scripts/bench/synthetic_benchmark.py --model sim-resnet50 --step-time 0.2
    mpiexec -n 2 python scripts/bench/synthetic_benchmark.py --model sim-bert --regime balanced \
        --link-gbit 1 --variants mpiddp,overlap,ddp,single
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import resource
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpiddp
from mpiddp.config import ALGORITHMS   # every one but 'auto' counts <name>_batches

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simulated_models as sim  # noqa: E402  (a sibling script, not a package)

REGIMES = {"balanced": 1.0, "compute": 2.0, "wire": 0.5}   # one-process step / wire time


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


def build(args, nominal: bool = False):
    """(model, input batch, target batch) for this rank; same initial weights everywhere.
    ``nominal``: a simulated model at the nominal step even on a straggler (the baseline)."""
    torch.manual_seed(0)
    if args.model in sim.MODELS:
        model = sim.SimulatedModel(args.model, args.param_scale)
        slower = args.straggler if args.is_straggler and not nominal else 1.0
        model.set_step_time(args.sim_step_s * slower, args.batch_size, args.sim_optimizer_s)
        return model, torch.zeros(args.batch_size, 1), None
    device = torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")
    if args.model == "cnn":
        model = ResNet18(num_classes=1000)
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        target = torch.randint(0, 1000, (args.batch_size,))
    else:
        model = mlp(args.width, args.depth)
        data = torch.randn(args.batch_size, args.width)
        target = torch.randint(0, args.width, (args.batch_size,))
    return model.to(device), data.to(device), target.to(device)


# ---- the variants -------------------------------------------------------------------------
class Variant:
    """One way of training: ``step()`` runs forward, backward and the optimizer step;
    ``finish()`` completes what a step may leave running (forward overlap's updates)."""

    def __init__(self, name, model, optimizer, data, target, overlap=False, at_step=False):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.data, self.target, self.overlap = data, target, overlap
        self.at_step = at_step      # synchronize() after backward: shards stepped at step()

    def step(self):
        self.optimizer.zero_grad()
        out = self.model(self.data)
        # Simulated models: their output's values mean nothing; any scalar drives backward.
        loss = out.sum() if self.target is None else F.cross_entropy(out, self.target)
        loss.backward()
        if self.at_step:
            self.optimizer.synchronize()
        self.optimizer.step()

    def finish(self):
        if self.overlap:
            self.optimizer.synchronize()


def make_optimizer(args, model, params):
    """SGD with momentum; on a simulated model, an optimizer step that only takes device
    time (a real one would spend host CPU that a GPU's update does not)."""
    if args.model in sim.MODELS:
        return sim.SimulatedOptimizer(params, model.device, args.sim_seconds_per_param)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def supports_overlap_forward() -> bool:
    return "overlap_forward" in inspect.signature(mpiddp.DistributedOptimizer).parameters


def make_mpiddp(args, bucket_cap_mb: float, name: str, overlap: bool | str = False,
                zero_stage: int = 0, at_step: bool = False, compression=None,
                hybrid: bool = False) -> Variant:
    model, data, target = build(args)
    optimizer = make_optimizer(args, model, model.parameters())
    if compression is None:
        compression = getattr(mpiddp.Compression, args.compression)
    # Only passed when asked for, so the standard path runs on any mpiddp.
    extra = {"overlap_forward": overlap} if overlap else {}
    # Before the optimizer: at stage 3 the parameters are released once it is built.
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    if zero_stage:
        if isinstance(optimizer, sim.SimulatedOptimizer):
            mpiddp.elementwise_optimizer(sim.SimulatedOptimizer)   # a shard takes its share
        extra["zero_stage"] = zero_stage
        if hybrid:
            extra["hybrid_shard"] = True
        if zero_stage == 3:
            extra["model"] = model
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=compression,
                                            bucket_cap_mb=bucket_cap_mb, **extra)
    if zero_stage:
        for piece in optimizer._mpiddp.layout.pieces():      # --param-scale: the real share
            if hasattr(piece.param, "sim_elements"):
                piece.shard.sim_elements = round(piece.param.sim_elements *
                                                 piece.shard.numel() / piece.param.numel())
    return Variant(name, model, optimizer, data, target, overlap, at_step)


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


def make_ddp(args, bucket_cap_mb: float, name: str, powersgd_rank: int = 0) -> Variant:
    from torch.nn.parallel import DistributedDataParallel

    model, data, target = build(args)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if powersgd_rank:                # torch's PowerSGD hook, as mpiddp's psgdN variant
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start)
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.compression != "none":   # the same compression on both sides
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[args.compression]
        ddp_model.register_comm_hook(None, hook)
    optimizer = make_optimizer(args, model, ddp_model.parameters())
    return Variant(name, ddp_model, optimizer, data, target)


def make_ddp_zero(args, bucket_cap_mb: float, name: str) -> Variant:
    """DDP with torch's ZeroRedundancyOptimizer (optimizer state sharded by whole parameters;
    the updated parameters broadcast by their owners after the step)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model, data, target = build(args)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if args.model in sim.MODELS:
        optimizer = ZeroRedundancyOptimizer(
            ddp_model.parameters(), optimizer_class=sim.SimulatedOptimizer,
            device=model.device, seconds_per_param=args.sim_seconds_per_param)
    else:
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(),
                                            optimizer_class=torch.optim.SGD, lr=0.01,
                                            momentum=0.9)
    return Variant(name, ddp_model, optimizer, data, target)


def make_horovod(args, name: str) -> Variant:
    """Horovod's DistributedOptimizer (``horovod.torch``) on the same model and optimizer, with
    Horovod's own defaults (fusion buffer, cycle time): what a Horovod user runs. Horovod
    builds its optimizer again from the wrapped one's class and ``param_groups`` alone, so the
    simulated optimizer gets its device and rate as defaults."""
    import horovod.torch as hvd

    hvd.init()
    model, data, target = build(args)
    if args.model in sim.MODELS:
        device, rate = model.device, args.sim_seconds_per_param

        class HorovodSimulatedOptimizer(sim.SimulatedOptimizer):
            def __init__(self, params, device=device, seconds_per_param=rate):
                super().__init__(params, device, seconds_per_param)

        optimizer = HorovodSimulatedOptimizer(model.parameters())
    else:
        optimizer = make_optimizer(args, model, model.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    return Variant(name, model, optimizer, data, target)


def horovod_running(on: bool) -> None:
    """Start or stop Horovod (its background thread) around its own rounds."""
    import horovod.torch as hvd

    if on:
        hvd.init()
    else:
        hvd.shutdown()


def fsdp_block(name: str) -> str:
    """The block a parameter-holding module belongs to, from its qualified name (a simulated
    layer's: the real layer's): the name up to its first numeric component (a transformer
    layer ``encoder.layer.3``, a residual block ``layer2.1``, VGG's ``features.10``, the
    MLP's ``2``), else its first component (``embeddings``, ``Mixed_5b``, ``conv1``, ``fc``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def fsdp_units(model: nn.Module) -> list:
    """The modules each ``fully_shard`` call takes, in forward (registration) order: one
    entry per block (``fsdp_block``), a module or a list of modules.

    Why blocks: it is how FSDP2 is applied in practice (its docs and torchtitan shard each
    transformer block, then the root), and mpiddp's stage 3 will choose its units itself, so
    the peer gets the usual hand-written policy, automated. It keeps the collectives few
    and about the size of DDP's 25 MB buckets (full size: sim-bert 15 units, an encoder
    layer 7.1 M parameters; sim-resnet50 19, median 1.1 M; ResNet-18 11; the MLP one per
    Linear). One ``fully_shard`` per simulated layer (BERT has 102 with parameters, most a
    LayerNorm or a small linear) would pay gloo's per-collective latency some 300 times
    a step, and one on the whole model would gather it all at once, which is not ZeRO-3.
    A simulated model's layers sit side by side in one ``ModuleDict``, so a block's layers
    go to ``fully_shard`` as a list (one group: one all-gather before the first of them, one
    reduce-scatter after the backward of all of them); a real model's block is its
    submodule."""
    if isinstance(model, sim.SimulatedModel):
        named = [(layer.spec.name, layer) for layer in model.layers.values() if layer.params]
    else:
        named = [(name, module) for name, module in model.named_modules()
                 if name and next(module.parameters(recurse=False), None) is not None]
    blocks: dict[str, list] = {}
    for name, module in named:
        blocks.setdefault(fsdp_block(name), []).append(module)
    if isinstance(model, sim.SimulatedModel):
        return [layers if len(layers) > 1 else layers[0] for layers in blocks.values()]
    return [model.get_submodule(block) for block in blocks]


def make_fsdp2(args, name: str) -> Variant:
    """FSDP2 over gloo: ``fully_shard(reshard_after_forward=True)`` on each of
    ``fsdp_units(model)``, then on the root (whose own parameters, if any, are gathered for
    the whole forward); the optimizer on the sharded (DTensor) parameters. The model starts
    from the same weights on every rank (``build``'s seed), as FSDP2 does not broadcast.
    The simulated layers' custom autograd Function (``_Layer``, the parameters passed as
    inputs) needs no change: FSDP2's hooks are module hooks that swap the unsharded
    parameters in as the module's registered ones before its forward and its backward, so
    ``_Layer`` takes them and its gradients accumulate into them, to be reduce-scattered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, data, target = build(args)
    real_elements = {n: p.sim_elements for n, p in model.named_parameters()
                     if hasattr(p, "sim_elements")}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # FSDP2's defaults otherwise. On the CPU it issues its all-gathers and reduce-scatters
    # with async_op=False (its overlap rests on CUDA streams): each blocks the training
    # thread, so its communication does not overlap compute here, whatever the prefetch
    # settings (the private _set_unshard_async_op(True) with set_modules_to_forward_prefetch
    # would overlap the forward all-gathers only). That is FSDP2 over gloo as it is.
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    # fully_shard replaced the parameters by sharded ones: a simulated optimizer steps this
    # rank's share of the real layer's elements (as mpiddp's zero variants' shards do).
    for n, p in model.named_parameters():
        if n in real_elements:
            p.sim_elements = round(real_elements[n] * p.to_local().numel() / p.numel())
    optimizer = make_optimizer(args, model, model.parameters())
    return Variant(name, model, optimizer, data, target)


def make_single(args) -> Variant:
    model, data, target = build(args, nominal=True)
    optimizer = make_optimizer(args, model, model.parameters())
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


def device_idle() -> None:
    """Wait for this process's GPU work (a step's kernels run after step() returns)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_round(variant: Variant, steps: int, rank: int) -> tuple[float, float]:
    """(samples/sec, CPU ms per step) of this rank over ``steps`` steps, after one untimed
    step ('single': rank 0 trains alone while the others wait without using CPU)."""
    barrier()
    if variant.name == "single" and rank != 0:
        barrier()
        return float("nan"), float("nan")
    variant.step()
    device_idle()
    if variant.name != "single":
        barrier()
    # Steady state: the window holds ``steps`` forwards, backwards and updates. With forward
    # overlap the untimed step's update runs inside it (in the first forward) and the last
    # timed step's update after it (finish()), as a training loop pays it once, at its end.
    start, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        variant.step()
    device_idle()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    variant.finish()
    if variant.name == "single":
        barrier()
    return variant.data.shape[0] * steps / elapsed, 1e3 * cpu / steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("cnn", "mlp", *sim.MODELS), default="cnn",
                   help="sim-*: a simulated accelerator (module docstring)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per rank per step (default: 16 for mlp, else 32)")
    p.add_argument("--image-size", type=int, default=64, help="cnn input resolution")
    p.add_argument("--width", type=int, default=2048, help="mlp layer width")
    p.add_argument("--depth", type=int, default=6, help="mlp layers")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--iters", type=int, default=4, help="timed rounds per variant")
    p.add_argument("--variants", default="mpiddp,ddp,single",
                   help="comma-separated: mpiddp, overlap (mpiddp with overlap_forward=True), "
                        "auto (overlap_forward='auto': its trial takes 24 steps; give as many "
                        "warm-up steps to time its choice), "
                        "native (mpiddp, every reduction by the MPI library's "
                        "MPI_Allreduce), ddp (torch DDP over gloo), single (one process, the "
                        "scaling baseline), zero1 / zero2 (DistributedOptimizer(zero_stage=1|2)"
                        "; zero3: the stage-3 preview"
                        "; overlap-zero1 / overlap-zero2 with overlap_forward=True; "
                        "-hybrid: hybrid_shard=True; each with "
                        "-atstep: optimizer.synchronize() after backward, which keeps every "
                        "shard's step at step()); ddp-zero (DDP with torch's "
                        "ZeroRedundancyOptimizer); fsdp2 (FSDP2 fully_shard over gloo with "
                        "reshard_after_forward=True, ZeRO-3 style, per block of the model "
                        "then the root; not with --compression or --device cuda); "
                        "fp16 (mpiddp with Compression.fp16); "
                        "psgd<r> (mpiddp with Compression.powersgd(rank=r); overlap-psgd<r> "
                        "with overlap_forward=True) and ddp-psgd<r> "
                        "(DDP with torch's powerSGD_hook at rank r), both from "
                        "--powersgd-start on; "
                        "mpiddp:MB / overlap:MB / ddp:MB set the bucket size of "
                        "that variant (e.g. mpiddp:0,mpiddp:1000,ddp,ddp:1000)")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="psgd<r> / ddp-psgd<r>: plain averaging for this many steps first "
                        "(start_step, start_powerSGD_iter)")
    p.add_argument("--overlap-forward", action="store_true",
                   help="every mpiddp variant with DistributedOptimizer(overlap_forward=True)"
                        " (refused if the installed mpiddp lacks it)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where cnn and mlp train (cuda: local rank k on GPU k %% GPUs)")
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
    s = p.add_argument_group("simulated accelerators (sim-* models): the one-process step")
    timing = s.add_mutually_exclusive_group()
    timing.add_argument("--step-time", type=float, default=None,
                        help="seconds per step (forward, backward, optimizer) in one "
                             "process; default 0.2 unless --regime or --device-profile")
    timing.add_argument("--regime", choices=sorted(REGIMES), default=None,
                        help="the step against the estimated wire time of the gradients at "
                             "--link-gbit: balanced (1x), compute (2x: compute-bound), "
                             "wire (0.5x: wire-bound)")
    timing.add_argument("--device-profile", choices=sorted(sim.PROFILES), default=None,
                        help="the step a GPU takes (its measured ResNet-50 throughput, scaled "
                             "by MACs; sources in scripts/bench/simulated_models.py)")
    s.add_argument("--straggler", type=float, default=1.0, metavar="FACTOR",
                   help="the last node's ranks compute FACTOR times slower (e.g. 1.2: a node "
                        "20%% slower); the one-process baseline keeps the nominal step")
    s.add_argument("--param-scale", type=float, default=1.0,
                   help="shrink every parameter tensor's first dimension by this factor "
                        "(fewer bytes to reduce, for quick tests); the timing stays the "
                        "real model's")
    # Whether this rank is on the straggling node: main() decides once it knows the ranks.
    p.set_defaults(is_straggler=False)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 16 if args.model == "mlp" else 32
    simulated = args.model in sim.MODELS
    if not simulated and (args.step_time or args.regime or args.device_profile
                          or args.param_scale != 1.0):
        p.error("--step-time, --regime, --device-profile and --param-scale are for the sim-* "
                "models")
    if args.device == "cuda" and (simulated or not torch.cuda.is_available()):
        p.error("--device cuda: for cnn and mlp, on a machine where torch.cuda works")
    if args.regime and not args.link_gbit:
        p.error("--regime needs --link-gbit: the step is set against the wire time")
    if args.step_time is not None and args.step_time <= 0:
        p.error("--step-time must be positive")
    if not 0 < args.param_scale <= 1:
        p.error("--param-scale must be in (0, 1]")
    return args


def wire_seconds(args, params: int, nodes: int) -> float:
    """Time each node's link needs for one step's gradients: a ring or hierarchical
    all-reduce across ``nodes`` nodes carries 2 (n - 1) / n of the gradient bytes each way."""
    wire_bytes = params * (4 if args.compression == "none" else 2) * 2 * (nodes - 1) / nodes
    return wire_bytes / (args.link_gbit * 1e9 / 8)


def configure_simulation(args, nodes: int) -> str:
    """Set ``args.sim_step_s`` (one process's step), ``args.sim_optimizer_s`` and
    ``args.sim_seconds_per_param`` for a sim-* model; return how the step was chosen."""
    specs = sim.MODELS[args.model]()
    profile = sim.PROFILES.get(args.device_profile)
    memory = profile.memory_gb_per_s if profile else sim.PROFILES["v100-amp"].memory_gb_per_s
    args.sim_seconds_per_param = sim.optimizer_seconds_per_param(memory)
    args.sim_optimizer_s = sim.param_count(specs) * args.sim_seconds_per_param
    if profile:
        args.sim_step_s = sim.profile_step_time(profile, specs, args.batch_size)
        estimated = "" if args.model == "sim-resnet50" else (
            ", this model estimated from ResNet-50's rate by MACs")
        how = (f"device profile {profile.name}: ResNet-50 at "
               f"{profile.resnet50_images_per_s:g} images/s{estimated} (source: "
               f"{profile.source})")
    elif args.regime:
        wire_nodes = max(nodes, 2)
        wire = wire_seconds(args, sim.param_count(specs, args.param_scale), wire_nodes)
        args.sim_step_s = REGIMES[args.regime] * wire
        how = (f"regime {args.regime}: {REGIMES[args.regime]:g} x the wire time "
               f"{wire:.3f} s of the gradients over {wire_nodes} nodes at "
               f"{args.link_gbit:g} Gbit/s" + (" (this job is on one node: 2 assumed)"
                                               if nodes < 2 else ""))
    else:
        args.sim_step_s = args.step_time or 0.2
        how = "--step-time" if args.step_time else "the default --step-time"
    if args.sim_optimizer_s >= args.sim_step_s / 2:
        raise SystemExit(f"a {args.sim_step_s:.4f} s step is too short for {args.model}: its "
                         f"optimizer step alone takes {args.sim_optimizer_s:.4f} s")
    return how


def report_bound(args, result: dict, names: list, nodes: int, params: int) -> None:
    """Step time of each variant against max(one-process step, wire time): with perfect
    overlap a step costs its compute or its traffic, whichever is longer (``wire_seconds``,
    at ``--link-gbit``)."""
    wire = wire_seconds(args, params, max(nodes, 1))
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


def powersgd_rank(kind: str) -> int:
    """``psgd<r>`` / ``overlap-psgd<r>`` / ``ddp-psgd<r>``: PowerSGD at rank r (0: not
    PowerSGD)."""
    match = re.fullmatch(r"(?:ddp-|overlap-)?psgd(\d+)", kind)
    return int(match.group(1)) if match else 0


def torch_peer(name: str) -> bool:
    """A torch variant over gloo (DDP in its forms, FSDP2): the denominators of the ratios."""
    kind = name.split(":")[0]
    return kind.startswith("ddp") or kind == "fsdp2"


def peer(name: str) -> bool:
    """A denominator of the ratios: a torch variant over gloo, or Horovod."""
    return torch_peer(name) or name == "horovod"


def base_kind(kind: str) -> str:
    """A variant's kind without ``-hybrid`` (a sharded one with hybrid_shard=True)."""
    return kind.removesuffix("-hybrid") if "zero" in kind else kind


def uses_mpiddp(name: str) -> bool:
    kind = base_kind(name.split(":")[0])
    return kind in MPIDDP_KINDS or kind == "fp16" or (powersgd_rank(kind) > 0
                                                      and not kind.startswith("ddp"))


# The mpiddp variants: the standard path, forward overlap (fixed, or auto), every reduction
# by MPI_Allreduce, and sharded (zero1, zero2: DistributedOptimizer(zero_stage=1|2); with
# overlap-: the parameter gathers ride the next forward; zero3: the stage-3 preview).
MPIDDP_KINDS = ("mpiddp", "overlap", "auto", "native", "zero1", "zero2", "zero3",
                "overlap-zero1", "overlap-zero2", "zero1-atstep", "zero2-atstep", "overlap-zero1-atstep",
                "overlap-zero2-atstep")


def select_algorithm(name: str) -> None:
    """The 'native' variant: the standard path with every reduction through the MPI
    library's MPI_Allreduce (the engine's native algorithm); the others: the automatic
    choice. Collective; the engine starts from the settings at every init."""
    if uses_mpiddp(name):
        mpiddp.set_allreduce_algorithm("native" if name.startswith("native") else "auto")


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names
               if base_kind(n.split(":")[0]) not in (*MPIDDP_KINDS, "fp16", "ddp", "ddp-zero", "fsdp2",
                                          "horovod", "single")
               and not powersgd_rank(n.split(":")[0]) or n.startswith(("fsdp2:", "horovod:"))]
    if unknown or len(set(names)) != len(names):
        raise SystemExit(f"bad --variants {args.variants!r}: use mpiddp[:MB], overlap[:MB], "
                         "auto[:MB], native[:MB], zero1[:MB], zero2[:MB], overlap-zero1[:MB], "
                         "overlap-zero2[:MB] (each zero one also with -atstep, or -hybrid), fp16[:MB], "
                         "psgd<r>[:MB], overlap-psgd<r>[:MB], ddp[:MB], ddp-zero[:MB], "
                         "ddp-psgd<r>[:MB], fsdp2, horovod, single")
    if "horovod" in names and importlib.util.find_spec("horovod") is None:
        raise SystemExit("the horovod variant: this Python has no Horovod; run from a venv "
                         "that has it built against the same torch and MPI "
                         "(scripts/horovod/build_horovod.sh)")
    if (args.overlap_forward or any(n.startswith(("overlap", "auto")) for n in names)) \
            and not supports_overlap_forward():
        raise SystemExit(f"--overlap-forward / the overlap variant: the installed mpiddp "
                         f"({os.path.dirname(mpiddp.__file__)}) has no "
                         "DistributedOptimizer(overlap_forward=...); use a version with "
                         "forward overlap or leave them out")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_size, local_rank = node.Get_size(), node.Get_rank()
    node.Free()
    if args.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    nodes = size // local_size
    simulation = configure_simulation(args, nodes) if args.model in sim.MODELS else None
    # Ranks sit on their nodes in blocks (mpiexec -ppn, srun's default): the last node's.
    args.is_straggler = args.straggler != 1.0 and rank // local_size == (size - 1) // local_size
    if args.compression == "bf16" and not torch.cuda.is_available():
        # torch's bf16_compress_hook refuses anything but NCCL/XCCL: nothing to compare with.
        if rank == 0 and any(n.startswith("ddp") for n in names):
            print("ddp left out: its bf16_compress_hook needs CUDA and NCCL (or XPU)",
                  flush=True)
        names = [n for n in names if not n.startswith("ddp")]
    if "fsdp2" in names and (args.compression != "none" or args.device == "cuda"):
        # FSDP2's counterpart of compression (MixedPrecisionPolicy(reduce_dtype=...)) and
        # FSDP2 over gloo with CUDA tensors are not tried here: no like-for-like peer.
        if rank == 0:
            print("fsdp2 left out: not set up for --compression or --device cuda",
                  flush=True)
        names.remove("fsdp2")
    if "horovod" in names and (args.compression == "bf16" or args.device == "cuda"):
        if rank == 0:   # Horovod has no bf16 compressor; its CUDA build is not the one here
            print("horovod left out: not set up for bf16 or --device cuda", flush=True)
        names.remove("horovod")
    if not names:
        raise SystemExit("no variant left to run")

    # mpiddp runs only during its own rounds (init ... shutdown), so that its idle engine
    # (a heartbeat cycle every MPIDDP_CYCLE_TIME ms) costs the other variants nothing.
    variants = {}
    for name in names:
        kind, _, cap = name.partition(":")
        if torch_peer(kind):
            import torch.distributed as dist
            if not dist.is_initialized():
                init_torch_distributed(local_size == size)
            if kind == "fsdp2":
                variants[name] = make_fsdp2(args, name)
            elif kind == "ddp-zero":
                variants[name] = make_ddp_zero(args, float(cap or args.ddp_bucket_mb), name)
            else:
                variants[name] = make_ddp(args, float(cap or args.ddp_bucket_mb), name,
                                          powersgd_rank=powersgd_rank(kind))
        elif kind == "single":
            variants[name] = make_single(args)
        elif kind == "horovod":
            variants[name] = make_horovod(args, name)
            horovod_running(False)      # its background thread only in its own steps
        else:
            mpiddp.init()
            compression = mpiddp.Compression.fp16 if kind == "fp16" else \
                mpiddp.Compression.powersgd(rank=powersgd_rank(kind),
                                            start_step=args.powersgd_start) \
                if powersgd_rank(kind) else None
            variants[name] = make_mpiddp(args, float(cap or args.bucket_cap_mb), name,
                                         compression=compression,
                                         overlap="auto" if kind == "auto" else
                                         kind.startswith("overlap") or args.overlap_forward,
                                         zero_stage=int(kind.split("zero")[1][0])
                                         if "zero" in kind else 0,
                                         at_step=base_kind(kind).endswith("-atstep"),
                                         hybrid=kind != base_kind(kind))
    params = sum(p.numel() for p in next(iter(variants.values())).model.parameters())
    if rank == 0:
        if simulation:
            print(f"SIMULATED accelerator ({sim.DESCRIPTIONS[args.model]}; "
                  f"{len(sim.MODELS[args.model]())} layers): one-process step "
                  f"{args.sim_step_s:.4f} s of device time (optimizer step "
                  f"{1e3 * args.sim_optimizer_s:.2f} ms) from {simulation}; no PCIe copies, "
                  "device memory traffic or kernel launches (docs/benchmarks.md)"
                  + (f"; parameters scaled by {args.param_scale:g}"
                     if args.param_scale != 1 else "")
                  + (f"; STRAGGLER: the last node's ranks compute {args.straggler:g}x slower"
                     if args.straggler != 1 else ""), flush=True)
        described = {"cnn": f" (ResNet-18, {args.image_size}x{args.image_size} images)",
                     "mlp": f" ({args.depth}x{args.width}x{args.width})"}
        print(f"model {args.model}" + described.get(args.model, "")
              + (f" on {torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU(s) "
                 "on the node)" if args.device == "cuda" else "")
              + f": {params / 1e6:.1f} M parameters, {params * 4 / 1e6:.0f} MB of gradients; "
              f"batch {args.batch_size} per rank; {size} rank(s), {threads} thread(s) each; "
              f"{args.iters} interleaved rounds of {args.steps} steps after {args.warmup} "
              "warm-up steps"
              + ("; forward overlap on every mpiddp variant (--overlap-forward)"
                 if args.overlap_forward else ""), flush=True)

    # Horovod warms up last, alone: its busy MPI waits beside an idle mpiddp engine (8 ranks
    # on 2 cores) kept the engine's peer checks from answering in time. As mpiddp, it runs
    # only in its own steps.
    for name, variant in sorted(variants.items(), key=lambda item: item[0] == "horovod"):
        if name == "horovod":
            mpiddp.shutdown()
            horovod_running(True)
        if name != "single" or rank == 0:
            select_algorithm(name)
            for _ in range(args.warmup):
                variant.step()
            variant.finish()
    mpiddp.shutdown()
    if "horovod" in names:
        horovod_running(False)
    stats = {}
    rates = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for it in range(args.iters):
        order = names[it % len(names):] + names[:it % len(names)]   # rotate: no position bias
        for name in order:
            if uses_mpiddp(name):
                mpiddp.init()
                select_algorithm(name)
                mpiddp.reset_engine_stats()
            if name == "horovod":
                horovod_running(True)
            rate, cpu_ms = time_round(variants[name], args.steps, rank)
            if name == "horovod":
                horovod_running(False)
            rates[name].append(rate)
            cpu[name].append(cpu_ms)
            if uses_mpiddp(name):
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
              "device": args.device,
              "iters": args.iters, "steps": args.steps,
              "overlap_forward": args.overlap_forward, "bucket_cap_mb": args.bucket_cap_mb,
              "ddp_bucket_mb": args.ddp_bucket_mb, "variants": {}}
    if simulation:
        result["simulation"] = {"step_s": args.sim_step_s, "optimizer_s": args.sim_optimizer_s,
                                "chosen_by": simulation, "param_scale": args.param_scale,
                                "straggler": args.straggler}
    width = max(8, *(len(n) for n in names))
    # CPU: the whole process (all threads) per step, the mean over ranks.
    print(f"\n{'variant':{width}s} {'step s':>7s} {'samples/s per rank':>19s} {'total':>8s} "
          f"{'efficiency':>11s} {'CPU ms/step/rank':>17s}")
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
        step_s = args.batch_size * ranks_here / total
        result["variants"][name] = {"total": total, "per_rank": total / ranks_here,
                                    "step_s": step_s, "rounds": totals,
                                    "efficiency": efficiency, "cpu_ms_per_step": cpu_ms}
        print(f"{name:{width}s} {step_s:7.3f} {total / ranks_here:19.1f} {total:8.1f} "
              f"{'-' if efficiency is None else f'{efficiency:.2f}':>11s} {cpu_ms:17.1f}"
              f"   (rounds: {', '.join(f'{t:.1f}' for t in totals)})")
    print()
    result["ratios"] = {}
    for a in (n for n in names if uses_mpiddp(n)):
        for b in (n for n in names if peer(n)):
            va, vb = result["variants"][a], result["variants"][b]
            ratio = va["total"] / vb["total"]
            per_round = [x / y for x, y in zip(va["rounds"], vb["rounds"])]
            result["ratios"][f"{a} / {b}"] = ratio
            how = "" if b == "horovod" else " (gloo)"
            print(f"{a} / {b}{how} throughput: {ratio:.2f}x (ratio of medians; per round "
                  f"{', '.join(f'{x:.2f}' for x in per_round)})")
    if args.link_gbit and single:
        report_bound(args, result, names, nodes, params)
    steps = args.steps + 1
    for name, st in stats.items():
        print(f"{name} engine on rank 0, last round, per step: {st['cycles'] / steps:.0f} "
              f"cycles, {st['allreduce_batches'] / steps:.0f} reductions "
              f"({st['fused_batches'] / steps:.0f} fused), "
              f"{st['allreduce_bytes'] / steps / 1e6:.0f} MB; by algorithm: " +
              ", ".join(f"{algorithm} {st[f'{algorithm}_batches'] / steps:.0f}"
                        for algorithm in ALGORITHMS if st.get(f"{algorithm}_batches")))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
