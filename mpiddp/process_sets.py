"""Process sets: collectives among a subset of the ranks (Horovod's ``ProcessSet`` API).

Every process set has its own engine (coordinator thread, negotiation, response cache, fusion
buffers) on its own communicator, created by ``add_process_set`` and stopped by
``remove_process_set``: negotiation, fusion and averaging happen within the set, and sets
never wait for each other. Collectives take ``process_set=``; the default is
``global_process_set`` (every rank, the engine ``init()`` starts).

As in Horovod, a collective's ``root_rank`` is always a global rank (``mpiddp.rank()``), even
inside a process set; ``ProcessSet.rank()`` is this process's rank within the set (useful to
read an ``allgather`` result).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from mpi4py import MPI

from . import runtime
from .engine.coordinator import Engine, start_engine

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of ranks that run collectives together.

    Args:
        ranks_or_comm: the global ranks of the set (any order; duplicates are an error), or
            an ``mpi4py`` communicator whose members form the set.

    Raises:
        ValueError: ranks that are not integers, or repeated; neither ranks nor a
            communicator.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], MPI.Comm]):
        self.process_set_id: Optional[int] = None
        self.mpi_comm: Optional[MPI.Comm] = None
        self.ranks: Optional[list] = None
        self._engine: Optional[Engine] = None
        self._comm: Optional[MPI.Comm] = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, not "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, not {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks {ranks} repeat a rank")
        self.ranks = ranks

    def size(self) -> Optional[int]:
        """The number of ranks in the set, or None before it is added.

        Returns:
            The set's size (``mpiddp.size()`` for the global set), or None.
        """
        if self.process_set_id is None:
            return None
        return runtime.size() if self.process_set_id == 0 else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None before it is added, or outside it).

        Returns:
            The index of ``mpiddp.rank()`` in the set's sorted ranks, or None.
        """
        if self.process_set_id == 0:
            return runtime.rank()
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(runtime.rank())

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None when its ranks are not known yet).

        Returns:
            True when ``mpiddp.rank()`` is one of the set's ranks.
        """
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return runtime.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_sets: dict[int, ProcessSet] = {}
_next_id = 1
_control: Optional[MPI.Comm] = None     # private duplicate for adding and removing sets


def _control_comm() -> MPI.Comm:
    global _control
    if _control is None:
        _control = runtime.require("add_process_set()").comm.Dup()
    return _control


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Create a process set: a collective of every rank, which must all pass the same ranks
    (in the same order of calls). Ranks outside the set take part too, and get the set back
    with ``included()`` False.

    Args:
        process_set: a ``ProcessSet`` made from ranks, or the ranks themselves.

    Returns:
        The set, with its ``process_set_id`` (the same on every rank).

    Raises:
        ValueError: ranks out of ``0..size()-1``; ranks that differ across the calling ranks
            (named per rank); a set with the same ranks exists already (or is the global one);
            a ``ProcessSet`` made from a communicator (not supported after ``init()``, as in
            Horovod).
        NotInitializedError: before ``init()``.
    """
    global _next_id
    rt = runtime.require("add_process_set()")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise ValueError("adding a process set made from an MPI communicator after init() is "
                         "not supported; build it from a list of ranks")
    size, me = rt.comm.Get_size(), rt.comm.Get_rank()
    comm = _control_comm()
    everyone = comm.allgather(process_set.ranks)
    differing = [r for r, ranks in enumerate(everyone) if ranks != everyone[0]]
    if differing:
        raise ValueError(f"add_process_set: ranks disagree on the set: rank 0 passed "
                         f"{everyone[0]}, rank {differing[0]} passed {everyone[differing[0]]}")
    ranks = process_set.ranks
    if any(not 0 <= r < size for r in ranks) or not ranks:
        raise ValueError(f"add_process_set: ranks {ranks} must be a non-empty subset of "
                         f"0..{size - 1}")
    if ranks == list(range(size)) or any(s.ranks == ranks for s in _sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    sub = comm.Split(0 if me in ranks else MPI.UNDEFINED, me)
    process_set.process_set_id = _next_id
    _next_id += 1
    if sub != MPI.COMM_NULL:
        process_set._comm = sub
        process_set._engine = start_engine(sub, rt.settings)
    _sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added by ``add_process_set``: a collective of every rank. Its
    engine stops (collectives of the set still in flight fail with ``EngineShutdownError``).

    Args:
        process_set: the set to remove.

    Returns:
        True when it was removed; False for the global set or a set never added (or removed
        already).

    Raises:
        NotInitializedError: before ``init()``.
    """
    runtime.require("remove_process_set()")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or _sets.get(set_id) is not process_set:
        return False
    _stop(process_set, "remove_process_set() was called")
    del _sets[set_id]
    _control_comm().Barrier()           # every rank has let go of the set before it returns
    return True


def _stop(process_set: ProcessSet, reason: str) -> None:
    if process_set._engine is not None:
        process_set._engine.shutdown(reason)
        process_set._comm.Free()
    process_set._engine = process_set._comm = None
    process_set.process_set_id = None


def engine_for(process_set: Optional[ProcessSet], what: str) -> tuple[Engine, Any]:
    """(engine, set) for a collective ``what`` on ``process_set`` (None: the global set).

    Raises:
        ValueError: the set was never added (or was removed), or this rank is not in it.
        NotInitializedError, EngineShutdownError: as ``runtime.require_engine``.
    """
    if process_set is None or process_set.process_set_id == 0:
        return runtime.require_engine(what), global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, not "
                        f"{type(process_set).__name__}")
    runtime.require(what)
    if process_set.process_set_id is None or \
            _sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{what}: {process_set} has not been added (add_process_set) or was "
                         "removed")
    if process_set._engine is None:
        raise ValueError(f"{what}: rank {runtime.rank()} is not in {process_set}; only its "
                         "ranks may run collectives on it")
    return process_set._engine, process_set


def set_size(process_set: Optional[ProcessSet]) -> int:
    """The number of ranks in ``process_set`` (None: the global set, every rank)."""
    return runtime.size() if process_set is None else process_set.size()


def set_id(process_set: Optional[ProcessSet]) -> int:
    """The id of ``process_set`` (None: the global set's, 0); generated collective names
    count per id (``torch/naming.collective_name``'s scope)."""
    return 0 if process_set is None else process_set.process_set_id


def set_rank_of(process_set: ProcessSet, global_rank: int, what: str) -> int:
    """A global rank (as ``root_rank`` is given) as a rank of ``process_set``'s engine."""
    if process_set.process_set_id == 0:
        return global_rank
    if global_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank={global_rank} is not in {process_set}")
    return process_set.ranks.index(global_rank)


def shutdown_all() -> None:
    """Stop every process set's engine (``mpiddp.shutdown()``)."""
    global _control, _next_id
    for process_set in list(_sets.values()):
        _stop(process_set, "shutdown() was called")
    _sets.clear()
    _next_id = 1
    if _control is not None:
        _control.Free()
        _control = None
