"""The traffic counters of ``engine_stats()``: bytes handed to the engine, bytes on the wire
(``transport/counting.py``, the one place they are counted), collectives, cycles and the time
user code waits; reset, per process set, and the summary line at shutdown
(``MPIDDP_TRAFFIC_SUMMARY``). Counts are compared with hand-computed bytes, exactly."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from mpi4py import MPI

from mpi_launch import assert_ok, reported, run_mpi
from mpiddp.collectives.ring import ring_allreduce
from mpiddp.engine.handle import Handle
from mpiddp.engine.stats import TRAFFIC_KEYS, EngineStats
from mpiddp.transport.counting import CountedPeers, counted, part_bytes, spec_bytes


class Counter:
    sent_bytes = received_bytes = 0


class FakeComm:
    """A communicator of ``size`` ranks seen from ``rank``: records the calls, moves nothing."""

    def __init__(self, rank: int = 0, size: int = 2):
        self.rank, self.size, self.calls = rank, size, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Sendrecv(self, *args):
        self.calls.append("Sendrecv")

    def Allreduce(self, sendbuf, recvbuf, op=None):
        self.calls.append("Allreduce")

    def Bcast(self, buf, root=0):
        self.calls.append("Bcast")

    def Allgatherv(self, sendbuf, recvbuf):
        self.calls.append("Allgatherv")

    def Alltoallv(self, sendbuf, recvbuf):
        self.calls.append("Alltoallv")


def test_buffer_specifications_in_bytes():
    a = np.zeros(10, dtype=np.float32)
    assert spec_bytes(a) == 40
    assert spec_bytes([a, MPI.BYTE]) == 40
    assert spec_bytes([a, MPI.FLOAT]) == 40
    assert spec_bytes(memoryview(a.view(np.uint8))) == 40
    assert spec_bytes(MPI.IN_PLACE) == 0 and spec_bytes(None) == 0
    assert part_bytes([a, [12, 28], [0, 12], MPI.BYTE]) == [12, 28]    # counts, in bytes
    assert part_bytes([a, [4, 6]]) == [16, 24]      # counts in the array's elements
    assert part_bytes([a, MPI.FLOAT]) is None
    assert spec_bytes([a, [4, 6], [0, 4], MPI.FLOAT]) == 40


def test_each_call_counts_what_leaves_and_reaches_this_rank():
    a = np.zeros(250, dtype=np.float32)                                  # 1000 bytes
    counter = Counter()
    comm = FakeComm(rank=1, size=4)
    transport = counted(comm, counter)
    assert (transport.Get_rank(), transport.Get_size()) == (1, 4)

    def delta(call):
        before = (counter.sent_bytes, counter.received_bytes)
        call()
        return counter.sent_bytes - before[0], counter.received_bytes - before[1]

    assert delta(lambda: transport.Sendrecv([a[:100], MPI.BYTE], 2, 0,
                                            [a[:50], MPI.BYTE], 0, 0)) == (400, 200)
    assert delta(lambda: transport.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT])) == (1000, 1000)
    assert delta(lambda: transport.Bcast([a, MPI.BYTE], root=1)) == (1000, 0)   # the root
    assert delta(lambda: transport.Bcast([a, MPI.BYTE], root=0)) == (0, 1000)
    sizes = [100, 200, 300, 400]                                 # rank 1 gives 200 bytes
    assert delta(lambda: transport.Allgatherv([a[:50], MPI.BYTE],
                                              [a, sizes, [0, 100, 300, 600], MPI.BYTE])) \
        == (200, 800)
    assert delta(lambda: transport.Alltoallv([a, [10, 20, 30, 40], [0, 10, 30, 60], MPI.BYTE],
                                             [a, [1, 2, 3, 4], [0, 1, 3, 6], MPI.BYTE])) \
        == (80, 8)                               # its own part (20 and 2 bytes) stays home
    assert comm.calls == ["Sendrecv", "Allreduce", "Bcast", "Bcast", "Allgatherv", "Alltoallv"]
    # One rank alone moves nothing over MPI's collectives.
    alone = counted(FakeComm(0, 1), counter)
    assert delta(lambda: alone.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT])) == (0, 0)


def test_the_wrapper_overlaps_exactly_where_the_transport_does():
    from mpiddp.transport import overlaps_transfers

    class Overlapping(FakeComm):
        def start_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
            self.calls.append("start")
            return "transfer"

    counter = Counter()
    assert not overlaps_transfers(counted(FakeComm(), counter))
    pending = counted(Overlapping(), counter)
    assert overlaps_transfers(pending)
    a = np.zeros(8, dtype=np.float64)
    assert pending.start_sendrecv([a, MPI.BYTE], 1, [a[:4], MPI.BYTE], 1, 7) == "transfer"
    assert (counter.sent_bytes, counter.received_bytes) == (64, 32)


def test_the_tcp_exchanges_count():
    class Sockets:
        def __init__(self):
            self.exchanged = []

        def exchange(self, dest, send, source, recv, spin=True):
            self.exchanged.append((dest, len(send), source, len(recv)))

        def describe(self, rank):
            return "sockets"

    counter = Counter()
    sockets = Sockets()
    peers = CountedPeers(sockets, counter)
    peers.exchange(1, np.zeros(3, np.float32), 1, np.zeros(5, np.float32))
    assert (counter.sent_bytes, counter.received_bytes) == (12, 20)
    assert sockets.exchanged == [(1, 3, 1, 5)]
    assert peers.describe(0) == "sockets"          # the rest passes through


@pytest.mark.parametrize("size,count", [(2, 1000), (4, 1000), (3, 999)])
def test_a_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer(size, count):
    """Rank 0's ring over a counted transport (the other ranks' data does not matter for the
    count): N-1 chunks of B/N sent and received in the reduce-scatter, N-1 in the
    all-gather, i.e. 2 (N-1)/N B each way."""
    counter = Counter()
    comm = FakeComm(0, size)
    ring_allreduce(counted(comm, counter), np.ones(count, dtype=np.float32),
                   np.zeros(count // size, np.float32), lambda dst, src: np.add(dst, src, out=dst))
    expected = 2 * (size - 1) * (count * 4) // size
    assert counter.sent_bytes == counter.received_bytes == expected
    assert comm.calls == ["Sendrecv"] * (2 * (size - 1))


class Exchanges:
    """The TCP partners' ``exchange`` that moves nothing (recursive doubling's transport)."""

    def exchange(self, dest, send, source, recv, spin=True):
        pass


@pytest.mark.parametrize("algorithm,whole,local,cross,expected", [
    # 1000 float32 = B = 4000 bytes, seen from rank 0:
    ("ring", 4, 1, 4, 6000),                     # 2 (N-1)/N B
    ("halving_doubling", 4, 1, 4, 6000),         # B/2 + B/4 halving, B/4 + B/2 doubling
    ("recursive_doubling", 4, 1, 4, 8000),       # the whole buffer, log2 N = 2 times
    ("native", 4, 1, 4, 4000),                   # MPI's own: the payload, B each way
    ("hierarchical_native", 4, 2, 2, 6000),      # 2 nodes x 2: B/2 node-local
    ("hierarchical_ring", 4, 2, 2, 6000),        # reduce-scatter, B/2 across, B/2 gather
])
def test_every_algorithm_counts_through_its_links(algorithm, whole, local, cross, expected):
    from mpiddp.buffers.dtypes import dtype_named
    from mpiddp.collectives import algorithms
    from mpiddp.collectives.algorithms import Links
    from mpiddp.reduce_ops import ReduceOp

    counter = Counter()
    links = Links(counted(FakeComm(0, whole), counter), counted(FakeComm(0, local), counter),
                  counted(FakeComm(0, cross), counter), CountedPeers(Exchanges(), counter))
    strategy = {
        "ring": algorithms.RingAllreduce(),
        "halving_doubling": algorithms.HalvingDoublingAllreduce(),
        "recursive_doubling": algorithms.RecursiveDoublingAllreduce(),
        "native": algorithms.NativeAllreduce(),
        "hierarchical_native": algorithms.HierarchicalAllreduce(cross_ring_threshold=1 << 20),
        "hierarchical_ring": algorithms.HierarchicalAllreduce(cross_ring_threshold=0),
    }[algorithm]
    dtype = dtype_named("float32")
    buf = np.ones(1000, dtype=np.float32)
    scratch = np.zeros(max(strategy.scratch_elements(1000, 4, links), 1), dtype=np.float32)
    strategy.run(links, buf, scratch, dtype, ReduceOp.SUM,
                 lambda dst, src, op, dtype: np.add(dst, src, out=dst))
    assert counter.sent_bytes == counter.received_bytes == expected


def test_stats_record_reset_and_summary():
    stats = EngineStats()
    stats.sent_bytes, stats.received_bytes, stats.tensor_bytes = 4000, 3000, 2000
    stats.collectives, stats.cycles = 3, 7
    stats.add_wait(0.25)
    assert stats.summary() == ("collectives=3 tensor_bytes=2000 sent_bytes=4000 "
                               "received_bytes=3000 cycles=7 wait_seconds=0.250")
    snapshot = stats.snapshot()
    assert set(TRAFFIC_KEYS) <= set(snapshot) and "_wait_lock" not in snapshot
    stats.reset()
    assert all(stats.snapshot()[key] == 0 for key in TRAFFIC_KEYS)
    assert isinstance(stats.wait_seconds, float)
    stats.record_speculated(64)            # a joined rank: on the wire, no tensor of its own
    assert (stats.sent_bytes, stats.received_bytes, stats.tensor_bytes, stats.collectives) \
        == (64, 64, 0, 0)
    stats.record_speculated_tensor(64)
    assert (stats.tensor_bytes, stats.collectives) == (64, 1)


def test_time_blocked_in_a_handle_wait_counts():
    stats = EngineStats()
    handle = Handle("x")
    handle.stats = stats
    threading.Timer(0.2, handle.complete).start()
    handle.wait()
    assert stats.wait_seconds >= 0.15
    waited = stats.wait_seconds
    handle.wait()                                   # done: no blocking, nothing added
    assert stats.wait_seconds == waited
    timed_out = Handle("y")
    timed_out.stats = stats
    with pytest.raises(TimeoutError):
        timed_out.wait(timeout=0.05)
    assert stats.wait_seconds >= waited + 0.04
    Handle("z").complete()                          # no stats: nothing to count into


# What each check of the worker must read, per rank (rank 0, rank 1), hand-computed at 2
# ranks: B bytes all-reduced by the ring are sent and received as 2 (2-1)/2 B = B.
F32, F16 = 4, 2
GRADS = (64 * 32 + 32 + 32 * 4 + 4) * F32       # the worker's model: 2212 float32 = 8848
USAGE = 4                  # one uint8 per parameter, all-reduced with MAX every step
POWERSGD = ((32 + 64) * 2 + (32 * 4) + 32 + 4) * F32   # P, Q of the 32x64 weight at rank 2;
# the 4x32 weight stays whole ((4 + 32) * 2 > 4 * 32); the biases: 1424 bytes
EXPECTED = {
    "ring float32": [dict(collectives=1, tensor_bytes=4000, sent_bytes=4000,
                          received_bytes=4000, ring_batches=1)] * 2,
    "native float32": [dict(collectives=1, tensor_bytes=4000, sent_bytes=4000,
                            received_bytes=4000, native_batches=1)] * 2,
    "ring fp16": [dict(collectives=1, tensor_bytes=1000 * F16, sent_bytes=1000 * F16,
                       received_bytes=1000 * F16)] * 2,
    "ring bf16": [dict(collectives=1, tensor_bytes=1000 * F16, sent_bytes=1000 * F16,
                       received_bytes=1000 * F16)] * 2,
    # 1000 float32 handed over; one ring step: send one half (500 floats), receive the other.
    "reducescatter": [dict(collectives=1, tensor_bytes=4000, sent_bytes=2000,
                           received_bytes=2000, reducescatter_bytes=4000)] * 2,
    # Rank 0 gives 3 rows of 10 float32 (120 bytes), rank 1 gives 5 (200): each sends its
    # own and receives the other's.
    "allgather": [dict(collectives=1, tensor_bytes=120, sent_bytes=120, received_bytes=200),
                  dict(collectives=1, tensor_bytes=200, sent_bytes=200, received_bytes=120)],
    "broadcast": [dict(collectives=1, tensor_bytes=4000, sent_bytes=4000, received_bytes=0),
                  dict(collectives=1, tensor_bytes=4000, sent_bytes=0, received_bytes=4000)],
    # A step: 4 gradients + the usage vector, all-reduced.
    "step plain": [dict(collectives=5, tensor_bytes=GRADS + USAGE, sent_bytes=GRADS + USAGE,
                        received_bytes=GRADS + USAGE, allreduce_bytes=GRADS + USAGE,
                        reducescatter_bytes=0)] * 2,
    "step fp16": [dict(collectives=5, tensor_bytes=GRADS // 2 + USAGE,
                       sent_bytes=GRADS // 2 + USAGE, received_bytes=GRADS // 2 + USAGE,
                       allreduce_bytes=GRADS // 2 + USAGE, reducescatter_bytes=0)] * 2,
    # P, Q, the 4x32 weight, 2 biases, the usage vector.
    "step powersgd": [dict(collectives=6, tensor_bytes=POWERSGD + USAGE,
                           sent_bytes=POWERSGD + USAGE, received_bytes=POWERSGD + USAGE,
                           allreduce_bytes=POWERSGD + USAGE, reducescatter_bytes=0)] * 2,
    # Stage 2: the gradients' bucket reduce-scattered (8848 handed over: send and receive
    # 4424), the parameters' chunks all-gathered (4424 handed over: send and receive 4424),
    # the usage vector: the same bytes on the wire as the all-reduce, in 3 collectives.
    "step zero2": [dict(collectives=3, tensor_bytes=GRADS + GRADS // 2 + USAGE,
                        sent_bytes=GRADS + USAGE, received_bytes=GRADS + USAGE,
                        allreduce_bytes=USAGE, reducescatter_bytes=GRADS)] * 2,
    # Rank 0's set of its own: 1000 float32 handed over, nothing on the wire.
    "process set": [dict(collectives=1, tensor_bytes=4000, sent_bytes=0, received_bytes=0)],
    "global beside the set": [dict(collectives=0, tensor_bytes=0, sent_bytes=0,
                                   received_bytes=0)] * 2,
    "before shutdown": [dict(collectives=1, tensor_bytes=1000, sent_bytes=1000,
                             received_bytes=1000)] * 2,
}


def test_traffic_counts_at_two_ranks_match_the_hand_computed_bytes():
    result = run_mpi("traffic_worker.py", 2, timeout=180,
                     env={"MPIDDP_ALLREDUCE_ALGORITHM": "ring",
                          "MPIDDP_TRAFFIC_SUMMARY": "1"})
    assert_ok(result)
    for check, per_rank in EXPECTED.items():
        for rank, expected in enumerate(per_rank):
            got = reported(result, f"{rank} {check}")
            got = [g for g in got if g["check"] == f"{rank} {check}"]
            assert len(got) == 1, (check, rank, result.output)
            values = {key: got[0][key] for key in expected}
            assert values == expected, (check, rank)
    # Rank 1 submits 0.5 s late: rank 0 waited at least (nearly) that long for the result.
    (wait,) = [g for g in reported(result, "0 wait") if g["check"] == "0 wait"]
    assert wait["wait_seconds"] >= 0.45
    # The summary at shutdown: a line per rank and engine, with the last counters.
    lines = re.findall(r"mpiddp traffic: rank (\d) process_set (\d): collectives=(\d+) "
                       r"tensor_bytes=(\d+) sent_bytes=(\d+) received_bytes=(\d+) "
                       r"cycles=(\d+) wait_seconds=[\d.]+", result.output)
    found = {(int(r), int(s)): tuple(map(int, rest[:4])) for r, s, *rest in lines}
    assert found == {(0, 0): (1, 1000, 1000, 1000), (1, 0): (1, 1000, 1000, 1000),
                     (0, 1): (1, 4000, 0, 0)}, result.output
