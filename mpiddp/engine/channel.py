"""The control channel: the few collectives the coordinator itself makes, over any transport.

The engine's protocol (``protocol.py``) needs four operations across ranks. ``MPIChannel``
does them on the engine's private communicator; the tests give fake ranks in one process an
in-memory channel with the same interface (``tests/protocol_fakes.py``).

The one made every cycle, the bit vector's AND, is latency only (a few hundred bytes), and
over MPI it costs the most where the network is TCP: MPI moves a message only while it is
called, so a nonblocking all-reduce tested between sleeps advances one step per test, and a
blocking one busy-polls the cores the other ranks need. Where the engine's transfers across
nodes take its own TCP connections (``engine/transport_choice.py``), the AND goes by
recursive doubling over connections of its own to the recursive-doubling partners
(``use_sockets``): each step's receive blocks in the kernel, the GIL released and no CPU
spent, and returns the moment the partner's bytes arrive. At 16 emulated nodes a 400-byte AND
took 1.3 ms that way against 1.7 ms for ``Iallreduce`` with the engine's waiting and 1.9 ms
for a blocking ``MPI_Allreduce`` (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import numpy as np
from mpi4py import MPI

from ..collectives.recursive_doubling import recursive_doubling


class ControlChannel(Protocol):
    rank: int
    size: int

    def and_reduce(self, message: bytes, wait: Callable[[Callable[[], bool]], None],
                   spin: bool = True) -> bytes:
        """Bitwise AND of every rank's ``message`` (valid until the next call);
        ``wait(test)`` waits for completion; ``spin``: the cycle brought work, the partners
        may answer within microseconds (``WaitPolicy.spin``)."""

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
        self._sockets = None

    def use_sockets(self, sockets) -> None:
        """Reduce the bit vector over ``sockets`` (``PeerSockets`` connected to every rank's
        ``recursive_doubling.partners``) from now on. The same call on every rank, before
        the first cycle: the ranks must agree on how each cycle's AND travels."""
        self._sockets = sockets

    def and_reduce(self, message: bytes, wait, spin: bool = True) -> bytes:
        if self._sockets is not None:       # its receives wait in the kernel
            return self._and_reduce_over_sockets(message, spin)
        if len(self._recv) != len(message):
            self._recv = bytearray(len(message))
        request = self.comm.Iallreduce([message, MPI.BYTE], [self._recv, MPI.BYTE], MPI.BAND)
        wait(request.Test)
        return self._recv               # valid until the next call

    def _and_reduce_over_sockets(self, message: bytes, spin: bool) -> np.ndarray:
        sockets = self._sockets
        result = np.frombuffer(bytearray(message), np.uint8)
        scratch = np.empty_like(result)

        def exchange(dest, send, source, recv):
            sockets.finish(sockets.start(dest, memoryview(send), source, memoryview(recv), []),
                           spin)

        recursive_doubling(exchange, self.rank, self.size, result, scratch,
                           lambda mine, theirs: np.bitwise_and(mine, theirs, out=mine))
        return result

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
