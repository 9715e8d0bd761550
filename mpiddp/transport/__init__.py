"""How bytes move: the MPI communicator as it is for host memory, and for device memory
either the same calls on device pointers (CUDA-aware MPI) or host staging (``staging.py``).

The collectives in ``mpiddp/collectives`` only use the calls of ``Transport``, so anything
that offers them (an ``MPI.Comm``, ``staging.DirectComm``, ``staging.StagedComm``) works.
They start each ring step with ``start_sendrecv``: a transport that can leave a transfer in
flight (``network.NetworkComm``) returns it pending, so the caller can work while the network
moves the bytes (the pipelined hierarchical all-reduce); any other completes it at once.
"""
from __future__ import annotations

from .base import (COMPLETED, CommWrapper, Transfer, Transport, overlaps_transfers,
                   start_sendrecv)
from .cuda_aware import mpi_cuda_aware
from .network import NetworkComm
from .pacing import Pacing, pacing_for
from .sockets import PeerSockets
from .staging import device_comm

__all__ = ["Transport", "Transfer", "COMPLETED", "CommWrapper", "overlaps_transfers",
           "start_sendrecv", "transport_for", "Pacing", "pacing_for", "PeerSockets"]


def transport_for(comm, backend, across_nodes: bool = False, pacing: Pacing = Pacing(),
                  sockets: PeerSockets | None = None) -> Transport:
    """The transport for buffers of ``backend`` on ``comm``. Host memory: ``comm`` itself
    within a node; where ``comm``'s ranks span nodes (``across_nodes``), ``NetworkComm``,
    which waits without spinning where the link allows (``network.py``, as ``pacing``
    says), whose steps to partners on other nodes take ``sockets`` where given
    (``sockets.py``). Device memory: a direct or staging wrapper,
    decided at ``init()`` from the CUDA-aware probe (``cuda_aware.mpi_cuda_aware()``). The
    caller keeps what it gets (the engine's executor, once per communicator and backend):
    staging wrappers hold their pinned buffers."""
    if backend.device_type == "cpu":
        return NetworkComm(comm, pacing, sockets) if across_nodes else comm
    return device_comm(comm, mpi_cuda_aware(), backend.copier())
