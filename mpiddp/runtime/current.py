"""The one current runtime of this process: the only module-level state of the runtime.

``init()`` installs a ``Runtime``, ``shutdown()`` clears it; everything that needs a running
mpiddp asks ``require(what)``, which says clearly when ``init()`` is missing or
``shutdown()`` came first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..errors import EngineShutdownError, NotInitializedError
from .mpi_environment import child_process_error, mpi_kept_out

if TYPE_CHECKING:                    # annotations only: lifecycle imports this module
    from .lifecycle import Runtime

_current: Optional["Runtime"] = None
_was_shut_down = False


def get() -> Optional["Runtime"]:
    """The running runtime, or None (before ``init()``, after ``shutdown()``)."""
    return _current


def install(runtime: "Runtime") -> None:
    global _current
    _current = runtime


def clear() -> None:
    """Forget the runtime (``shutdown()``): later calls say it was shut down."""
    global _current, _was_shut_down
    _current = None
    _was_shut_down = True


def require(what: str) -> "Runtime":
    """The running runtime, or a clear error naming the call that needed it."""
    if _current is None:
        if _was_shut_down:
            raise EngineShutdownError(f"mpiddp.{what} was called after mpiddp.shutdown(); "
                                      "call mpiddp.init() again first")
        if mpi_kept_out():      # a rank's DataLoader worker: init() cannot help there
            raise NotInitializedError(child_process_error(what))
        raise NotInitializedError(f"mpiddp.{what} needs mpiddp.init() to be called first")
    return _current
