"""Engine statistics: counters a user (or a test) reads to see what the engine did, and the
traffic: the bytes handed to the engine, the bytes on the wire (counted where they leave, in
``transport/counting.py``), the collectives completed and the time user code waited for them.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields

# Kinds that move tensors (a barrier moves none): their requests count as collectives.
_DATA_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")

# The traffic counters, in the order the summary line gives them.
TRAFFIC_KEYS = ("collectives", "tensor_bytes", "sent_bytes", "received_bytes", "cycles",
                "wait_seconds")


@dataclass
class EngineStats:
    """Written by the coordinator thread (plain increments, no lock on the hot path), except
    ``wait_seconds``, which user threads add to under a lock (``add_wait``); read through
    ``snapshot()``."""

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
    # Traffic (docs/tuning.md, "How to see the traffic"):
    collectives: int = 0            # collectives completed on this rank (barriers not counted)
    tensor_bytes: int = 0           # bytes of this rank's tensors handed to those collectives
    sent_bytes: int = 0             # bytes this rank sent on the wire (transport/counting.py)
    received_bytes: int = 0         # bytes this rank received on the wire
    wait_seconds: float = 0.0       # time user threads spent blocked waiting for handles

    def __post_init__(self):
        self._wait_lock = threading.Lock()     # not a field: snapshot() leaves it out

    def add_wait(self, seconds: float) -> None:
        """Add the time a user thread was blocked in a handle's ``wait`` (any thread)."""
        with self._wait_lock:
            self.wait_seconds += seconds

    def record(self, kind: str, tensors: int, job) -> None:
        """Count one executed batch of ``tensors`` requests of ``kind`` (``job``: what the
        executor's operation prepared; its buffer sizes and algorithm)."""
        self.tensors += tensors
        if kind in _DATA_KINDS:
            for entry in job.entries:       # None: a rank that has joined hands nothing
                if entry is not None:
                    self.collectives += 1
                    self.tensor_bytes += entry.input.nbytes    # a ring-order half: its chunk
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
        else:
            if kind == "reducescatter":
                self.reducescatter_bytes += sum(entry.request.numel for entry in job.entries
                                                if entry is not None) * job.dtype.itemsize
            if tensors > 1:             # sharded buckets' halves in one ring pass
                self.fused_batches += 1
                self.fused_tensors += tensors

    def record_speculated(self, nbytes: int) -> None:
        """Count one all-reduce finished beside the negotiation (no batch of its own)."""
        self.tensors += 1
        self.speculated_tensors += 1
        self.allreduce_bytes += nbytes
        # It travels in the negotiation's own all-reduce: counted as MPI's all-reduce of its
        # size (transport/counting.py), on a joined rank too (it sends zeros).
        self.sent_bytes += nbytes
        self.received_bytes += nbytes

    def record_speculated_tensor(self, nbytes: int) -> None:
        """This rank's tensor of a speculated all-reduce (not on a joined rank)."""
        self.collectives += 1
        self.tensor_bytes += nbytes

    def record_error(self) -> None:
        self.tensors += 1
        self.errors += 1

    def summary(self) -> str:
        """The traffic as one line of ``key=value`` (``MPIDDP_TRAFFIC_SUMMARY``)."""
        return " ".join(f"{key}={getattr(self, key)}" for key in TRAFFIC_KEYS[:-1]) + \
            f" wait_seconds={self.wait_seconds:.3f}"

    def snapshot(self) -> dict:
        return asdict(self)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)
