"""Waiting for nonblocking MPI requests without stealing a core.

MPI's blocking waits busy-poll. The coordinator often waits for slow ranks (they are still
computing backward), and a spinning thread takes the core that backward needs. So we spin
only briefly (fast answers stay fast), then test with growing sleeps.
"""
from __future__ import annotations

import time

from mpi4py import MPI

SPIN_SECONDS = 200e-6
SHORT_SLEEP_SECONDS = 160e-6
LONG_WAIT_SECONDS = 20e-3
MAX_SLEEP_SECONDS = 1e-3


def wait_politely(request: MPI.Request, spin: bool = True) -> None:
    """Wait for ``request``: spin (if asked) for up to ``SPIN_SECONDS``, then test with
    sleeps growing from 10 us to ``SHORT_SLEEP_SECONDS`` and, after ``LONG_WAIT_SECONDS``,
    to ``MAX_SLEEP_SECONDS`` (a partner that arrives is noticed within one sleep)."""
    start = time.perf_counter()
    if spin:
        while time.perf_counter() - start < SPIN_SECONDS:
            if request.Test():
                return
    sleep = 10e-6
    cap = SHORT_SLEEP_SECONDS
    while not request.Test():
        time.sleep(sleep)
        if sleep < cap:
            sleep *= 2
        elif cap < MAX_SLEEP_SECONDS and time.perf_counter() - start > LONG_WAIT_SECONDS:
            cap = MAX_SLEEP_SECONDS
