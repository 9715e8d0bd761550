"""Abort the whole MPI job when one rank dies of an uncaught exception.

The other ranks would otherwise wait forever for collectives this rank will never submit.
Both hooks are installed: the main thread's (``sys.excepthook``) and every other thread's
(``threading.excepthook``), since a data loading or logging thread that dies leaves its rank
just as unable to go on. The hooks are process-wide by nature (they replace the interpreter's
own), so there is one ``AbortHooks`` per process: the first ``init()`` installs it and it stays
through later ``shutdown()``/``init()`` pairs unless ``MPIDDP_ABORT_ON_EXCEPTION=0``.
"""
from __future__ import annotations

import sys
import threading
import time

from mpi4py import MPI


def abort_job(what: str) -> None:
    """End the whole MPI job after ``what`` killed part of this rank (no-op on one rank)."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.write(f"mpiddp: rank {MPI.COMM_WORLD.Get_rank()} {what}; aborting the MPI "
                         "job so that the other ranks do not wait for it "
                         "(MPIDDP_ABORT_ON_EXCEPTION=0 disables this)\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # MPI_Abort tears the job down at once; give the launcher a moment to forward what
        # this rank printed (the traceback above), or the user sees no reason at all.
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(1)


class AbortHooks:
    """The pair of exception hooks that call ``abort_job`` (see the module docstring)."""

    def __init__(self):
        self._previous = None       # (sys.excepthook, threading.excepthook) while installed

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def install(self) -> None:
        if self._previous is not None:
            return
        previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook
        self._previous = (previous_hook, previous_thread_hook)

        def abort_on_uncaught(exc_type, exc, tb):
            previous_hook(exc_type, exc, tb)
            abort_job(f"died of an uncaught {exc_type.__name__}")

        def abort_on_uncaught_in_thread(args):
            previous_thread_hook(args)
            if args.exc_type is SystemExit:
                return                  # a thread's sys.exit() is a normal end, as in Python
            name = args.thread.name if args.thread is not None else "?"
            abort_job(f"lost its thread '{name}' to an uncaught {args.exc_type.__name__}")

        sys.excepthook = abort_on_uncaught
        threading.excepthook = abort_on_uncaught_in_thread

    def remove(self) -> None:
        if self._previous is not None:
            sys.excepthook, threading.excepthook = self._previous
            self._previous = None


ABORT_HOOKS = AbortHooks()
