"""The control channel: the few collectives the coordinator itself makes, over any transport.

The engine's protocol (``protocol.py``) needs four operations across ranks. ``MPIChannel``
does them on the engine's private communicator; the tests give fake ranks in one process an
in-memory channel with the same interface (``tests/protocol_fakes.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from mpi4py import MPI


class ControlChannel(Protocol):
    rank: int
    size: int

    def and_reduce(self, message: bytes, wait: Callable[[Callable[[], bool]], None]) -> bytes:
        """Bitwise AND of every rank's ``message`` (valid until the next call);
        ``wait(test)`` waits for completion."""

    def gather_to_root(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""

    def broadcast_from_root(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def max(self, value: Any) -> Any:
        """The largest of every rank's ``value``."""

    def abort(self) -> None:
        """End the whole job (the coordinator failed: the other ranks would hang)."""

    def close(self) -> None:
        """Release the channel (after the ranks agreed to stop)."""


class MPIChannel:
    """``ControlChannel`` on an MPI communicator (the engine's private duplicate)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._recv = bytearray()

    def and_reduce(self, message: bytes, wait) -> bytes:
        if len(self._recv) != len(message):
            self._recv = bytearray(len(message))
        request = self.comm.Iallreduce([message, MPI.BYTE], [self._recv, MPI.BYTE], MPI.BAND)
        wait(request.Test)
        return self._recv               # valid until the next call

    def gather_to_root(self, obj):
        return self.comm.gather(obj, root=0)

    def broadcast_from_root(self, obj):
        return self.comm.bcast(obj, root=0)

    def max(self, value):
        return self.comm.allreduce(value, op=MPI.MAX)

    def abort(self) -> None:
        MPI.COMM_WORLD.Abort(1)

    def close(self) -> None:
        self.comm.Free()
