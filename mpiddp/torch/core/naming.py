"""The rules every collective call shares: how it is named and which root ranks it accepts.

Names identify a collective across ranks: ranks that make the same calls in the same order
get the same generated names (``<kind>.noname.<n>``, one counter per kind and process set,
kept by the running runtime's process-set table).
"""
from __future__ import annotations

import operator
from typing import Optional

from ... import runtime
from ...runtime import ProcessSet


def collective_name(kind: str, name: Optional[str], process_set: Optional[ProcessSet],
                    prefixed: bool = False) -> str:
    """The engine name of one call of ``kind``: the caller's ``name`` (``<kind>.<name>`` when
    ``prefixed``, for calls made of several collectives), or the next generated one in
    ``process_set`` (None: the global set). Collectives of a set are matched among its ranks
    only, so calls in one set never shift the names of another's."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        return f"{kind}.{name}" if prefixed else name
    return runtime.require(f"{kind}()").process_sets.next_name(process_set, kind)


def root_rank(root, size: int, what: str) -> int:
    """``root`` as a rank index: any integer (Python, NumPy, a 0-d integer tensor), never a
    bool, in ``0..size-1``. Raises TypeError or ValueError naming ``what``."""
    try:
        if isinstance(root, bool):
            raise TypeError
        root = operator.index(root)
    except TypeError:
        raise TypeError(f"{what}: root_rank must be an integer rank, not "
                        f"{type(root).__name__}") from None
    if not 0 <= root < size:
        raise ValueError(f"{what}: root_rank={root} is not a rank (0..{size - 1})")
    return root


__all__ = ["collective_name", "root_rank"]
