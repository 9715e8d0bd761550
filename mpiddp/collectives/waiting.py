"""Waiting for nonblocking MPI requests without stealing a core.

MPI's blocking waits busy-poll. The coordinator often waits for slow ranks (they are still
computing backward), and a spinning thread takes the core that backward needs. So we spin
only briefly (fast answers stay fast), then test with growing sleeps.
"""
from __future__ import annotations

import time

from mpi4py import MPI

SPIN_SECONDS = 200e-6
MAX_SLEEP_SECONDS = 1e-3


def wait_politely(request: MPI.Request, deadline_check=None, check_every: float = 1.0) -> None:
    """Wait for ``request``. ``deadline_check()`` is called about every ``check_every``
    seconds while waiting (it may raise to give up waiting)."""
    start = time.perf_counter()
    while time.perf_counter() - start < SPIN_SECONDS:
        if request.Test():
            return
    sleep = 10e-6
    next_check = start + check_every
    while not request.Test():
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_SECONDS)
        if deadline_check is not None and time.perf_counter() >= next_check:
            deadline_check()
            next_check = time.perf_counter() + check_every
