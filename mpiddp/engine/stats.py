"""Engine statistics: counters a user (or a test) reads to see what the engine did."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    """Written by the coordinator thread only (plain increments, no lock on the hot path);
    read through ``snapshot()``."""

    cycles: int = 0                 # negotiation cycles run
    cached_cycles: int = 0          # cycles that needed only the bit-vector all-reduce
    slow_cycles: int = 0            # cycles that went through rank 0 (new names, errors...)
    tensors: int = 0                # requests completed (success or error)
    errors: int = 0                 # requests failed by a negotiated error
    cache_hits: int = 0             # tensors executed straight from the response cache
    allreduce_batches: int = 0      # buffers all-reduced (one per fused batch)
    fused_batches: int = 0          # batches that held more than one tensor
    fused_tensors: int = 0          # tensors that travelled in a fused batch
    max_batch_tensors: int = 0      # most tensors in one batch
    allreduce_bytes: int = 0        # bytes of all-reduced buffers
    ring_batches: int = 0           # batches reduced by the ring
    halving_doubling_batches: int = 0   # batches reduced by recursive halving-doubling
    recursive_doubling_batches: int = 0  # batches reduced by recursive doubling (sockets)
    native_batches: int = 0         # batches reduced by MPI_Allreduce
    hierarchical_batches: int = 0   # batches reduced by the hierarchical all-reduce
    adasum_batches: int = 0         # batches reduced by Adasum (op=Adasum)
    pipelined_batches: int = 0      # of those, batches cut into pipelined segments
    reducescatter_bytes: int = 0    # bytes of reduce-scattered tensors
    speculated_tensors: int = 0     # all-reduces summed beside the negotiation (speculation.py)

    def record(self, kind: str, tensors: int, job) -> None:
        """Count one executed batch of ``tensors`` requests of ``kind`` (``job``: what the
        executor's operation prepared; its buffer sizes and algorithm)."""
        self.tensors += tensors
        if kind == "allreduce":
            self.allreduce_batches += 1
            self.allreduce_bytes += sum(job.counts) * job.dtype.itemsize
            if tensors > 1:
                self.fused_batches += 1
                self.fused_tensors += tensors
            self.max_batch_tensors = max(self.max_batch_tensors, tensors)
            # ring_batches, native_batches, hierarchical_batches: by the strategy's name
            name = f"{job.algorithm.name}_batches"
            setattr(self, name, getattr(self, name) + 1)
            self.pipelined_batches += job.segments > 1
        elif kind == "reducescatter":
            self.reducescatter_bytes += job.request.numel * job.dtype.itemsize

    def record_speculated(self, nbytes: int) -> None:
        """Count one all-reduce finished beside the negotiation (no batch of its own)."""
        self.tensors += 1
        self.speculated_tensors += 1
        self.allreduce_bytes += nbytes

    def record_error(self) -> None:
        self.tensors += 1
        self.errors += 1

    def snapshot(self) -> dict:
        return asdict(self)

    def reset(self) -> None:
        for key in asdict(self):
            setattr(self, key, 0)
