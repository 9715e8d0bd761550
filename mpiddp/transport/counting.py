"""Bytes on the wire: a transport wrapper that counts what each call hands to the network.

Every byte the engine's collectives move goes through a ``Transport`` call (the ring's steps,
halving-doubling, the hierarchical all-reduce's node-local and cross-node parts, Adasum, MPI's
own collectives) or the TCP connections' ``exchange`` (recursive doubling). The executor wraps
each transport it hands out (``counted``) and the connections (``CountedPeers``), so the
counts cover every algorithm, over MPI, host staging or mpiddp's own sockets alike.

What counts, per call on this rank (``counter.sent_bytes`` / ``counter.received_bytes``):

* a point-to-point exchange (``Sendrecv``, ``start_sendrecv``, ``exchange``): the bytes of
  its send buffer and of its receive buffer;
* MPI's own collectives, which move bytes the library's own way: the payload that must leave
  this rank for the others and reach it from them. ``Allreduce``: the buffer each way;
  ``Bcast``: the buffer sent by the root, received by the others; ``Allgatherv``: this rank's
  part sent, the others' parts received; ``Alltoallv``: the parts for and from the other
  ranks. Nothing on a communicator of one rank.
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .base import overlaps_transfers


def _nbytes(array) -> int:
    nbytes = getattr(array, "nbytes", None)
    return int(nbytes) if nbytes is not None else memoryview(array).nbytes


def _itemsize(array) -> int:
    itemsize = getattr(array, "itemsize", None)
    return int(itemsize) if itemsize is not None else memoryview(array).itemsize


def spec_bytes(spec: Any) -> int:
    """The bytes an mpi4py buffer specification names: an array, ``[array, datatype]``,
    ``[array, count(s), (displs,) datatype]`` (counts in datatype units), or nothing."""
    if spec is None or spec is MPI.IN_PLACE:
        return 0
    if not isinstance(spec, (list, tuple)):
        return _nbytes(spec)
    parts = part_bytes(spec)
    return sum(parts) if parts is not None else _nbytes(spec[0])


def part_bytes(spec: Any):
    """The bytes of each rank's part of a v-collective's specification (its counts), or None
    where the specification gives no counts."""
    if not isinstance(spec, (list, tuple)) or len(spec) < 2 or \
            isinstance(spec[1], MPI.Datatype):
        return None
    counts = spec[1]
    extent = spec[-1].Get_size() if isinstance(spec[-1], MPI.Datatype) else _itemsize(spec[0])
    if isinstance(counts, int):
        return [counts * extent]
    return [int(c) * extent for c in counts]


class Counted:
    """``transport`` with every call's bytes added to ``counter`` (its ``sent_bytes`` and
    ``received_bytes``); anything else passes through. Made by ``counted``."""

    def __init__(self, transport, counter):
        self.transport = transport
        self.counter = counter
        self.rank, self.size = transport.Get_rank(), transport.Get_size()

    def __getattr__(self, name):
        if name == "transport":             # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.transport, name)

    def _count(self, sent: int, received: int) -> None:
        counter = self.counter
        counter.sent_bytes += sent
        counter.received_bytes += received

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None) -> None:
        self._count(spec_bytes(sendbuf), spec_bytes(recvbuf))
        self.transport.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        if self.size > 1:
            nbytes = spec_bytes(recvbuf)
            self._count(nbytes, nbytes)
        self.transport.Allreduce(sendbuf, recvbuf, op)

    def Bcast(self, buf, root: int = 0) -> None:
        if self.size > 1:
            nbytes = spec_bytes(buf)
            self._count(nbytes, 0) if self.rank == root else self._count(0, nbytes)
        self.transport.Bcast(buf, root=root)

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        if self.size > 1:
            parts = part_bytes(recvbuf)
            whole = sum(parts) if parts is not None else spec_bytes(recvbuf)
            mine = parts[self.rank] if parts is not None else spec_bytes(sendbuf)
            self._count(mine, whole - mine)
        self.transport.Allgatherv(sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        if self.size > 1:
            sent, received = part_bytes(sendbuf), part_bytes(recvbuf)
            self._count(sum(sent) - sent[self.rank], sum(received) - received[self.rank])
        self.transport.Alltoallv(sendbuf, recvbuf)


class CountedOverlapping(Counted):
    """``Counted`` for a transport that leaves exchanges in flight (``start_sendrecv``)."""

    def start_sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int):
        self._count(spec_bytes(sendbuf), spec_bytes(recvbuf))
        return self.transport.start_sendrecv(sendbuf, dest, recvbuf, source, tag)


def counted(transport, counter) -> Counted:
    """``transport`` counting its bytes into ``counter``; it overlaps transfers exactly where
    ``transport`` does (``base.overlaps_transfers``)."""
    cls = CountedOverlapping if overlaps_transfers(transport) else Counted
    return cls(transport, counter)


class CountedPeers:
    """The TCP connections (``sockets.PeerSockets``) with ``exchange``'s bytes counted."""

    def __init__(self, sockets, counter):
        self.sockets = sockets
        self.counter = counter

    def __getattr__(self, name):
        if name == "sockets":
            raise AttributeError(name)
        return getattr(self.sockets, name)

    def exchange(self, dest: int, send, source: int, recv, spin: bool = True) -> None:
        counter = self.counter
        counter.sent_bytes += _nbytes(send)
        counter.received_bytes += _nbytes(recv)
        self.sockets.exchange(dest, send, source, recv, spin)
