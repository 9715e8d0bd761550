"""Whether the collectives' steps across nodes take mpiddp's own TCP sockets or stay on MPI.

``MPIDDP_SOCKET_TRANSPORT``: ``0`` keeps MPI; ``1`` opens the sockets (an error if they
cannot connect); ``auto`` (the default) opens them and keeps them only where they move the
start-up probe (``PROBE_LARGE_BYTES`` with each ring neighbour, timed over both, alternating)
in no more than ``SOCKETS_SLOWER_TOLERATED`` times MPI's time. Over TCP both
fill the same link and the sockets cost less CPU (``transport/sockets.py``); where MPI has
RDMA (InfiniBand, RoCE, Slingshot) it is faster than any socket, and stays. Every rank
takes the same decision (the slowest pair's times, agreed). Where the sockets are kept, the
cycle's bit vector travels over connections of its own too (``channel.py``).
"""
from __future__ import annotations

import logging

import numpy as np
from mpi4py import MPI

from ..collectives.cost_model import PROBE_LARGE_BYTES
from ..collectives import recursive_doubling
from ..collectives.halving_doubling import partners
from ..collectives.ring import neighbours
from ..config import Settings
from ..transport.sockets import PeerSockets

log = logging.getLogger("mpiddp")

SOCKETS_SLOWER_TOLERATED = 1.1


def exchange_partners(rank: int, size: int) -> set[int]:
    """Whom ``rank`` exchanges with in the engine's own algorithms (the ring and
    halving-doubling; the hierarchical one runs rings on its sub-communicators)."""
    return neighbours(rank, size) | partners(rank, size)


def open_partner_sockets(comm: MPI.Comm, local: MPI.Comm, cross: MPI.Comm,
                      settings: Settings) -> dict:
    """The partner sockets of the whole communicator and of the cross-node one, as
    ``{"whole": PeerSockets, "cross": PeerSockets, "control": PeerSockets}`` ({} where MPI
    keeps the transfers): connections to the ring's neighbours and the halving-doubling
    partners that are on other nodes, and, for the control channel's bit vector, to every
    recursive-doubling partner on any node (its own connections: a cycle's AND must not
    queue behind a transfer's bytes). Collective on ``comm`` (and ``local``, ``cross``)."""
    mode = settings.socket_transport
    if mode == "0":
        return {}
    interfaces = [name.strip() for name in settings.socket_ifname.split(",") if name.strip()]
    required = mode == "1"
    cross_sockets = PeerSockets.connect(cross, exchange_partners(cross.Get_rank(),
                                                                 cross.Get_size()),
                                        interfaces, required)
    # Every rank of ``comm`` joins the agreements (its cross-node group may have failed
    # to connect where another's did not).
    probed = cross_sockets.probe_seconds(PROBE_LARGE_BYTES) \
        if cross_sockets is not None and not required else (0.0, 0.0)
    slowest = np.empty(2)
    comm.Allreduce(np.array(probed, dtype=np.float64), slowest, op=MPI.MAX)
    socket_s, mpi_s = slowest
    keep = cross_sockets is not None
    if not required:
        keep = keep and socket_s <= SOCKETS_SLOWER_TOLERATED * mpi_s
        if comm.Get_rank() == 0 and socket_s > 0:
            log.info("mpiddp: %d MiB with the ring neighbours took %.2f ms over TCP sockets "
                     "and %.2f ms over MPI: transfers across nodes go over %s",
                     PROBE_LARGE_BYTES >> 20, socket_s * 1e3, mpi_s * 1e3,
                     "the sockets" if keep else "MPI")
    keep = bool(comm.allreduce(int(keep), op=MPI.MIN))
    if not keep:
        if cross_sockets is not None:
            cross_sockets.close()
        return {}
    # The node of each rank of ``comm``: its node's first rank (neighbours on one node keep
    # MPI's shared memory).
    node_of = comm.allgather(local.bcast(comm.Get_rank(), root=0))
    rank = comm.Get_rank()
    across = {p for p in exchange_partners(rank, comm.Get_size()) if node_of[p] != node_of[rank]}
    whole = PeerSockets.connect(comm, across, interfaces, required)
    control = PeerSockets.connect(comm, recursive_doubling.partners(rank, comm.Get_size()),
                                  interfaces, required) if whole is not None else None
    if control is None:
        for sockets in (whole, cross_sockets):
            if sockets is not None:
                sockets.close()
        return {}
    return {"whole": whole, "cross": cross_sockets, "control": control}
