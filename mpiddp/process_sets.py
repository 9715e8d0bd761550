"""Process sets: collectives among a subset of the ranks (Horovod's ``ProcessSet`` API).

Every process set has its own engine (coordinator thread, negotiation, response cache, fusion
buffers) on its own communicator, created by ``add_process_set`` and stopped by
``remove_process_set``: negotiation, fusion and averaging happen within the set, and sets
never wait for each other. Collectives take ``process_set=``; the default is
``global_process_set`` (every rank, the engine ``init()`` starts).

As in Horovod, a collective's ``root_rank`` is always a global rank (``mpiddp.rank()``), even
inside a process set; ``ProcessSet.rank()`` is this process's rank within the set (useful to
read an ``allgather`` result). The sets live in the running runtime's table
(``runtime/process_set_table.py``).
"""
from __future__ import annotations

from typing import Sequence, Union

from . import runtime
from .runtime import ProcessSet, global_process_set

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


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
    table = runtime.require("add_process_set()").process_sets
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return table.add(process_set)


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
    return runtime.require("remove_process_set()").process_sets.remove(process_set)
