"""Where the ranks of a communicator sit: one ``Topology`` value per communicator.

A node is the set of ranks that share memory (``MPI_COMM_TYPE_SHARED``). The node-local
communicator holds them in the order of the launcher's local ranks where it gives them
(``launcher_env.py``), else by rank: the device was chosen at import from the
launcher's local rank, and ``local_rank()`` must say the same (Open MPI numbers the ranks of a
node in its mapping's order, which need not be theirs: 3 ranks on a 2-core node got 0, 2, 1).
The cross-node communicator holds the ranks with the same local rank on every node.
Everything that depends on the layout (the public ``local_rank()`` & co., the algorithm
choice, the hierarchical all-reduce) reads it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mpi4py import MPI

from ..launcher_env import launcher_local_rank


@dataclass(frozen=True)
class Topology:
    """This rank's place in a communicator (plain numbers: the same layout on every rank)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    uniform: bool           # every node has ``local_size`` ranks

    @property
    def spans_nodes(self) -> bool:
        """Whether the ranks sit on more than one node."""
        return self.local_size < self.size

    @property
    def hierarchical_usable(self) -> bool:
        """Whether the hierarchical all-reduce applies: several nodes, several ranks on each,
        the same number on every node (the cross-node groups then line up with the chunks)."""
        return self.uniform and self.local_size > 1 and self.spans_nodes

    @classmethod
    def single(cls) -> "Topology":
        """One rank alone (tests, and communicators of size 1)."""
        return cls(0, 1, 0, 1, 0, 1, True)


class NodeLayout(NamedTuple):
    """A communicator split by node: the two communicators and the topology they give."""

    local: MPI.Comm
    cross: MPI.Comm
    topology: Topology


def node_layout(comm: MPI.Comm) -> NodeLayout:
    """Split ``comm`` into node-local and cross-node communicators (a collective of ``comm``);
    the caller owns both (``Free`` them when done)."""
    rank = comm.Get_rank()
    launcher = launcher_local_rank()
    # Ties (ranks without the variable) fall back to the rank order within the split.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=launcher[0] if launcher else rank)
    cross = comm.Split(color=local.Get_rank(), key=rank)
    uniform = len(set(comm.allgather(local.Get_size()))) == 1
    topology = Topology(rank, comm.Get_size(), local.Get_rank(), local.Get_size(),
                        cross.Get_rank(), cross.Get_size(), uniform)
    return NodeLayout(local, cross, topology)
