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
for a blocking ``MPI_Allreduce`` (docs/dev/benchmark-record.md).
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


class _SocketMessage:
    """One layout of the cycle's message over the sockets (the bit vector's length, the sums'
    sizes and types): its buffer, the scratch recursive doubling receives into, and their
    views, made once and reused while the layout stays (every cycle takes this path)."""

    def __init__(self, bits: int, sums: Sequence):
        self.bits, places, end = bits, [], _aligned(bits)
        for array in sums:
            places.append((end, end + array.nbytes, array.dtype))
            end = _aligned(end + array.nbytes)
        self.buffer = np.zeros(end, np.uint8)      # the padding stays zero
        self.scratch = np.empty_like(self.buffer)
        self.places = [(start, stop) for start, stop, _ in places]
        self._pairs = [(self.buffer[start:stop].view(dtype), self.scratch[start:stop].view(dtype))
                       for start, stop, dtype in places]
        self._bits_pair = (self.buffer[:bits], self.scratch[:bits])

    def fill(self, message: bytes, sums: Sequence) -> np.ndarray:
        buffer = self.buffer
        buffer[:self.bits] = np.frombuffer(message, np.uint8)
        for array, (start, stop) in zip(sums, self.places):
            buffer[start:stop] = array.view(np.uint8)
        return buffer

    def combine(self, mine: np.ndarray, theirs: np.ndarray) -> None:
        """``recursive_doubling``'s fold, always of the scratch into the buffer."""
        assert mine is self.buffer and theirs is self.scratch
        own, other = self._bits_pair
        np.bitwise_and(own, other, out=own)
        for into, addend in self._pairs:
            np.add(into, addend, out=into)

    def result(self, sums: Sequence) -> np.ndarray:
        """Copy the sums out; return the AND of the bit vectors (valid until the next
        cycle)."""
        for array, (start, stop) in zip(sums, self.places):
            array.view(np.uint8)[:] = self.buffer[start:stop]
        return self._bits_pair[0]


class MPIChannel:
    """``ControlChannel`` on an MPI communicator (the engine's private duplicate)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._recv = bytearray()
        self._sockets = None
        self._shape = None              # the cycle message's layout over the sockets
        self._message: Optional[_SocketMessage] = None

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
        shape = (len(message),) + tuple((array.nbytes, array.dtype) for array in sums)
        if shape != self._shape:        # the buffers and views of a cycle's message, kept
            self._shape, self._message = shape, _SocketMessage(len(message), sums)
        combined = self._message.fill(message, sums)
        recursive_doubling(partial(self._sockets.exchange, spin=spin), self.rank, self.size,
                           combined, self._message.scratch, self._message.combine)
        return self._message.result(sums)

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
