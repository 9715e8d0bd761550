"""The sharded optimizers (``zero_stage``) alive in this process, for ``join()`` to refuse."""
from __future__ import annotations

import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()


def register(sync) -> None:
    """Note a ``ShardedSync`` (forgotten when it is collected)."""
    _live.add(sync)


def live_sharded_optimizers() -> list[str]:
    """The prefixes of this process's sharded optimizers still alive."""
    return sorted(sync.prefix for sync in _live)
