"""Transfers across nodes without burning the core that backward needs.

MPI's blocking calls busy-poll until they complete. Within a node that is what moves the data
(shared-memory copies happen inside the polling), but across nodes the kernel moves it: a
blocking ``MPI_Sendrecv`` of a gradient chunk over a 1 Gbit/s link spins a core for the whole
wire time. Measured on the emulated cluster (2 nodes x 1 rank, ResNet-18): mpiddp used 684 ms
of CPU per step against DDP's 398 ms, the difference being the wire time, and that spinning
coordinator took the core from backward, so nothing was hidden (docs/dev/benchmark-record.md).

``NetworkComm`` gives the collectives the same calls (``Transport``) on a communicator whose
ranks sit on different nodes. The ring's point-to-point steps (``start_sendrecv``) whose wire
time is long enough to be worth it, where nearly all the bytes of a large all-reduce go,
become ``Irecv`` + ``Isend`` left in flight (the pipelined hierarchical all-reduce works
within the node meanwhile) and completed by ``wait_for_transfer``: a short spin where the
transfer's wire time fits in it (otherwise none: a 100 us spin on every step of every
all-reduce cost 7-9 ms of the 115 ms of CPU per training step at 16 emulated nodes), then tests
separated by sleeps of a tenth of the time waited so far or of the expected wire time, at
most a cap sized from the measured link, each wake testing several times in a row
(``pacing.py``: MPI pushes bytes into the socket and drains them only when tested, a bounded
amount per test; about 1.2 ms between bursts of 8 tests at 1 Gbit/s). A transfer finishes a
little late at most while the core is free for computing. On links too fast for any sleep
the wait blocks in MPI instead. (A user thread that waits leaves its core idle, and an
earlier rule polled harder then: flat out at first, later with sleeps of at most 20 us. It
bought nothing measurable and cost CPU: 2 emulated nodes at 1 Gbit/s, ring all-reduce of
1-16 MiB at the link rate either way, 1.9-2.4 s of CPU per GB all-reduced with 20 us, 1.2-1.8
with 200 us; the MLP, communication-bound, 437-463 ms of CPU per step with 20 us, 295-335 with
200 us, 0.95-0.98x and 0.98-1.02x DDP-gloo's throughput, alternating runs,
docs/dev/benchmark-record.md "CPU per byte".)

Everything else keeps MPI's blocking calls: small steps are over in moments, and MPI's
collectives run several rounds, each of which would wait for a sleeping partner (measured: a
nonblocking MPI_Allreduce of 256 KiB across 4 oversubscribed nodes took 14 ms with sleeps,
3.4 ms blocking).

A step goes out as messages of at most ``SEGMENT_BYTES``, all posted at once. One message of
several MB crawls while the process computes: MPI libraries send it with a rendezvous
protocol that moves data only as fast as both sides call into MPI, and this side calls in
only between its sleeps. Measured on 2 nodes x 1 rank at 1 Gbit/s over UCX/TCP, mpiddp /
DDP-gloo throughput in the same run, with each step sent as one message / 4 MiB / 1 MiB /
128 KiB / 64 KB pieces: MLP 0.93x / 0.94x / 0.99x / 0.97x / 0.99x; ResNet-18 0.93x / 0.98x /
1.04x / 1.05x / -. 1 MiB pieces do as well as switching UCX to its eager protocol
(``UCX_RNDV_THRESH=inf``: MLP 1.00x, ResNet-18 1.03x) and keep a rendezvous, so zero-copy,
per piece where the network has one.
"""
from __future__ import annotations

import time

from mpi4py import MPI

from .base import COMPLETED, CommWrapper, Transfer
from .pacing import Pacing
from .sockets import PeerSockets

SEGMENT_BYTES = 1024 * 1024
TRANSFER_SPIN_SECONDS = 100e-6
FIRST_SLEEP_SECONDS = 10e-6


def wait_for_transfer(requests: list, pacing: Pacing, expected_s: float = 0.0) -> None:
    """Complete ``requests``: spin briefly if ``expected_s`` is shorter than the spin (or
    unknown), then sleep a tenth of the time waited so far or
    of the transfer's ``expected_s`` wire time, whichever is longer (from 10 us to
    ``pacing.max_sleep_s``: a transfer is noticed at most about 10% late), and test up to
    ``pacing.tests_per_wake`` times on each wake: each test moves a bounded amount, and what
    the link delivered during the sleep waits in the kernel's buffers, so the wake, not the
    test, is what costs. ``pacing.blocks``: block in MPI."""
    if pacing.blocks:
        MPI.Request.Waitall(requests)
        return
    testall, burst = MPI.Request.Testall, range(pacing.tests_per_wake - 1)
    # Spin only for a transfer whose wire time fits in the spin: a longer one cannot finish
    # during it, and every step of every all-reduce would burn the spin's CPU for nothing.
    spin = TRANSFER_SPIN_SECONDS if expected_s < TRANSFER_SPIN_SECONDS else 0.0
    start = time.perf_counter()
    while not testall(requests):
        waited = time.perf_counter() - start
        if waited >= spin:
            time.sleep(min(max(max(waited, expected_s) / 10, FIRST_SLEEP_SECONDS),
                           pacing.max_sleep_s))
            for _ in burst:
                if testall(requests):
                    return


def _byte_view(spec) -> memoryview:
    """The bytes of an mpi4py buffer specification ([array, datatype] or an array)."""
    array = spec[0] if isinstance(spec, (list, tuple)) else spec
    return memoryview(array).cast("B")


def _pieces(data: memoryview) -> list:
    """``data`` as messages of at most ``SEGMENT_BYTES``."""
    return [[data[i:i + SEGMENT_BYTES], MPI.BYTE] for i in range(0, len(data), SEGMENT_BYTES)]


class PendingTransfer:
    """Posted pieces of one exchange; ``wait`` completes them politely."""

    __slots__ = ("requests", "pacing", "expected_s")

    def __init__(self, requests: list, pacing: Pacing, expected_s: float = 0.0):
        self.requests = requests
        self.pacing = pacing
        self.expected_s = expected_s    # wire time on the measured link (0: unknown)

    def wait(self) -> None:
        wait_for_transfer(self.requests, self.pacing, self.expected_s)


class NetworkComm(CommWrapper):
    """``Transport`` on an MPI communicator that spans nodes: the ring's large steps are left
    in flight (``start_sendrecv``) and waited for as ``pacing`` says (sleeps between tests,
    or blocking on a fast link); the collectives are MPI's own. With ``sockets``
    (``sockets.PeerSockets``), messages to and from the partners it connected (on other
    nodes) go over its TCP connections instead, waited for in the kernel."""

    def __init__(self, comm, pacing: Pacing = Pacing(), sockets: PeerSockets | None = None):
        super().__init__(comm)
        self.pacing = pacing
        self.sockets = sockets

    def start_sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int) -> Transfer:
        """Post the exchange as pieces and return it pending (small ones: done here)."""
        return self._start(sendbuf, dest, tag, recvbuf, source, tag)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None) -> None:
        self._start(sendbuf, dest, sendtag, recvbuf, source, recvtag).wait()

    def _start(self, sendbuf, dest, sendtag, recvbuf, source, recvtag) -> Transfer:
        send, recv = _byte_view(sendbuf), _byte_view(recvbuf)
        if self.sockets is not None:
            transfer = self.sockets.start_exchange(self.comm, sendbuf, send, dest, sendtag,
                                                   recvbuf, recv, source, recvtag)
            if transfer is not None:
                return transfer
        nbytes = max(len(send), len(recv))
        if nbytes < self.pacing.polite_min_bytes:
            self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)
            return COMPLETED
        # Pieces of the same source, tag and communicator match in the order they were
        # posted (MPI's non-overtaking rule), so both sides need only cut alike.
        requests = [self.comm.Irecv(piece, source, recvtag) for piece in _pieces(recv)]
        requests += [self.comm.Isend(piece, dest, sendtag) for piece in _pieces(send)]
        return PendingTransfer(requests, self.pacing, nbytes * self.pacing.seconds_per_byte)

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        self.comm.Allreduce(sendbuf, recvbuf, op)

    def Bcast(self, buf, root: int = 0) -> None:
        self.comm.Bcast(buf, root=root)

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        self.comm.Allgatherv(sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        self.comm.Alltoallv(sendbuf, recvbuf)
