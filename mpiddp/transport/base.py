"""The calls the collectives use (``Transport``), a started exchange (``Transfer``), and the
base of the transports that wrap an MPI communicator."""
from __future__ import annotations

from typing import Any, Protocol


class Transport(Protocol):
    """The communicator calls the collectives use (mpi4py's buffer-based signatures)."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = 0, recvtag: int = 0, status: Any = None) -> None: ...

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None: ...

    def Bcast(self, buf: Any, root: int = 0) -> None: ...

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None: ...

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None: ...


class Transfer(Protocol):
    """A started exchange; ``wait()`` completes it."""

    def wait(self) -> None: ...


class _Completed:
    """An exchange that finished when it was started."""

    def wait(self) -> None:
        pass


COMPLETED: Transfer = _Completed()


def overlaps_transfers(transport) -> bool:
    """Whether ``start_sendrecv`` on ``transport`` can return before the bytes have moved."""
    return hasattr(transport, "start_sendrecv")


def start_sendrecv(transport, sendbuf: Any, dest: int, recvbuf: Any, source: int,
                   tag: int) -> Transfer:
    """Send ``sendbuf`` to ``dest`` and receive ``recvbuf`` from ``source`` (same ``tag``):
    left in flight where the transport can (``overlaps_transfers``), else done here."""
    if overlaps_transfers(transport):
        return transport.start_sendrecv(sendbuf, dest, recvbuf, source, tag)
    transport.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)
    return COMPLETED


class CommWrapper:
    """Base of the transports that wrap an MPI communicator: its rank and size are theirs."""

    def __init__(self, comm):
        self.comm = comm

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Get_size(self) -> int:
        return self.comm.Get_size()
