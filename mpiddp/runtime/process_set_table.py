"""Process sets (Horovod's ``ProcessSet``) and the table a runtime keeps of them.

Every process set has its own engine (coordinator thread, negotiation, response cache, fusion
buffers) on its own communicator: negotiation, fusion and averaging happen within the set, and
sets never wait for each other. The global set (every rank) is entry 0 of the table, with the
engine ``init()`` starts; the others are added and removed by the collectives
``add_process_set`` / ``remove_process_set``. Generated collective names count per set, so
that calls in one set never shift the names of another's.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

from mpi4py import MPI

from ..config import Settings
from ..engine.coordinator import Engine

GLOBAL_ID = 0


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
        # Set while the set is in a running runtime's table:
        self._engine: Optional[Engine] = None     # None: this rank is not in the set
        self._comm: Optional[MPI.Comm] = None     # the set's communicator (added sets)
        self._rank: Optional[int] = None          # this process's rank within the set
        self._names: dict = {}                     # kind -> counter of generated names
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
        """The number of ranks in the set, or None before it is added (for the global set:
        before ``init()``).

        Returns:
            The set's size (``mpiddp.size()`` for the global set), or None.
        """
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None before it is added, or outside it).

        Returns:
            The index of ``mpiddp.rank()`` in the set's sorted ranks, or None.
        """
        return self._rank

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None when that is not known yet: before
        it is added, or for the global set before ``init()``).

        Returns:
            True when ``mpiddp.rank()`` is one of the set's ranks.
        """
        if self.process_set_id is None or self.ranks is None:
            return None
        return self._rank is not None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


# Every rank, always id 0; its ranks and engine are those of the running runtime.
global_process_set = ProcessSet([])
global_process_set.process_set_id = GLOBAL_ID
global_process_set.ranks = None


class ProcessSetTable:
    """The process sets of one runtime, by id; id 0 is the global set.

    ``start_engine(comm, settings)`` makes the engine of an added set (the production engine;
    injected so that this module depends on the engine's interface only)."""

    def __init__(self, comm: MPI.Comm, engine: Engine, settings: Settings,
                 start_engine: Callable[[MPI.Comm, Settings], Engine]):
        self._comm = comm
        self._settings = settings
        self._start_engine = start_engine
        self._control: Optional[MPI.Comm] = None     # private duplicate for add/remove
        self._lock = threading.Lock()                 # generated names: any user thread
        self._next_id = GLOBAL_ID + 1
        rank, size = comm.Get_rank(), comm.Get_size()
        self._register(global_process_set, GLOBAL_ID, list(range(size)), engine, None, rank)
        self._sets: dict[int, ProcessSet] = {GLOBAL_ID: global_process_set}

    @staticmethod
    def _register(process_set: ProcessSet, set_id: int, ranks: list, engine, comm,
                  rank: Optional[int]) -> None:
        process_set.process_set_id = set_id
        process_set.ranks = ranks
        process_set._engine, process_set._comm, process_set._rank = engine, comm, rank
        process_set._names = {}

    @staticmethod
    def _release(process_set: ProcessSet, reason: str, keep_id: bool = False) -> None:
        if process_set._comm is not None:           # an added set's own engine and comm
            process_set._engine.shutdown(reason)
            process_set._comm.Free()
        process_set._engine = process_set._comm = process_set._rank = None
        process_set._names = {}
        if keep_id:
            process_set.ranks = None
        else:
            process_set.process_set_id = None

    def _control_comm(self) -> MPI.Comm:
        if self._control is None:
            self._control = self._comm.Dup()
        return self._control

    def add(self, process_set: ProcessSet) -> ProcessSet:
        """See ``mpiddp.add_process_set`` (a collective of every rank)."""
        if process_set.ranks is None:
            raise ValueError("adding a process set made from an MPI communicator after init() "
                             "is not supported; build it from a list of ranks")
        size, me = self._comm.Get_size(), self._comm.Get_rank()
        control = self._control_comm()
        everyone = control.allgather(process_set.ranks)
        differing = [r for r, ranks in enumerate(everyone) if ranks != everyone[0]]
        if differing:
            raise ValueError(f"add_process_set: ranks disagree on the set: rank 0 passed "
                             f"{everyone[0]}, rank {differing[0]} passed "
                             f"{everyone[differing[0]]}")
        ranks = process_set.ranks
        if any(not 0 <= r < size for r in ranks) or not ranks:
            raise ValueError(f"add_process_set: ranks {ranks} must be a non-empty subset of "
                             f"0..{size - 1}")
        if any(s.ranks == ranks for s in self._sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        sub = control.Split(0 if me in ranks else MPI.UNDEFINED, me)
        engine = comm = rank = None
        if sub != MPI.COMM_NULL:
            comm, rank = sub, ranks.index(me)
            # Autotune searches the global engine's settings only (one search, one log).
            engine = self._start_engine(sub, replace(self._settings, autotune=False))
        self._register(process_set, self._next_id, ranks, engine, comm, rank)
        self._sets[self._next_id] = process_set
        self._next_id += 1
        return process_set

    def remove(self, process_set: ProcessSet) -> bool:
        """See ``mpiddp.remove_process_set`` (a collective of every rank)."""
        set_id = process_set.process_set_id
        if set_id is None or set_id == GLOBAL_ID or self._sets.get(set_id) is not process_set:
            return False
        self._release(process_set, "remove_process_set() was called")
        del self._sets[set_id]
        self._control_comm().Barrier()   # every rank has let go of the set before it returns
        return True

    def engine_for(self, process_set: Optional[ProcessSet], what: str
                   ) -> tuple[Engine, ProcessSet]:
        """(engine, set) for a collective ``what`` on ``process_set`` (None: the global set).

        Raises:
            TypeError: ``process_set`` is not a ProcessSet.
            ValueError: the set was never added (or was removed), or this rank is not in it.
        """
        if process_set is None:
            process_set = global_process_set
        elif not isinstance(process_set, ProcessSet):
            raise TypeError(f"{what}: process_set must be a ProcessSet, not "
                            f"{type(process_set).__name__}")
        set_id = process_set.process_set_id
        if set_id is None or self._sets.get(set_id) is not process_set:
            raise ValueError(f"{what}: {process_set} has not been added (add_process_set) or "
                             "was removed")
        if process_set._engine is None:
            raise ValueError(f"{what}: rank {self._comm.Get_rank()} is not in {process_set}; "
                             "only its ranks may run collectives on it")
        return process_set._engine, process_set

    def rank_in_set(self, process_set: Optional[ProcessSet], global_rank: int,
                    what: str) -> int:
        """A global rank (as ``root_rank`` is given, Horovod's convention) as a rank of the
        set's engine. Raises ValueError when it is not in the set."""
        ranks = (process_set or global_process_set).ranks
        if global_rank not in ranks:
            raise ValueError(f"{what}: root_rank={global_rank} is not in {process_set}")
        return ranks.index(global_rank)

    def next_name(self, process_set: Optional[ProcessSet], kind: str) -> str:
        """The next generated name of a ``kind`` collective in ``process_set``: ranks that
        make the same calls in the same order get the same names."""
        process_set = process_set or global_process_set
        with self._lock:
            counter = process_set._names.get(kind)
            if counter is None:
                counter = process_set._names[kind] = itertools.count()
            return f"{kind}.noname.{next(counter)}"

    def engines(self) -> list[tuple[int, Engine]]:
        """(set id, engine) of every set this rank is in, by id (the global set first)."""
        return [(set_id, process_set._engine) for set_id, process_set in
                sorted(self._sets.items()) if process_set._engine is not None]

    def close(self, reason: str) -> None:
        """Stop every added set's engine and forget every set (the global set's engine is the
        runtime's own, stopped by the runtime)."""
        for process_set in list(self._sets.values()):
            self._release(process_set, reason, keep_id=process_set is global_process_set)
        self._sets.clear()
        if self._control is not None:
            self._control.Free()
            self._control = None
