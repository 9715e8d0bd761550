"""What mpiddp keeps on a user's parameters: references that a pickled copy of the parameter
(``torch.save(model)``) does not carry, where a plain weak reference would make the save fail
(weak references cannot be pickled)."""
from __future__ import annotations

import weakref


class ParameterRef(weakref.ref):
    """A weak reference to the object that owns a parameter (its optimizer's sync); dead in a
    pickled copy of the parameter."""

    __slots__ = ()

    def __reduce__(self):
        return _dead_ref, ()


def _dead_ref():
    return _dead


def _dead() -> None:       # (what a copied ParameterRef gives: nothing)
    return None
