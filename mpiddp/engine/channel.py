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

from functools import partial
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
from mpi4py import MPI

from ..collectives.recursive_doubling import recursive_doubling


def _aligned(offset: int) -> int:
    return (offset + 7) // 8 * 8


class ControlChannel(Protocol):
    rank: int
    size: int

    def and_reduce(self, message: bytes, wait: Callable[[Callable[[], bool]], None],
                   spin: bool = True, sums: Sequence = ()) -> bytes:
        """Bitwise AND of every rank's ``message`` (valid until the next call);
        ``wait(test)`` waits for completion; ``spin``: the cycle brought work, the partners
        may answer within microseconds (``WaitPolicy.spin``). Meanwhile each array of
        ``sums`` (the same shapes on every rank) becomes the sum of every rank's, in place
        (engine/speculation.py)."""

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

    def and_reduce(self, message: bytes, wait, spin: bool = True, sums=()) -> bytes:
        if self._sockets is not None:       # its receives wait in the kernel
            return self._and_reduce_over_sockets(message, spin, sums)
        if len(self._recv) != len(message):
            self._recv = bytearray(len(message))
        request = self.comm.Iallreduce([message, MPI.BYTE], [self._recv, MPI.BYTE], MPI.BAND)
        if sums:
            # Started together, so the two synchronizations overlap: the cycle takes about
            # as long as the bit vector's alone.
            requests = [request] + [self.comm.Iallreduce(MPI.IN_PLACE, array, MPI.SUM)
                                    for array in sums]
            wait(lambda: MPI.Request.Testall(requests))
        else:
            wait(request.Test)
        return self._recv               # valid until the next call

    def _and_reduce_over_sockets(self, message: bytes, spin: bool, sums) -> np.ndarray:
        """The bit vector and ``sums`` in one message, AND on the first, sums on the others,
        each step of recursive doubling (every array placed at a multiple of 8 bytes)."""
        sockets = self._sockets
        places, end = [], _aligned(len(message))
        for array in sums:
            places.append((end, end + array.nbytes, array.dtype))
            end = _aligned(end + array.nbytes)
        combined = np.zeros(end, np.uint8)
        combined[:len(message)] = np.frombuffer(message, np.uint8)
        for array, (start, stop, _) in zip(sums, places):
            combined[start:stop] = array.view(np.uint8)
        scratch = np.empty_like(combined)
        bits = len(message)

        def combine(mine, theirs):
            np.bitwise_and(mine[:bits], theirs[:bits], out=mine[:bits])
            for start, stop, dtype in places:
                into = mine[start:stop].view(dtype)
                np.add(into, theirs[start:stop].view(dtype), out=into)

        recursive_doubling(partial(sockets.exchange, spin=spin), self.rank, self.size,
                           combined, scratch, combine)
        for array, (start, stop, _) in zip(sums, places):
            array.view(np.uint8)[:] = combined[start:stop]
        return combined[:bits]

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
