"""The cost model of a data-parallel training step (docs/scaling.md): checked against the
emulated cluster's measurements, then extrapolated to hundreds of nodes.

    python scripts/scaling_model.py validate scaling-results/    # model against measured
    python scripts/scaling_model.py extrapolate                  # 64-512 nodes, 10-100 Gbit/s

The all-reduce of each fused buffer costs what ``mpiddp.collectives.cost_model`` says for the
algorithm the engine picks (the MPI library's below an N- and link-dependent threshold,
halving-doubling or the ring above), plus a negotiation cycle (a small all-reduce). The step is an
event simulation of one rank, as the engine runs it: backward produces the gradients layer by
layer in reverse (the simulated models' per-layer MACs), a bucket is reduced once its last
gradient is ready, one reduction at a time, in order; the standard path starts the next
forward when every reduction is done, forward overlap starts it at once and lets layer j's
forward wait only for its own parameters. The period of the steady state is the step time.
Efficiency is the one-process step over that.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import simulated_models as sim  # noqa: E402
from mpiddp.collectives.algorithms import AlgorithmChoice  # noqa: E402
from mpiddp.collectives.cost_model import (LinkCosts, halving_doubling_seconds,  # noqa: E402
                                           native_seconds, ring_seconds)
from mpiddp.collectives.topology import Topology  # noqa: E402

NEGOTIATION_BYTES = 3 * 128 + 16     # a cached cycle's bit vectors and flags (engine.md)


@dataclass(frozen=True)
class Job:
    """What the model needs to know about one training job."""

    layers: list            # simulated_models.LayerSpec, forward order
    param_scale: float
    step_s: float           # one process's forward + backward
    nodes: int
    link: LinkCosts
    bucket_bytes: int = 4 << 20          # DistributedOptimizer(bucket_cap_mb=4)
    fusion_bytes: int = 1 << 20          # MPIDDP_FUSION_THRESHOLD
    step_overhead_s: float | None = None  # the ring's Python cost per step (None: default)
    optimizer_s: float = 0.0

    def cycle_s(self, buffers: list[int], algorithm: str = "auto") -> float:
        """One engine cycle: the negotiation (a small all-reduce), then each fused buffer's
        all-reduce as the engine's ``AlgorithmChoice`` picks it with one rank per node and
        measured links (or every one by ``native``), charged at this job's step overhead."""
        extra = {} if self.step_overhead_s is None else {"step_overhead_s": self.step_overhead_s}
        choice = AlgorithmChoice(algorithm, None, "0",
                                 Topology(0, self.nodes, 0, 1, 0, self.nodes, True), self.link,
                                 **extra)
        cost = {"native": lambda n: native_seconds(n, self.nodes, self.link),
                "ring": lambda n: ring_seconds(n, self.nodes, self.link, **extra),
                "halving_doubling":
                    lambda n: halving_doubling_seconds(n, self.nodes, self.link, **extra)}
        seconds = native_seconds(NEGOTIATION_BYTES, self.nodes, self.link)
        for nbytes in buffers:
            seconds += cost[choice.choose(nbytes).name](nbytes)
        return seconds


def layer_times(job: Job) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of every layer (forward order), from its MACs."""
    total = sim.train_macs(job.layers)
    forward = [job.step_s * layer.macs / total for layer in job.layers]
    backward = [2 * f for f in forward]
    backward[0] -= forward[0]            # the first layer computes no input gradient
    return forward, backward


def fused_buffers(tensor_bytes: list[int], fusion_bytes: int) -> list[int]:
    """The engine's fused buffers for one cycle's tensors: a tensor above the fusion threshold
    alone, the others packed up to it (engine/fusion.py)."""
    out, packed = [], 0
    for nbytes in tensor_bytes:
        if nbytes > fusion_bytes:
            out.append(nbytes)
        elif packed + nbytes > fusion_bytes:
            out.append(packed)
            packed = nbytes
        else:
            packed += nbytes
    return out + ([packed] if packed else [])


def buckets(job: Job) -> list[tuple[list[int], list[int]]]:
    """(fused buffer sizes, layer indices) per submission, in the order backward fills them
    (reverse): DistributedOptimizer submits once ``bucket_bytes`` are ready."""
    out, members, sizes = [], [], []
    for index in reversed(range(len(job.layers))):
        layer = job.layers[index]
        members.append(index)
        sizes += [4 * sim.param_count([sim.LayerSpec(layer.name, (param,), 0.0)],
                                      job.param_scale) for param in layer.params]
        if sum(sizes) >= job.bucket_bytes:
            out.append((fused_buffers(sizes, job.fusion_bytes), members))
            members, sizes = [], []
    if members:
        out.append((fused_buffers(sizes, job.fusion_bytes), members))
    return out


def step_seconds(job: Job, overlap: bool, algorithm: str = "auto", steps: int = 8) -> float:
    """The steady-state step time of the event simulation (see the module docstring)."""
    forward, backward = layer_times(job)
    # Forward overlap submits every layer on its own, urgent (first) layers first; the
    # standard path submits buckets and the engine takes them in order.
    plan = buckets(job) if not overlap else [
        (fused_buffers([4 * sim.param_count([sim.LayerSpec(layer.name, (param,), 0.0)],
                                            job.param_scale) for param in layer.params],
                       job.fusion_bytes), [i])
        for i, layer in reversed(list(enumerate(job.layers)))]
    bucket_of = {i: b for b, (_, members) in enumerate(plan) for i in members}
    everything = total_bytes(plan)
    comm_free = 0.0                      # when the engine can start the next reduction
    updated = [0.0] * len(plan)          # when each submission's reduction (and update) ended
    starts = []
    start = 0.0
    for _ in range(steps):
        starts.append(start)
        t = start
        for i, f in enumerate(forward):  # layer i waits for its own parameters' update
            t = max(t, updated[bucket_of[i]]) + f
        ready = {}
        for i in reversed(range(len(backward))):
            t += backward[i]
            ready[i] = t
        compute_end = t
        pending = {b: max(ready[i] for i in members) for b, (_, members) in enumerate(plan)}
        while pending:
            now = max(comm_free, min(pending.values()))
            candidates = [b for b, at in pending.items() if at <= now]
            # urgency: the submission holding the earliest layer (forward overlap's order)
            b = min(candidates, key=lambda c: min(plan[c][1])) if overlap else min(candidates)
            del pending[b]
            comm_free = now + job.cycle_s(plan[b][0], algorithm)
            updated[b] = comm_free + job.optimizer_s * sum(plan[b][0]) / everything
        start = compute_end if overlap else max(compute_end, comm_free + job.optimizer_s)
    return (starts[-1] - starts[len(starts) // 2]) / (len(starts) - 1 - len(starts) // 2)


def total_bytes(plan) -> int:
    return max(1, sum(sum(buffers) for buffers, _ in plan))


# ---- validate: the model against the emulated cluster --------------------------------------
RESULT = re.compile(r"(?P<setting>light|heavy)-(?P<model>sim-[a-z0-9]+)-(?P<regime>\w+)-"
                    r"(?P<nodes>\d+)x1\.json$")
SETTINGS = {"light": 0.2, "heavy": 1.0}          # link Gbit/s of scripts/scaling_benchmark.sh


def validate(directory: str, latency_us: float, step_overhead_us: float) -> None:
    rows, errors = [], []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        match = RESULT.search(os.path.basename(path))
        if not match:
            continue
        with open(path) as f:
            result = json.load(f)
        nodes = int(match["nodes"])
        job = Job(sim.MODELS[match["model"]](), result["simulation"]["param_scale"],
                  result["simulation"]["step_s"], nodes,
                  LinkCosts.from_rate(SETTINGS[match["setting"]], latency_us),
                  bucket_bytes=int(result.get("bucket_cap_mb", 4.0) * 2 ** 20),
                  step_overhead_s=step_overhead_us * 1e-6,
                  optimizer_s=result["simulation"]["optimizer_s"])
        for variant, overlap, algorithm in (("mpiddp", False, "auto"), ("overlap", True, "auto"),
                                            ("native", False, "native")):
            measured = result["variants"].get(variant)
            if not measured:
                continue
            predicted = step_seconds(job, overlap, algorithm)
            error = predicted / measured["step_s"] - 1
            errors.append((match["setting"], abs(error)))
            rows.append(f"| {match['setting']} | {match['regime']} | {nodes} | {variant} | "
                        f"{measured['step_s']:.3f} | {predicted:.3f} | {100 * error:+.0f}% |")
    print("| setting | regime | nodes | variant | measured step (s) | model (s) | error |")
    print("|---|---|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    for setting in SETTINGS:
        mine = [e for s, e in errors if s == setting]
        if mine:
            within = sum(e <= 0.15 for e in mine)
            print(f"\n{setting}: mean |error| {100 * sum(mine) / len(mine):.0f}%, "
                  f"{within} of {len(mine)} within 15%")


# ---- extrapolate: hundreds of nodes --------------------------------------------------------
MODELS = (("ResNet-50", "sim-resnet50", 64), ("VGG-16", "sim-vgg16", 64),
          ("BERT-base", "sim-bert", 32))
# Horovod's paper (Sergeev & Del Balso, 2018), 512 GPUs (128 servers x 4 P100, 25 Gbit/s
# RoCE): scaling efficiency as reported there.
HOROVOD_512 = {"ResNet-101": 0.90, "Inception V3": 0.90, "VGG-16": 0.68}


def extrapolate(profile_name: str, latency_us: float, reduce_gb_per_s: float | None) -> None:
    profile = sim.PROFILES[profile_name]
    where = (f"reductions on the host at {reduce_gb_per_s:g} GB/s (NumPy; the staged path)"
             if reduce_gb_per_s else "reductions on the device (CUDA-aware MPI; no host cost)")
    print(f"One GPU per node at {profile.name} ({profile.resnet50_images_per_s:g} ResNet-50 "
          f"images/s; other models by MACs), link latency {latency_us:g} us, {where}, 4 MiB "
          "buckets; efficiency = one GPU's step / the step at N nodes (std: standard path; "
          "fo: forward overlap).\n")
    rates = (10, 25, 100)
    print("| model | batch/GPU | step (s) | gradients (MB) | nodes | "
          + " | ".join(f"{r} Gbit/s std | fo" for r in rates) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(rates))
    for label, key, batch in MODELS:
        layers = sim.MODELS[key]()
        step = sim.profile_step_time(profile, layers, batch)
        mbytes = 4 * sim.param_count(layers) / 1e6
        for nodes in (2, 16, 64, 128, 256, 512):
            cells = []
            for rate in rates:
                link = LinkCosts.from_rate(rate, latency_us, reduce_gb_per_s)
                job = Job(layers, 1.0, step, nodes, link)
                for overlap in (False, True):
                    cells.append(f"{100 * step / step_seconds(job, overlap):.0f}%")
            print(f"| {label} | {batch} | {step:.3f} | {mbytes:.0f} | {nodes} | "
                  + " | ".join(cells) + " |")
    print("\nHorovod at 512 GPUs, 25 Gbit/s RoCE: " + ", ".join(
        f"{k} {100 * v:.0f}%" for k, v in HOROVOD_512.items()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="the model against scripts/scaling_benchmark.sh's JSON")
    v.add_argument("directory")
    v.add_argument("--latency-us", type=float, default=100.0,
                   help="the emulated links' latency (the engine logs what it measures)")
    v.add_argument("--step-overhead-us", type=float, default=50.0,
                   help="the ring's cost per step in Python and MPI")
    e = sub.add_parser("extrapolate", help="64-512 nodes at 10, 25 and 100 Gbit/s")
    e.add_argument("--profile", default="v100-fp32", choices=sorted(sim.PROFILES))
    e.add_argument("--latency-us", type=float, default=5.0)
    e.add_argument("--reduce-gb-per-s", type=float, default=None,
                   help="host reduction rate (GB/s of buffer; NumPy here: about 7); default: "
                        "reductions on the device")
    args = p.parse_args(argv)
    if args.command == "validate":
        validate(args.directory, args.latency_us, args.step_overhead_us)
    else:
        extrapolate(args.profile, args.latency_us, args.reduce_gb_per_s)


if __name__ == "__main__":
    main()
