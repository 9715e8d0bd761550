"""Transfers across nodes without burning the core that backward needs.

MPI's blocking calls busy-poll until they complete. Within a node that is what moves the data
(shared-memory copies happen inside the polling), but across nodes the kernel moves it: a
blocking ``MPI_Sendrecv`` of a gradient chunk over a 1 Gbit/s link spins a core for the whole
wire time. Measured on the emulated cluster (2 nodes x 1 rank, ResNet-18): mpiddp used 684 ms
of CPU per step against DDP's 398 ms, the difference being the wire time, and that spinning
coordinator took the core from backward, so nothing was hidden (docs/benchmarks.md).

``NetworkComm`` gives the collectives the same calls (``Transport``) on a communicator whose
ranks sit on different nodes, made of nonblocking MPI calls completed by ``wait_politely``:
a short spin (a small message answers within it), then tests separated by sleeps growing to
``MAX_SLEEP_SECONDS``, short enough that the socket buffers never run dry at network speeds.
"""
from __future__ import annotations

import time
from typing import Callable

from mpi4py import MPI

SPIN_SECONDS = 100e-6
FIRST_SLEEP_SECONDS = 10e-6
MAX_SLEEP_SECONDS = 250e-6


def wait_politely(test: Callable[[], bool], spin: float = SPIN_SECONDS,
                  max_sleep: float = MAX_SLEEP_SECONDS, long_after: float = float("inf"),
                  long_sleep: float = MAX_SLEEP_SECONDS) -> None:
    """Wait until ``test()`` is true: spin for ``spin`` seconds, then test with sleeps
    doubling from 10 us to ``max_sleep``, and to ``long_sleep`` once the wait has lasted
    ``long_after`` seconds (a partner that arrives is noticed within one sleep)."""
    start = time.perf_counter()
    if spin > 0:
        while time.perf_counter() - start < spin:
            if test():
                return
    sleep, cap = FIRST_SLEEP_SECONDS, max_sleep
    while not test():
        time.sleep(sleep)
        if sleep < cap:
            sleep = min(sleep * 2, cap)
        elif cap < long_sleep and time.perf_counter() - start > long_after:
            cap = long_sleep


def _wait_all(requests: list) -> None:
    wait_politely(lambda: MPI.Request.Testall(requests))


class NetworkComm:
    """``Transport`` on an MPI communicator that spans nodes: nonblocking calls, polite waits."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Get_size(self) -> int:
        return self.comm.Get_size()

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None) -> None:
        _wait_all([self.comm.Irecv(recvbuf, source, recvtag),
                   self.comm.Isend(sendbuf, dest, sendtag)])

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        _wait_all([self.comm.Iallreduce(sendbuf, recvbuf, op)])

    def Bcast(self, buf, root: int = 0) -> None:
        _wait_all([self.comm.Ibcast(buf, root=root)])

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        _wait_all([self.comm.Iallgatherv(sendbuf, recvbuf)])

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        _wait_all([self.comm.Ialltoallv(sendbuf, recvbuf)])
