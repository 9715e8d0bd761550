"""Forward overlap's cycle budget, sized for the job's gradients.

Where the user has not set ``MPIDDP_PRIORITY_CYCLE_BYTES``, forward overlap cuts gradients
into pieces sized for them, and each piece's request carries that size as its cycle's budget
(``Request.cycle_bytes``: the engine's cycles of prioritized all-reduces carry one piece; the
agreed request's value, so nothing else needs agreeing). For gradients in host memory, the
pieces are sized from the links the engine measured and the gradients' bytes a step
(``host_piece_bytes``: ``cost_model.gradient_cycle_bytes``, few cycles' fixed costs against a
short wait for the cycle in flight), at the first submission on each engine
(``ForwardOverlap``). A cycle of
device buffers also waits for kernels and staging copies: on an H200 shared by two ranks a
one-element all-reduce of a CUDA tensor took ~0.74 ms against ~0.09 ms in host memory, and
forward overlap in the host's 1 MiB cycles ran ResNet-18 at 0.55x the standard path's speed
(16 MiB cycles: 0.94x; docs/dev/gpu.md, "Forward overlap on GPUs"). So where forward overlap
reduces gradients in device memory and the user has not set ``MPIDDP_PRIORITY_CYCLE_BYTES``,
every rank times the engine's all-reduce of a device buffer (fixed cost and cost per byte),
the ranks agree on the slowest, and the pieces and the engine's budget are sized from that
(``cost_model.device_priority_cycle_bytes``).
"""
from __future__ import annotations

import logging
import statistics
import time

import torch

from ...collectives.cost_model import device_priority_cycle_bytes
from ...reduce_ops import ReduceOp
from ..ops.collectives import allreduce, allreduce_

log = logging.getLogger("mpiddp")

SMALL_REPEATS = 7           # one-element all-reduces: the fixed cost (median)
LARGE_BYTES = 4 << 20       # well above the fixed cost's worth of bytes on any link measured
LARGE_REPEATS = 3


def _median_seconds(tensor: torch.Tensor, name: str, repeats: int, process_set) -> float:
    """Median time of a synchronous all-reduce of ``tensor``, its device work included,
    after one untimed call (device kernels compiled, buffers allocated)."""
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        allreduce_(tensor, name=name, op=ReduceOp.SUM, process_set=process_set)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def measure_allreduce(device: torch.device, prefix: str, process_set) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of the engine's all-reduce of a float32 buffer on
    ``device``, end to end, the slowest rank's values on every rank. A collective of
    ``process_set``; names start with ``prefix``."""
    fixed = _median_seconds(torch.zeros(1, device=device), f"{prefix}.cycle_probe.small",
                            SMALL_REPEATS, process_set)
    large = _median_seconds(torch.zeros(LARGE_BYTES // 4, device=device),
                            f"{prefix}.cycle_probe.large", LARGE_REPEATS, process_set)
    measured = torch.tensor([fixed, max(0.0, large - fixed) / LARGE_BYTES], dtype=torch.float64)
    agreed = allreduce(measured, op=ReduceOp.MAX, name=f"{prefix}.cycle_probe.agree",
                       process_set=process_set)
    return float(agreed[0]), float(agreed[1])


def device_of(params: list) -> torch.device | None:
    """The accelerator the parameters are on (the first such, by name), None if on the host."""
    devices = sorted({p.device for p in params if p.device.type != "cpu"}, key=str)
    return devices[0] if devices else None


def device_piece_bytes(params: list, prefix: str, process_set, engine) -> int | None:
    """Forward overlap's piece size for ``params`` where they are in device memory and mpiddp
    sizes the cycles (the user set no budget): sized from the device all-reduce measured now
    (a collective), at least ``engine``'s budget. None where the engine's budget applies."""
    budget = engine.settings.priority_cycle_bytes
    device = device_of(params)
    if device is None or not engine.cycle_budget_sized or not budget:
        return None
    fixed, per_byte = measure_allreduce(device, prefix, process_set)
    pieces = max(budget, device_priority_cycle_bytes(fixed, per_byte))
    if engine.rank == 0:
        log.info("mpiddp: forward overlap on %s: an all-reduce there costs %.0f us + %.2f ns "
                 "per byte (slowest rank), so cycles carry up to %d MiB of gradients (host "
                 "memory's budget: %d MiB)", device, fixed * 1e6, per_byte * 1e9,
                 pieces >> 20, budget >> 20)
    return pieces


def host_piece_bytes(gradient_bytes: int, engine) -> int | None:
    """Forward overlap's piece size for ``gradient_bytes`` of gradients a step (on the wire)
    in host memory, where mpiddp sizes the cycles: from the links ``engine`` measured; the
    same on every rank. None where the user's budget applies."""
    budget = engine.settings.priority_cycle_bytes
    if not engine.cycle_budget_sized or not budget:
        return None
    pieces = engine.gradient_cycle_bytes(gradient_bytes)
    if engine.rank == 0 and pieces != budget:
        log.info("mpiddp: forward overlap reduces %.3g MB of gradients a step, so its cycles "
                 "carry up to %d KiB (the links alone: %d KiB)", gradient_bytes / 1e6,
                 pieces >> 10, budget >> 10)
    return pieces
