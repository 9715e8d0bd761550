"""The sharded optimizers (``zero_stage``) alive in this process, for ``join()`` to refuse, and
how to tell one (for the callers that must treat it apart: elastic snapshots,
``broadcast_optimizer_state``)."""
from __future__ import annotations

import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()


def register(sync) -> None:
    """Note a ``ShardedSync`` (forgotten when it is collected)."""
    _live.add(sync)


def live_sharded_optimizers() -> list[str]:
    """The prefixes of this process's sharded optimizers still alive."""
    return sorted(sync.prefix for sync in _live)


def zero_stage_of(optimizer) -> int:
    """``optimizer``'s ``zero_stage`` (0 for an unsharded or a plain torch optimizer)."""
    return getattr(getattr(optimizer, "__dict__", {}).get("_mpiddp"), "zero_stage", 0)
