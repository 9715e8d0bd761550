"""Exceptions raised by mpiddp. All derive from ``MpiddpError``."""
from __future__ import annotations


class MpiddpError(RuntimeError):
    """Base class of every error mpiddp raises on its own account."""


class NotInitializedError(MpiddpError):
    """A call that needs ``mpiddp.init()`` came before it (or after ``shutdown()``)."""


class TensorMismatchError(MpiddpError, ValueError):
    """Ranks submitted the same tensor name with different dtype, shape, op, root or device."""


class DuplicateNameError(MpiddpError, ValueError):
    """A tensor name was submitted while a request of the same name was still in flight."""


class EngineShutdownError(MpiddpError):
    """The engine stopped (shutdown, stall timeout or a failure) before the request finished."""


class LaunchError(MpiddpError):
    """The launcher started several tasks, but MPI sees each of them as a job of its own."""
