"""Fake ranks in one process: the real ``Engine`` (coordinator thread, protocol, waiting policy)
over an in-memory control channel, with an executor that records what it runs.

Each collective of the fake channel is a rendezvous of every rank's thread on a barrier with a
timeout, so a protocol bug that would hang real ranks fails the test instead.
"""
from __future__ import annotations

import threading
from dataclasses import replace

from mpiddp.collectives.cost_model import PRIORITY_CYCLE_MIN_BYTES
from mpiddp.config import Settings
from mpiddp.engine.autotune import Knobs
from mpiddp.engine.coordinator import Engine
from mpiddp.engine.handle import Handle
from mpiddp.engine.request import ALLREDUCE, Entry, Request, error_for
from mpiddp.errors import MpiddpError

# A small cache, set as a user would set it (explicit: it stays that size, so the tests see
# eviction; tests of its growth leave it unset).
TEST_SETTINGS = Settings(cycle_time=2.0, cache_capacity=8, stall_check_time=30.0,
                         explicit=frozenset({"cache_capacity"}))


class FakeAbort(RuntimeError):
    pass


class Hub:
    """What the fake ranks share: one deposit box per rank and a barrier."""

    def __init__(self, size: int, timeout: float = 20.0):
        self.size = size
        self.box: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.aborted = threading.Event()

    def exchange(self, rank: int, value) -> list:
        """Every rank's ``value``, in rank order (a collective of all fake ranks)."""
        self.box[rank] = value
        self.barrier.wait()
        values = list(self.box)
        self.barrier.wait()         # nobody overwrites the box before everyone has read it
        return values


class FakeChannel:
    """``ControlChannel`` between threads of one process."""

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size

    def and_reduce(self, message: bytes, wait, spin: bool = True, sums=()) -> bytes:
        values = self.hub.exchange(self.rank, (int.from_bytes(message, "little"),
                                               [array.copy() for array in sums], len(message)))
        # MPI would read past a shorter message, or hang: the ranks must agree on its size.
        lengths = [length for _, _, length in values]
        assert len(set(lengths)) == 1, f"cycle messages of different lengths: {lengths}"
        result = values[0][0]
        for value, _, _ in values[1:]:
            result &= value
        for i, array in enumerate(sums):    # in rank order: the same sum on every rank
            total = values[0][1][i].copy()
            for _, arrays, _ in values[1:]:
                total += arrays[i]
            array[:] = total
        return result.to_bytes(len(message), "little")

    def gather_to_root(self, obj):
        values = self.hub.exchange(self.rank, obj)
        return values if self.rank == 0 else None

    def broadcast_from_root(self, obj):
        return self.hub.exchange(self.rank, obj)[0]

    def max(self, value):
        return max(self.hub.exchange(self.rank, value))

    def abort(self) -> None:
        self.hub.aborted.set()
        self.hub.barrier.abort()

    def close(self) -> None:
        pass


class RecordingExecutor:
    """Runs nothing: records the agreed order and completes (or fails) every handle, the way
    the real executor reports agreed errors."""

    def __init__(self, rank, complete, priority_cycle_bytes, speculation_bytes=0):
        self.rank = rank
        self.complete = complete
        self.priority_cycle_bytes = priority_cycle_bytes   # the engine's protocol takes it
        self.speculation_bytes = speculation_bytes         # and the engine this
        self.log: list = []          # (name, error or None), in execution order

    def gradient_cycle_bytes(self, gradient_bytes):
        """No links measured: the budget the engine started with."""
        return self.priority_cycle_bytes

    def knobs(self):
        """What a real executor reports for autotune: every knob applies."""
        return Knobs(fusion_threshold=1 << 20, cycle_time=2.0, ring_threshold=1 << 21,
                     hierarchical=True)

    def retune(self, knobs) -> None:
        self.log.append(("#retune", knobs))      # in the order, with the names it ran

    def close(self) -> None:
        pass

    def complete_speculated(self, done) -> None:
        """Summed beside the negotiation: the sum becomes the output (as the real executor
        does, without scaling), logged in the agreed order with a mark."""
        for entry, response, part in done:
            self.log.append((response.name, "speculated"))
            if entry is not None:
                entry.output[:] = part
                self.complete(entry)

    def run(self, responses, entries) -> None:
        for response in responses:
            self.log.append((response.name, response.error))
            entry = entries.get(response.name)
            if response.error is not None:
                if entry is not None:
                    self.complete(entry, error=error_for(response, entry.rejected))
            elif entry is not None:
                self.complete(entry)
            elif response.request.kind != ALLREDUCE:
                raise MpiddpError(f"rank {self.rank} has no entry for agreed "
                                  f"{response.request.kind} '{response.name}'")
            # else: a joined rank takes part in an allreduce with zeros


class FakeCluster:
    """``size`` engines, one per fake rank, sharing a hub."""

    def __init__(self, size: int, settings: Settings = TEST_SETTINGS, **overrides):
        settings = replace(settings, explicit=settings.explicit | frozenset(overrides),
                           **overrides)
        self.hub = Hub(size)
        self.executors: list = [None] * size

        def factory(rank):
            def make(stats, timeline, complete):
                self.executors[rank] = RecordingExecutor(
                    rank, complete, settings.priority_cycle_bytes
                    if settings.priority_cycle_bytes is not None else PRIORITY_CYCLE_MIN_BYTES,
                    settings.speculation_bytes or 0)
                return self.executors[rank]
            return make

        self.engines = [Engine(FakeChannel(self.hub, r), settings, factory(r))
                        for r in range(size)]

    @property
    def size(self) -> int:
        return self.hub.size

    def logs(self) -> list:
        return [executor.log for executor in self.executors]

    def shutdown(self, rank: int = 0, reason: str = "test over") -> None:
        self.engines[rank].shutdown(reason)
        for engine in self.engines:
            engine.shutdown("test over")


def entry(name: str, kind: str = ALLREDUCE, shape=(4,), dtype: str = "float32",
          input=None, output=None, **fields) -> Entry:
    """An entry without data (the recording executor moves none), or with flat ``input`` and
    ``output`` arrays (speculated sums write the output)."""
    return Entry(Request(name, kind, dtype, tuple(shape), **fields), input, output,
                 Handle(name))
