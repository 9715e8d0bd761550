"""The cost model of a data-parallel training step (docs/scaling.md): checked against the
emulated cluster's measurements, then extrapolated to hundreds of nodes.

    python scripts/bench/scaling_model.py validate scaling-results/  # model against measured
    python scripts/bench/scaling_model.py validate-nodes results/    # several ranks per node
    python scripts/bench/scaling_model.py extrapolate                # 64-512 nodes, 10-100 Gbit/s
    python scripts/bench/scaling_model.py horovod                    # Horovod's paper's setup
    python scripts/bench/scaling_model.py predict --step-s 0.2 --gbit 100 --gpus-per-node 8  # yours

The all-reduce of each fused buffer costs what ``mpiddp.collectives.cost_model`` says for the
algorithm the engine picks (the MPI library's below an N- and link-dependent threshold,
halving-doubling or the ring above); each engine cycle adds its own work and a negotiation (a
small all-reduce). The step is an event simulation of one rank, as the engine runs it:
backward produces the gradients layer by layer in reverse (the simulated models' per-layer
MACs), a bucket is submitted once its last gradient is ready, and each cycle takes what is
ready when the previous one ends (the standard path all of it, in order; forward overlap the
earliest layers first, up to its cycle budget); the standard path starts the next forward
when every reduction is done, forward overlap starts it at once and lets layer j's forward
wait only for its own parameters. The period of the steady state is the step time.
Efficiency is the one-process step over that.

Where the ranks share a machine's cores (the emulated cluster: 16 ranks on 2 cores), the
ranks run each cycle in lockstep, and those of one core one after another: ``validate`` reads
what one all-reduce costs a rank in CPU from ``scripts/bench/benchmark_allreduce.py``'s run at the
same N and links (``allreduce-<setting>-<N>x1.json`` beside the training results) and adds to
each cycle the CPU the other ranks of a core spend on it (ranks / cores - 1 times a rank's),
and bounds each step by the cores' work for its cycles and for the one-process step's own CPU
(``MachineCpu``, ``cores_bound_s``). The same benchmark
gives the links' latency at each N (its smallest ``MPI_Allreduce``; with many ranks on few
cores, the scheduler's delays are part of it), and ``validate`` also sets the model of each
algorithm against it. ``extrapolate`` leaves the cores out: a GPU node's rank has a core of
its own for its communication.

Several GPUs per node (``--gpus-per-node``) share the node's network interface and talk
over a node-local link: the library's all-reduce and the hierarchical one as
``mpiddp.collectives.cost_model`` models them (each byte across the network once per node),
chosen as the engine's ``AlgorithmChoice`` would with that layout.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import sys
from dataclasses import dataclass, field, replace

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import simulated_models as sim  # noqa: E402
from mpiddp.collectives.algorithms import AlgorithmChoice  # noqa: E402
from mpiddp.collectives.cost_model import (ENGINE_CYCLE_S,  # noqa: E402
                                           HOST_REDUCE_SECONDS_PER_BYTE,
                                           NATIVE_SHORT_BYTES, LinkCosts,
                                           device_priority_cycle_bytes, gradient_cycle_bytes,
                                           halving_doubling_seconds, hierarchical_seconds,
                                           native_seconds, priority_cycle_bytes,
                                           recursive_doubling_seconds,
                                           ring_seconds)
from mpiddp.collectives.topology import Topology  # noqa: E402

NEGOTIATION_BYTES = 3 * 128 + 16     # a cached cycle's bit vectors and flags (docs/dev/engine.md)
CYCLE_PROBE_BYTES = 4 << 20          # torch/gradients/cycle_budget.py's large all-reduce
# scripts/bench/benchmark_allreduce.py's rows for the algorithm the engine picks (recursive
# doubling has no row of its own: ``auto`` takes it for the sizes where the engine would).
BENCHMARK_ROWS = {"ring": "mpiddp ring", "halving_doubling": "mpiddp halving-doubling",
                  "native": "MPI_Allreduce", "recursive_doubling": "mpiddp auto",
                  "hierarchical": "mpiddp hierarchical"}
# The benchmark's rows ``validate`` models, and by which algorithm (``auto``: the engine's
# choice for each size).
MODELLED_ROWS = {"mpiddp ring": "ring", "mpiddp halving-doubling": "halving_doubling",
                 "mpiddp auto": "auto", "MPI_Allreduce": "native"}


def call_waiting_s(row: dict, share: float) -> float:
    """How long one call of the all-reduce benchmark's ``row`` waits for the other ranks of
    a core shared by ``share`` (``MachineCpu.waiting_s`` of the call's measured CPU)."""
    return (share - 1) * row["cpu_s_per_gb"] * row["bytes"] / 1e9


def ranks_per_core(ranks: int, cores: int) -> float:
    """How many ranks share each core (at least 1: a rank never has more than one)."""
    return max(1.0, ranks / cores)


@dataclass(frozen=True)
class MachineCpu:
    """The CPU one all-reduce costs a rank (measured at this N: contention's busy waiting
    included) and how many ranks share each core. Every rank runs the same cycle at once and
    in lockstep: a step of a collective ends only once its partners have run theirs, and the
    ranks sharing a core run one after another, so a cycle takes its time on the links plus
    the CPU the other ``share - 1`` ranks of the core spend on it (``waiting_s``; the rank's
    own CPU is in the links' terms, as the steps' overhead)."""

    seconds_by_row: dict = field(repr=False)   # benchmark row -> (sizes, CPU s per call)
    share: float                               # ranks per core, at least 1
    compute_s: float = 0.0                     # the CPU of one process's step (no reductions)

    @classmethod
    def from_benchmark(cls, rows: list, ranks: int, cores: int,
                       compute_s: float = 0.0) -> "MachineCpu":
        table = {}
        for row in rows:
            table.setdefault(row["method"], []).append(
                (row["bytes"], row["cpu_s_per_gb"] * row["bytes"] / 1e9))
        return cls({method: tuple(np.array(v) for v in zip(*sorted(points)))
                    for method, points in table.items()}, ranks_per_core(ranks, cores), compute_s)

    def waiting_s(self, cpu_s: float) -> float:
        """How long a rank waits for the others of its core to spend ``cpu_s`` each."""
        return (self.share - 1) * cpu_s

    def call_s(self, row: str, nbytes: int) -> float:
        """CPU seconds of one call of ``nbytes`` by the benchmark's ``row``: linear between
        the measured sizes, beyond the largest at its CPU per byte."""
        sizes, seconds = self.seconds_by_row[row]
        if nbytes > sizes[-1]:
            return float(seconds[-1] * nbytes / sizes[-1])
        return float(np.interp(nbytes, sizes, seconds))

    def engine_cpu_s(self) -> float:
        """What the engine's cycle costs beyond the data (its negotiation, the Python around
        it): a small all-reduce through the engine against the same by ``MPI_Allreduce``."""
        smallest = int(self.seconds_by_row["MPI_Allreduce"][0][0])
        return max(0.0, self.call_s("mpiddp auto", smallest)
                   - self.call_s("MPI_Allreduce", smallest))

    def cycle_cpu_s(self, algorithms_and_bytes: list) -> float:
        """The CPU of one cycle: the engine's part once, then each buffer's data (the engine
        rows' calls less the engine's part they include)."""
        engine = self.engine_cpu_s()
        data = sum(self.call_s("MPI_Allreduce", n) if name == "native"
                   else max(0.0, self.call_s(BENCHMARK_ROWS[name], n) - engine)
                   for name, n in algorithms_and_bytes)
        return engine + data


@functools.lru_cache(maxsize=None)      # the simulation asks for the same choice often
def algorithm_choice(algorithm: str, nodes: int, local_size: int, link: LinkCosts,
                     over_sockets: bool, step_overhead: tuple) -> AlgorithmChoice:
    """The engine's ``AlgorithmChoice`` for ``nodes`` nodes of ``local_size`` ranks on measured
    ``link`` (several ranks per node: the hierarchical all-reduce where the engine would take
    it; the engine's sockets serve one rank per node)."""
    return AlgorithmChoice(algorithm, None, "auto" if local_size > 1 else "0",
                           Topology(0, nodes * local_size, 0, local_size, 0, nodes, True), link,
                           over_sockets=over_sockets and local_size == 1, **dict(step_overhead))


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
    machine_cpu: MachineCpu | None = None  # ranks sharing cores (None: a core each, unbounded)
    engine_cycle_s: float = ENGINE_CYCLE_S  # the engine's own work per cycle of many tensors
    # The engine's TCP connections carry the transfers across nodes (the start-up probe kept
    # them: the emulated cluster), and with them the cycle's bit vector and the smallest
    # buffers, by recursive doubling; False: MPI carries them (RDMA networks).
    over_sockets: bool = False
    # GPUs (ranks) per node: a node's ranks share its network interface and talk among
    # themselves over ``local_link`` (NVLink, PCIe; None: as fast as the network).
    local_size: int = 1
    local_link: LinkCosts | None = None
    # Gradients in device memory: forward overlap's cycle budget is then sized from the
    # engine's all-reduce as timed on the job (``torch/gradients/cycle_budget.py``), here as modelled.
    on_device: bool = False

    @property
    def ranks(self) -> int:
        return self.nodes * self.local_size

    def cycle_s(self, buffers: list[int], algorithm: str = "auto") -> float:
        """One engine cycle's seconds (``cycle``)."""
        return self.cycle(buffers, algorithm)[0]

    def cycle_cpu_s(self, buffers: list[int], algorithm: str = "auto") -> float:
        """The CPU one cycle costs a rank (0 where the cores are not modelled)."""
        return self.cycle(buffers, algorithm)[1]

    def cycle(self, buffers: list[int], algorithm: str = "auto") -> tuple[float, float]:
        """(seconds, CPU seconds per rank) of one engine cycle: its own work and the
        negotiation (a small all-reduce: the library's, or recursive doubling over the
        engine's sockets), then each fused buffer's all-reduce as the engine's
        ``AlgorithmChoice`` picks it with one rank per node and measured links (or every one
        by ``native``), charged at this job's step overhead; plus the waiting for the other
        ranks of a shared core (``machine_cpu``; without it, no CPU counted)."""
        extra = self.step_overhead()
        local = self.local_link or self.link
        cost = {"native": lambda n: native_seconds(n, self.ranks, self.link,
                                                   self.local_size, local),
                "ring": lambda n: ring_seconds(n, self.ranks, self.link, **extra),
                "halving_doubling":
                    lambda n: halving_doubling_seconds(n, self.ranks, self.link, **extra),
                "recursive_doubling":
                    lambda n: recursive_doubling_seconds(n, self.ranks, self.link, **extra),
                "hierarchical":
                    lambda n: hierarchical_seconds(n, self.nodes, self.local_size, self.link,
                                                   local, self.choice().cross_ring_threshold,
                                                   **extra)}
        chosen = self.chosen(buffers, algorithm)
        # The engine's sockets (and recursive doubling over them) serve one rank per node.
        negotiation = cost["recursive_doubling" if self.over_sockets and self.local_size == 1
                           else "native"]
        seconds = self.engine_cycle_s + negotiation(NEGOTIATION_BYTES)
        seconds += sum(cost[name](nbytes) for name, nbytes in chosen)
        if self.machine_cpu is None:
            return seconds, 0.0
        cpu = self.machine_cpu.cycle_cpu_s(chosen)
        return seconds + self.machine_cpu.waiting_s(cpu), cpu

    def chosen(self, buffers: list[int], algorithm: str) -> list[tuple[str, int]]:
        """(algorithm name, bytes) of each buffer, as the engine's ``AlgorithmChoice`` picks."""
        choice = self.choice(algorithm)
        return [(choice.choose(nbytes).name, nbytes) for nbytes in buffers]

    def choice(self, algorithm: str = "auto") -> AlgorithmChoice:
        """The engine's ``AlgorithmChoice`` for this job's layout and links."""
        return algorithm_choice(algorithm, self.nodes, self.local_size, self.link,
                                self.over_sockets, tuple(self.step_overhead().items()))

    def cycle_budget(self) -> int:
        """Forward overlap's cycle budget as the engine sizes it: in host memory for the
        step's gradients from the links (``gradient_cycle_bytes``); on a device at least
        what makes a cycle's fixed cost a small share of its transfer
        (``device_priority_cycle_bytes`` of the modelled cycle), and at least the links-only
        budget."""
        if not self.on_device:
            gradients = sum(sum(tensor_bytes(self, layer)) for layer in self.layers)
            return gradient_cycle_bytes(self.nodes, self.link, gradients)
        budget = priority_cycle_bytes(self.nodes, self.link)
        fixed = self.cycle_s([4])
        per_byte = (self.cycle_s([CYCLE_PROBE_BYTES]) - fixed) / CYCLE_PROBE_BYTES
        return max(budget, device_priority_cycle_bytes(fixed, per_byte))

    def step_overhead(self) -> dict:
        return {} if self.step_overhead_s is None else {"step_overhead_s": self.step_overhead_s}


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


def tensor_bytes(job: Job, layer) -> list[int]:
    """The gradient bytes of each of ``layer``'s parameters."""
    return [4 * sim.param_count([sim.LayerSpec(layer.name, (param,), 0.0)], job.param_scale)
            for param in layer.params]


def buckets(job: Job) -> list[tuple[list[int], list[int]]]:
    """(tensor sizes, layer indices) per submission, in the order backward fills them
    (reverse): DistributedOptimizer submits once ``bucket_bytes`` are ready."""
    out, members, sizes = [], [], []
    for index in reversed(range(len(job.layers))):
        members.append(index)
        sizes += tensor_bytes(job, job.layers[index])
        if sum(sizes) >= job.bucket_bytes:
            out.append((sizes, members))
            members, sizes = [], []
    if members:
        out.append((sizes, members))
    return out


def step_seconds(job: Job, overlap: bool, algorithm: str = "auto", steps: int = 8) -> float:
    """The steady-state step time of the event simulation (see the module docstring)."""
    forward, backward = layer_times(job)
    # Forward overlap submits every layer on its own, urgent (first) layers first; the
    # standard path submits buckets and the engine takes them in order.
    plan = buckets(job) if not overlap else [
        (tensor_bytes(job, layer), [i]) for i, layer in reversed(list(enumerate(job.layers)))]
    bucket_of = {i: b for b, (_, members) in enumerate(plan) for i in members}
    budget = job.cycle_budget()
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
        cycles_cpu = 0.0
        pending = {b: max(ready[i] for i in members) for b, (_, members) in enumerate(plan)}
        while pending:
            now = max(comm_free, min(pending.values()))
            taken = cycle_submissions(plan, [b for b, at in pending.items() if at <= now],
                                      overlap, budget)
            # The cycle fuses all its tensors together (engine/fusion.py).
            buffers = fused_buffers([n for b in taken for n in plan[b][0]], job.fusion_bytes)
            seconds, cpu = job.cycle(buffers, algorithm)
            comm_free = now + seconds
            cycles_cpu += cpu
            for b in taken:
                del pending[b]
                updated[b] = comm_free + job.optimizer_s * sum(plan[b][0]) / everything
        start = compute_end if overlap else max(compute_end, comm_free + job.optimizer_s)
        start = max(start, starts[-1] + cores_bound_s(job, overlap, cycles_cpu))
    return (starts[-1] - starts[len(starts) // 2]) / (len(starts) - 1 - len(starts) // 2)


def cores_bound_s(job: Job, overlap: bool, cycles_cpu_s: float) -> float:
    """The shortest step the shared cores allow: they do every rank's CPU for the step's
    cycles and its compute (a third of it in the forward, as the compute's time) wherever
    that runs beside communication; the standard path's forward runs alone (and no faster
    than its wait)."""
    cpu = job.machine_cpu
    if cpu is None:
        return 0.0
    if overlap:
        return cpu.share * (cycles_cpu_s + cpu.compute_s)
    forward = max(job.step_s / 3, cpu.share * cpu.compute_s / 3)
    return forward + cpu.share * (cycles_cpu_s + 2 * cpu.compute_s / 3)


def cycle_submissions(plan, ready: list[int], overlap: bool, budget: int) -> list[int]:
    """What one engine cycle reduces of the ready submissions: the standard path all of them
    (every tensor ready everywhere goes in the cycle); forward overlap the most urgent (the
    earliest layers) up to its cycle budget of bytes, at least one."""
    if not overlap:
        return sorted(ready)
    taken, nbytes = [], 0
    for b in sorted(ready, key=lambda c: min(plan[c][1])):
        if taken and nbytes + sum(plan[b][0]) > budget:
            break
        taken.append(b)
        nbytes += sum(plan[b][0])
    return taken


def total_bytes(plan) -> int:
    return max(1, sum(sum(buffers) for buffers, _ in plan))


# ---- validate: the model against the emulated cluster --------------------------------------
RESULT = re.compile(r"(?P<setting>light|heavy)-(?P<model>sim-[a-z0-9]+)-(?P<regime>\w+)-"
                    r"(?P<nodes>\d+)x(?P<local>\d+)\.json$")
# The node-local link where no 1xG all-reduce was run to fit it from: shared memory on the
# emulated cluster, about as fitted from 1x2 runs of 4 KiB-64 MiB on 2026-11-27 (2.1-2.7
# GB/s; docs/dev/scaling-model.md, "Several GPUs per node").
EMULATED_NODE_LINK = LinkCosts(20e-6, 1 / 2.5e9, HOST_REDUCE_SECONDS_PER_BYTE)
SETTINGS = {"light": 0.2, "heavy": 1.0}          # link Gbit/s of scripts/bench/scaling_benchmark.sh


def allreduce_rows(directory: str, setting: str, nodes: int,
                   local_size: int = 1) -> list | None:
    """The rows of the all-reduce benchmark run at this setting and N x ``local_size`` (None
    if it did not)."""
    path = os.path.join(directory, f"allreduce-{setting}-{nodes}x{local_size}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["rows"]


def measured_latency_s(rows: list | None, gbit_per_s: float, nodes: int,
                       default_us: float | None, share: float = 1.0, local_size: int = 1,
                       local_link: LinkCosts | None = None) -> float:
    """The links' latency at this N as the emulation presents it: ``default_us`` if given,
    else the latency at which the model's ``MPI_Allreduce`` takes the time the all-reduce
    benchmark measured (``rows``) for its smallest size (the model is linear in it), else
    100 us. With ``share`` ranks per core, the time is first cut by the waiting for the other
    ranks of a core (``MachineCpu.waiting_s`` of the call's measured CPU), which the model
    with the cores adds back; with ``share`` 1 the scheduler's delays stay in the latency.
    ``local_size`` ranks per node: the node-local part of the call over ``local_link``;
    ``gbit_per_s``: the links' rate."""
    if default_us is not None or rows is None:
        return (100.0 if default_us is None else default_us) * 1e-6
    smallest = min((row for row in rows if row["method"] == "MPI_Allreduce"),
                   key=lambda row: row["bytes"])
    waiting = call_waiting_s(smallest, share)

    def native(latency_us: float) -> float:
        return native_seconds(smallest["bytes"], nodes * local_size,
                              LinkCosts.from_rate(gbit_per_s, latency_us), local_size,
                              local_link)

    at_zero = native(0.0)
    per_second = native(1e6) - at_zero
    return max(0.0, (smallest["seconds"] - waiting - at_zero) / per_second)


def print_summary(label: str, errors: list[float]) -> None:
    """Mean |error| and how many within 15%, if there are any."""
    if errors:
        print(f"\n{label}: mean |error| {100 * sum(errors) / len(errors):.0f}%, "
              f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15%")


def validate(directory: str, latency_us: float | None, step_overhead_us: float,
             cores: int, over_sockets: bool = True) -> None:
    rows, errors = [], []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        match = RESULT.search(os.path.basename(path))
        if not match:
            continue
        with open(path) as f:
            result = json.load(f)
        nodes, setting, local_size = int(match["nodes"]), match["setting"], int(match["local"])
        benchmark = allreduce_rows(directory, setting, nodes, local_size)
        local = node_local_link(directory, setting, local_size)
        layout = {"local_size": local_size, "local_link": local}
        rate = SETTINGS[setting]
        links_only = Job(sim.MODELS[match["model"]](), result["simulation"]["param_scale"],
                         result["simulation"]["step_s"], nodes,
                         LinkCosts.from_rate(rate, 1e6 * measured_latency_s(
                             benchmark, rate, nodes, latency_us, **layout)),
                         bucket_bytes=int(result.get("bucket_cap_mb", 4.0) * 2 ** 20),
                         step_overhead_s=step_overhead_us * 1e-6,
                         optimizer_s=result["simulation"]["optimizer_s"],
                         over_sockets=over_sockets, **layout)
        single = result["variants"].get("single") or {}
        share = ranks_per_core(links_only.ranks, cores)
        with_cores = None if benchmark is None else replace(
            links_only, machine_cpu=MachineCpu.from_benchmark(
                benchmark, links_only.ranks, cores, single.get("cpu_ms_per_step", 0.0) / 1e3),
            link=LinkCosts.from_rate(rate, 1e6 * measured_latency_s(
                benchmark, rate, nodes, latency_us, share, **layout)))
        for variant, overlap, algorithm in (("mpiddp", False, "auto"), ("overlap", True, "auto"),
                                            ("native", False, "native")):
            measured = result["variants"].get(variant)
            if not measured:
                continue
            cells = []
            for kind, job in (("links", links_only), ("cores", with_cores)):
                if job is None:
                    cells += ["", ""]
                    continue
                predicted = step_seconds(job, overlap, algorithm)
                error = predicted / measured["step_s"] - 1
                errors.append((setting, kind, abs(error)))
                cells += [f"{predicted:.3f}", percent(error)]
            shape = nodes if local_size == 1 else f"{nodes}x{local_size}"
            rows.append(f"| {setting} | {match['regime']} | {shape} | {variant} | "
                        f"{measured['step_s']:.3f} | " + " | ".join(cells) + " |")
    print("| setting | regime | nodes | variant | measured step (s) | model, links (s) | error "
          f"| model, links and {cores} cores (s) | error |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    for setting in SETTINGS:
        for kind in ("links", "cores"):
            print_summary(f"{setting}, model with the {kind}",
                          [e for s, k, e in errors if s == setting and k == kind])


def node_local_link(directory: str, setting: str, local_size: int) -> LinkCosts | None:
    """The link between a node's ranks: fitted from the 1x``local_size`` all-reduce run where
    there is one, else the emulated cluster's (None for one rank per node)."""
    if local_size == 1:
        return None
    try:
        return fit_local_link(allreduce_rows(directory, setting, 1, local_size) or [],
                              local_size)
    except ValueError:
        return EMULATED_NODE_LINK


ALLREDUCE_RESULT = re.compile(r"allreduce-(?P<setting>light|heavy)-(?P<nodes>\d+)x1\.json$")


def allreduce_model_s(method: str, nbytes: int, nodes: int, link: LinkCosts,
                      step_overhead_s: float, over_sockets: bool = True) -> float:
    """One all-reduce as ``scripts/bench/benchmark_allreduce.py`` times it: through the engine (a
    cycle of its own per call: the negotiation; the engine's own work for one tensor and the
    hand-offs between threads left out) by one algorithm, or ``MPI_Allreduce`` called
    directly."""
    if method == "MPI_Allreduce":
        return native_seconds(nbytes, nodes, link)
    algorithm = MODELLED_ROWS[method]
    job = Job([], 1.0, 0.0, nodes, link, step_overhead_s=step_overhead_s, engine_cycle_s=0.0,
              over_sockets=over_sockets)
    return job.cycle_s([nbytes], algorithm)


def validate_allreduce(directory: str, latency_us: float | None, step_overhead_us: float,
                       cores: int, over_sockets: bool = True) -> None:
    """The alpha-beta model of each algorithm against the all-reduce benchmark at each N: on
    the links alone, and with the waiting for the other ranks of a shared core given the CPU
    the call was measured to cost (a consistency check, that CPU being the same run's)."""
    table, errors, sizes = {}, [], set()
    for path in sorted(glob.glob(os.path.join(directory, "allreduce-*.json"))):
        match = ALLREDUCE_RESULT.search(os.path.basename(path))
        if not match:
            continue
        with open(path) as f:
            rows = json.load(f)["rows"]
        nodes, setting = int(match["nodes"]), match["setting"]
        share = ranks_per_core(nodes, cores)
        rate = SETTINGS[setting]
        link, shared_link = (LinkCosts.from_rate(rate, 1e6 * measured_latency_s(
            rows, rate, nodes, latency_us, s)) for s in (1.0, share))
        for row in rows:
            method = row["method"]
            if method not in MODELLED_ROWS or (
                    MODELLED_ROWS[method] == "halving_doubling" and nodes < 4):
                continue
            links, with_cores = (allreduce_model_s(method, row["bytes"], nodes, costs,
                                                   step_overhead_us * 1e-6, over_sockets)
                                 for costs in (link, shared_link))
            with_cores += call_waiting_s(row, share)
            cell = []
            for kind, predicted in (("links", links), ("cores", with_cores)):
                error = predicted / row["seconds"] - 1
                errors.append((setting, kind, row["bytes"] >= 1 << 20, abs(error)))
                cell.append(percent(error))
            sizes.add(row["bytes"])
            table.setdefault((setting, nodes, method), {})[row["bytes"]] = " / ".join(cell)
    if not table:
        return
    sizes = sorted(sizes)
    print("\nAll-reduce, model / measured - 1 (links alone / with the shared cores):\n")
    print("| setting | nodes | method | " + " | ".join(human_bytes(n) for n in sizes) + " |")
    print("|---|---:|---|" + "---:|" * len(sizes))
    for (setting, nodes, method), cells in sorted(table.items()):
        print(f"| {setting} | {nodes} | {method} | "
              + " | ".join(cells.get(n, "") for n in sizes) + " |")
    for setting in SETTINGS:
        for kind in ("links", "cores"):
            for large in (False, True):
                print_summary(f"{setting}, all-reduce {'from' if large else 'below'} 1 MiB, "
                              f"model with the {kind}",
                              [e for s, k, big, e in errors
                               if (s, k, big) == (setting, kind, large)])


# ---- validate-nodes: several ranks per node ------------------------------------------------
NODES_RESULT = re.compile(r"allreduce-(?P<setting>[\w.-]+)-(?P<nodes>\d+)x(?P<local>\d+)"
                          r"\.json$")
# The rows modelled with several ranks per node, and by which algorithm.
NODE_ROWS = {"MPI_Allreduce": "native", "mpiddp hierarchical": "hierarchical",
             "mpiddp auto": "auto"}


def fit_local_link(rows: list, local_size: int) -> LinkCosts:
    """The link between the ranks of one node (shared memory on the emulated cluster) as
    the library's all-reduce on one node saw it (host buffers, ``benchmark_allreduce.py``'s
    default): the latency and rate at which the model takes its times at every size above
    the short-message limit (least squares: the model is linear in both; the host's
    reduction at ``HOST_REDUCE_SECONDS_PER_BYTE``)."""
    gamma = HOST_REDUCE_SECONDS_PER_BYTE
    sizes_and_times = [(row["bytes"], row["seconds"]) for row in rows
                       if row["method"] == "MPI_Allreduce" and row["bytes"] > NATIVE_SHORT_BYTES]
    if len(sizes_and_times) < 2:
        raise ValueError(f"fewer than two MPI_Allreduce sizes above {NATIVE_SHORT_BYTES} bytes")

    def seconds(nbytes: int, alpha: float, beta: float) -> float:
        return native_seconds(nbytes, local_size, LinkCosts(alpha, beta, gamma))

    base = [seconds(n, 0.0, 0.0) for n, _ in sizes_and_times]
    matrix = np.array([[seconds(n, 1.0, 0.0) - b, seconds(n, 0.0, 1.0) - b]
                       for (n, _), b in zip(sizes_and_times, base)])
    times = np.array([t - b for (_, t), b in zip(sizes_and_times, base)])
    (alpha, beta), *_ = np.linalg.lstsq(matrix, times, rcond=None)
    return LinkCosts(max(float(alpha), 0.0), max(float(beta), 1e-12), gamma)


def nodes_model_s(method: str, nbytes: int, nodes: int, local_size: int, link: LinkCosts,
                  local: LinkCosts, step_overhead_s: float) -> float:
    """One all-reduce as the benchmark times it with ``local_size`` ranks per node: the
    library's, node-aware, or through the engine (its negotiation: the library's small
    all-reduce over every rank) by the hierarchical all-reduce or its automatic choice."""
    if method == "MPI_Allreduce":
        return native_seconds(nbytes, nodes * local_size, link, local_size, local)
    job = Job([], 1.0, 0.0, nodes, link, step_overhead_s=step_overhead_s, engine_cycle_s=0.0,
              local_size=local_size, local_link=local)
    return job.cycle_s([nbytes], NODE_ROWS[method])


def validate_nodes(directory: str, step_overhead_us: float,
                   gbit_per_s: float | None = None) -> None:
    """The model of several ranks per node (the network interface shared, a node-local link)
    against the all-reduce benchmark at NxG, G > 1, on the links alone: the node-local link
    fitted from the 1xG run, the network's latency the one at which the model's library
    all-reduce takes the run's own smallest time (as ``validate``: the scheduler's delays in
    it, the more with more ranks on the cores). The network's rate: the emulated cluster's
    setting (light, heavy) where the file names one, else ``gbit_per_s`` (your cluster's:
    ``allreduce-NAME-NxG.json``)."""
    table, errors, sizes = {}, [], set()
    for path in sorted(glob.glob(os.path.join(directory, "allreduce-*.json"))):
        match = NODES_RESULT.search(os.path.basename(path))
        if not match or int(match["local"]) < 2 or int(match["nodes"]) < 2:
            continue
        setting, nodes, local_size = match["setting"], int(match["nodes"]), int(match["local"])
        rate = SETTINGS.get(setting, gbit_per_s)
        if rate is None:
            print(f"{path}: not a setting of the emulated cluster; give --gbit; skipped")
            continue
        one_node = allreduce_rows(directory, setting, 1, local_size)
        if not one_node:
            print(f"{path}: no allreduce-{setting}-1x{local_size}.json to fit the node-local "
                  "link from; skipped")
            continue
        try:
            local = fit_local_link(one_node, local_size)
        except ValueError as error:
            print(f"{path}: cannot fit the node-local link ({error}); skipped")
            continue
        rows = allreduce_rows(directory, setting, nodes, local_size)
        link = LinkCosts.from_rate(rate, 1e6 * measured_latency_s(
            rows, rate, nodes, None, local_size=local_size, local_link=local),
            1 / HOST_REDUCE_SECONDS_PER_BYTE / 1e9)
        for row in rows:
            if row["method"] not in NODE_ROWS:
                continue
            predicted = nodes_model_s(row["method"], row["bytes"], nodes, local_size, link,
                                      local, step_overhead_us * 1e-6)
            error = predicted / row["seconds"] - 1
            errors.append((setting, row["bytes"] >= 1 << 20, abs(error)))
            sizes.add(row["bytes"])
            table.setdefault((setting, f"{nodes}x{local_size}", row["method"]), {})[
                row["bytes"]] = percent(error)
        print(f"{setting} {nodes}x{local_size}: node-local link {local.describe()} (fitted), "
              f"network {link.describe()}")
    if not table:
        return
    sizes = sorted(sizes)
    print("\nAll-reduce with several ranks per node, model / measured - 1:\n")
    print("| setting | nodes x ranks | method | " + " | ".join(human_bytes(n) for n in sizes)
          + " |")
    print("|---|---|---|" + "---:|" * len(sizes))
    for (setting, shape, method), cells in sorted(table.items()):
        print(f"| {setting} | {shape} | {method} | "
              + " | ".join(cells.get(n, "") for n in sizes) + " |")
    for setting in sorted({s for s, _, _ in table}):
        for large in (False, True):
            print_summary(f"{setting}, several ranks per node, all-reduce "
                          f"{'from' if large else 'below'} 1 MiB",
                          [e for s, big, e in errors if (s, big) == (setting, large)])


def percent(error: float) -> str:
    """A signed whole percentage, with no "-0%"."""
    return f"{round(100 * error):+d}%"


def human_bytes(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


# ---- extrapolate, predict, horovod: hundreds of nodes --------------------------------------
MODELS = (("ResNet-50", "sim-resnet50", 64), ("VGG-16", "sim-vgg16", 64),
          ("BERT-base", "sim-bert", 32))
NODE_COUNTS = (2, 16, 64, 128, 256, 512)
# Horovod's paper (Sergeev & Del Balso, 2018), 512 GPUs (128 servers x 4 Pascal GPUs,
# 25 Gbit/s RoCE): scaling efficiency as reported there.
HOROVOD_512 = {"ResNet-101": 0.90, "Inception V3": 0.90, "VGG-16": 0.68}
HOROVOD_SERVERS, HOROVOD_GPUS_PER_SERVER, HOROVOD_GBIT = 128, 4, 25
# The paper names neither the servers' GPU interconnect nor the batch: PCIe 3.0 x16 (about
# 10 GB/s between two GPUs in practice) and the batch of the per-GPU rates used (64).
PCIE3_GB_PER_S, PCIE_LATENCY_US = 10.0, 10.0


@dataclass(frozen=True)
class Cluster:
    """Where a job runs: nodes of ``gpus_per_node`` GPUs, a network interface per node."""

    gbit_per_s: float
    latency_us: float = 5.0
    gpus_per_node: int = 1
    intra_gb_per_s: float = PCIE3_GB_PER_S      # between two GPUs of a node
    intra_latency_us: float = PCIE_LATENCY_US
    reduce_gb_per_s: float | None = None        # None: reductions on the device

    def links(self) -> tuple[LinkCosts, LinkCosts]:
        """(the network, a node's link between GPUs); a host reduction rate applies to both."""
        network = LinkCosts.from_rate(self.gbit_per_s, self.latency_us, self.reduce_gb_per_s)
        local = LinkCosts.from_rate(8 * self.intra_gb_per_s, self.intra_latency_us,
                                    self.reduce_gb_per_s)
        return network, local

    def describe(self) -> str:
        where = (f"reductions on the host at {self.reduce_gb_per_s:g} GB/s (NumPy; the "
                 "staged path)" if self.reduce_gb_per_s else
                 "reductions on the device (a CUDA-aware MPI)")
        gpus = "one GPU per node" if self.gpus_per_node == 1 else (
            f"{self.gpus_per_node} GPUs per node sharing its network interface, "
            f"{self.intra_gb_per_s:.3g} GB/s and {self.intra_latency_us:.3g} us between them")
        return f"{gpus}, network latency {self.latency_us:.3g} us, {where}"


def job_on(cluster: Cluster, layers: list, step_s: float, nodes: int,
           param_scale: float = 1.0) -> Job:
    network, local = cluster.links()
    return Job(layers, param_scale, step_s, nodes, network, local_size=cluster.gpus_per_node,
               local_link=local, on_device=True)


def efficiencies(cluster: Cluster, layers: list, step_s: float, nodes: int,
                 param_scale: float = 1.0) -> tuple[float, float]:
    """(standard path, forward overlap): one GPU's step over the step on ``nodes`` nodes."""
    job = job_on(cluster, layers, step_s, nodes, param_scale)
    return tuple(step_s / step_seconds(job, overlap) for overlap in (False, True))


def extrapolate(profile_name: str, cluster: Cluster, rates=(10.0, 25.0, 100.0)) -> None:
    profile = sim.PROFILES[profile_name]
    print(f"{profile.name} ({profile.resnet50_images_per_s:g} ResNet-50 images/s; other "
          f"models by MACs), {cluster.describe()}, 4 MiB buckets; efficiency = one GPU's "
          "step / the step at N nodes (std: standard path; fo: forward overlap); Gbit/s of "
          "each node's network.\n")
    print("| model | batch/GPU | step (s) | gradients (MB) | nodes | GPUs | "
          + " | ".join(f"{r:g} Gbit/s std | fo" for r in rates) + " |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(rates))
    for label, key, batch in MODELS:
        layers = sim.MODELS[key]()
        step = sim.profile_step_time(profile, layers, batch, key)
        mbytes = 4 * sim.param_count(layers) / 1e6
        for nodes in NODE_COUNTS:
            cells = [f"{100 * e:.0f}%" for rate in rates
                     for e in efficiencies(replace(cluster, gbit_per_s=rate), layers, step,
                                           nodes)]
            print(f"| {label} | {batch} | {step:.3f} | {mbytes:.0f} | {nodes} | "
                  f"{nodes * cluster.gpus_per_node} | " + " | ".join(cells) + " |")
    print("\nHorovod at 512 GPUs, 25 Gbit/s RoCE: " + ", ".join(
        f"{k} {100 * v:.0f}%" for k, v in HOROVOD_512.items())
          + " (`scaling_model.py horovod`: its own setup)")


def predict(model: str, batch: int, step_s: float | None, profile_name: str | None,
            gradient_mb: float | None, cluster: Cluster, node_counts: list[int]) -> None:
    """A user's own job: the model's layer shapes (its gradients rescaled to
    ``gradient_mb``), one GPU's measured step (or a profile's), on ``cluster``."""
    layers = sim.MODELS[model]()
    full_mb = 4 * sim.param_count(layers) / 1e6
    scale = gradient_mb / full_mb if gradient_mb else 1.0
    mbytes = 4 * sim.param_count(layers, scale) / 1e6
    if step_s is None:
        step_s = sim.profile_step_time(sim.PROFILES[profile_name], layers, batch, model)
    print(f"{sim.DESCRIPTIONS[model]}: {mbytes:.0f} MB of gradients, one GPU's step "
          f"{step_s:.3f} s ({batch} samples); {cluster.gbit_per_s:g} Gbit/s, "
          f"{cluster.describe()}.\n")
    print("| nodes | GPUs | step, standard (s) | efficiency | step, forward overlap (s) | "
          "efficiency | samples/s, forward overlap | fused buffers by |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for nodes in node_counts:
        job = job_on(cluster, layers, step_s, nodes, scale)
        standard, overlap = (step_seconds(job, o) for o in (False, True))
        used = sorted({name for name, _ in job.chosen(
            fused_buffers([n for sizes, _ in buckets(job) for n in sizes], job.fusion_bytes),
            "auto")}) if job.ranks > 1 else ["-"]      # one GPU: nothing to reduce
        print(f"| {nodes} | {job.ranks} | {standard:.3f} | {100 * step_s / standard:.0f}% | "
              f"{overlap:.3f} | {100 * step_s / overlap:.0f}% | "
              f"{job.ranks * batch / overlap:,.0f} | {', '.join(used)} |")


def horovod(intra_gb_per_s: float, latency_us: float) -> None:
    """The model on the setup of Horovod's paper, beside what the paper measured."""
    profile = sim.PROFILES["p100-tf-fp32"]
    cluster = Cluster(HOROVOD_GBIT, latency_us, HOROVOD_GPUS_PER_SERVER, intra_gb_per_s)
    print(f"Horovod's setup: servers of {HOROVOD_GPUS_PER_SERVER} Pascal GPUs on "
          f"{HOROVOD_GBIT} Gbit/s; {cluster.describe()}; one GPU's step from {profile.source} "
          "(ResNet-101 at ResNet-152's MACs per second).\n")
    jobs = (("ResNet-101", "sim-resnet101", "sim-resnet152"),
            ("Inception V3", "sim-inception3", "sim-inception3"),
            ("VGG-16", "sim-vgg16", "sim-vgg16"))
    servers = (1, 2, 4, 16, 64, HOROVOD_SERVERS)
    print("| model | step (s) | gradients (MB) | " + " | ".join(
        f"{n * HOROVOD_GPUS_PER_SERVER} GPUs std | fo" for n in servers)
          + " | Horovod, 512 GPUs |")
    print("|---|---:|---:|" + "---:|---:|" * len(servers) + "---:|")
    for label, key, like in jobs:
        layers = sim.MODELS[key]()
        step = sim.profile_step_time(profile, layers, 64, like)
        cells = [f"{100 * e:.0f}%" for n in servers
                 for e in efficiencies(cluster, layers, step, n)]
        print(f"| {label} | {step:.3f} | {4 * sim.param_count(layers) / 1e6:.0f} | "
              + " | ".join(cells) + f" | {100 * HOROVOD_512[label]:.0f}% |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate",
                       help="the model against scripts/bench/scaling_benchmark.sh's JSON")
    v.add_argument("directory")
    v.add_argument("--latency-us", type=float, default=None,
                   help="the emulated links' latency (default: from the all-reduce benchmark "
                        "at each N where it ran, else 100)")
    v.add_argument("--step-overhead-us", type=float, default=50.0,
                   help="the ring's cost per step in Python and MPI")
    v.add_argument("--control-over-mpi", action="store_true",
                   help="the runs' engine negotiated over MPI and had no recursive doubling "
                        "(code before 2026-11-26's seventh run; since, over the engine's "
                        "TCP connections where it keeps them, as on the emulated cluster)")
    v.add_argument("--cores", type=int, default=os.sysconf("SC_NPROCESSORS_ONLN"),
                   help="the cores the emulated nodes shared (default: this machine's)")
    e = sub.add_parser("extrapolate", help="64-512 nodes at 10, 25 and 100 Gbit/s")
    e.add_argument("--profile", default="v100-fp32", choices=sorted(sim.PROFILES))
    e.add_argument("--rates", type=positive(float), nargs="+", default=[10, 25, 100],
                   help="each node's network Gbit/s (all its interfaces together)")
    add_cluster_arguments(e)
    r = sub.add_parser("predict", help="your own job: a model's shape, one GPU's step, "
                                       "your network")
    r.add_argument("--model", default="sim-resnet50", choices=sorted(sim.MODELS),
                   help="the layer shapes (a convolutional network's large gradients come "
                        "last in backward, first to be reduced; BERT's are even)")
    r.add_argument("--batch", type=positive(int), default=64, help="samples per GPU per step")
    timing = r.add_mutually_exclusive_group()
    timing.add_argument("--step-s", type=positive(float), default=None,
                        help="one GPU's forward + backward, measured (seconds)")
    timing.add_argument("--profile", default="v100-fp32", choices=sorted(sim.PROFILES),
                        help="else: a published single-GPU rate")
    r.add_argument("--gradient-mb", type=positive(float), default=None,
                   help="your model's gradient bytes (MB; default: the model's own)")
    r.add_argument("--gbit", type=positive(float), default=None,
                   help="each node's network Gbit/s (all its interfaces together; default 25)")
    r.add_argument("--links-from", metavar="LOG", default=None,
                   help="a log of your job with MPIDDP_LOG_LEVEL=info on 2 or more nodes: "
                        "the network's latency and rate as the engine measured them (what "
                        "--latency-us and --gbit give stays as given)")
    r.add_argument("--nodes", type=positive(int), nargs="+",
                   default=[1, 2, 4, 8, 16, 64, 128, 256, 512])
    add_cluster_arguments(r)
    n = sub.add_parser("validate-nodes", help="several ranks per node: the model against "
                                              "benchmark_allreduce.py at NxG")
    n.add_argument("directory")
    n.add_argument("--step-overhead-us", type=float, default=50.0)
    n.add_argument("--gbit", type=positive(float), default=None,
                   help="the network's Gbit/s per node, for files not named after the "
                        "emulated cluster's settings (allreduce-NAME-NxG.json)")
    h = sub.add_parser("horovod", help="the model on the setup of Horovod's paper")
    h.add_argument("--intra-gb-per-s", type=positive(float), default=PCIE3_GB_PER_S)
    h.add_argument("--latency-us", type=non_negative, default=5.0)
    args = p.parse_args(argv)
    if args.command == "validate":
        over_sockets = not args.control_over_mpi
        validate(args.directory, args.latency_us, args.step_overhead_us, args.cores,
                 over_sockets)
        validate_allreduce(args.directory, args.latency_us, args.step_overhead_us, args.cores,
                           over_sockets)
    elif args.command == "validate-nodes":
        validate_nodes(args.directory, args.step_overhead_us, args.gbit)
    elif args.command == "extrapolate":
        extrapolate(args.profile, cluster_from(args, args.rates[0]), tuple(args.rates))
    elif args.command == "predict":
        gbit = args.gbit
        if args.links_from:
            latency_us, node_gbit, local = measured_links(args.links_from)
            print(f"From {args.links_from}: latency {latency_us:g} us, {node_gbit:.3g} Gbit/s "
                  f"per node ({local} rank(s) per node measured it)\n")
            args.latency_us = latency_us if args.latency_us is None else args.latency_us
            gbit = node_gbit if gbit is None else gbit
        predict(args.model, args.batch, args.step_s, args.profile, args.gradient_mb,
                cluster_from(args, 25.0 if gbit is None else gbit), args.nodes)
    else:
        horovod(args.intra_gb_per_s, args.latency_us)


def positive(kind):
    """An argparse type: a ``kind`` number above zero."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--latency-us", type=non_negative, default=None,
                        help="the network's latency per message (default 5)")
    parser.add_argument("--gpus-per-node", type=positive(int), default=1)
    parser.add_argument("--intra-gb-per-s", type=positive(float), default=PCIE3_GB_PER_S,
                        help="between two GPUs of a node (PCIe 3.0 x16: about 10; NVLink: "
                             "tens to hundreds)")
    parser.add_argument("--intra-latency-us", type=non_negative, default=PCIE_LATENCY_US)
    parser.add_argument("--reduce-gb-per-s", type=positive(float), default=None,
                        help="host reduction rate (GB/s of buffer; NumPy here: about 7); "
                             "default: reductions on the device")


def cluster_from(args, gbit: float) -> Cluster:
    latency_us = 5.0 if args.latency_us is None else args.latency_us
    return Cluster(gbit, latency_us, args.gpus_per_node, args.intra_gb_per_s,
                   args.intra_latency_us, args.reduce_gb_per_s)


# Rank 0's INFO line on the links the engine measured at start (engine/executor.py).
MEASURED_LINKS = re.compile(
    r"links between the (?P<nodes>\d+) nodes(?: \((?P<local>\d+) ranks per node exchanging at "
    r"once\), each)?: latency (?P<latency>[\d.e+]+) us, (?P<gbit>[\d.e+]+) Gbit/s")


def measured_links(log_path: str) -> tuple[float, float, int]:
    """(latency in us, the node's Gbit/s, ranks per node) from the last line in which an
    engine logged the links it measured (``MPIDDP_LOG_LEVEL=info``). With several ranks per
    node each measured its share of the node's interface, all exchanging at once: the node's
    rate is that times the ranks."""
    with open(log_path, errors="replace") as log:
        found = [m for m in map(MEASURED_LINKS.search, log) if m]
    if not found:
        raise SystemExit(
            f"{log_path}: no line 'mpiddp: links between the N nodes ...'. Rank 0 logs it when "
            "a job spans nodes: run one with MPIDDP_LOG_LEVEL=info and without "
            "MPIDDP_RING_THRESHOLD (setting it skips the measurement)")
    last = found[-1]
    local = int(last["local"] or 1)
    return float(last["latency"]), float(last["gbit"]) * local, local


if __name__ == "__main__":
    main()
