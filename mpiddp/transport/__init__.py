"""How bytes move: the MPI communicator as it is for host memory, and for device memory
either the same calls on device pointers (CUDA-aware MPI) or host staging (``staging.py``).

The collectives in ``mpiddp/collectives`` only use the calls of ``Transport``, so anything
that offers them (an ``MPI.Comm``, ``staging.DirectComm``, ``staging.StagedComm``) works.
They start each ring step with ``start_sendrecv``: a transport that can leave a transfer in
flight (``network.NetworkComm``) returns it pending, so the caller can work while the network
moves the bytes (the pipelined hierarchical all-reduce); any other completes it at once.
"""
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


_device_transports: dict = {}
_network_transports: dict = {}


def transport_for(comm, backend, across_nodes: bool = False) -> Transport:
    """The transport for buffers of ``backend`` on ``comm``. Host memory: ``comm`` itself
    within a node; where ``comm``'s ranks span nodes (``across_nodes``), ``NetworkComm``,
    which waits without spinning (``network.py``). Device memory: a direct or staging wrapper,
    made once per communicator and device (decided at ``init()`` from the CUDA-aware probe,
    ``cuda_aware.mpi_cuda_aware()``)."""
    if backend.device_type == "cpu":
        if not across_nodes:
            return comm                 # host memory: the communicator as it is
        network = _network_transports.get(id(comm))
        if network is None or network.comm is not comm:
            from .network import NetworkComm

            network = _network_transports[id(comm)] = NetworkComm(comm)
        return network
    copier = backend.copier()
    key = (id(comm), copier.device_id)
    transport = _device_transports.get(key)
    if transport is None or transport[0] is not comm:
        from .cuda_aware import mpi_cuda_aware
        from .staging import device_comm

        transport = (comm, device_comm(comm, mpi_cuda_aware(), copier))
        _device_transports[key] = transport
    return transport[1]
