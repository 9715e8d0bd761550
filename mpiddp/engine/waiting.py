"""The waiting policy: when the coordinator starts its next cycle, and how it waits inside one.

Every rule in one place:

1. After a cycle that executed something, a rank with unfinished work goes straight on.
2. A rank that has submitted every name some rank is waiting for (all of them agreed) enters
   the next cycle at once and waits *inside* it: the ranks it waits for join the moment they
   submit, so their last gradients are not delayed by a back-off.
3. A joined rank has no work of its own coming: it always waits inside the next cycle.
4. Otherwise (this rank lacks names others submitted, or names are still being negotiated) it
   waits for its own new work, with a back-off doubling from ``MIN_BACKOFF`` to the heartbeat
   (for liveness); when it lacks names others have, only its own submission can help, so it
   waits a whole heartbeat. An idle rank waits up to the heartbeat (``cycle_time``) before
   joining a heartbeat cycle, so that stalls and shutdowns are noticed.
5. Inside a cycle, a rank spins briefly only when it brings new work (partners in lockstep
   answer within microseconds) and its last such wait was over within the spin's time; a
   cycle entered to wait for others goes straight to sleeping polls, and so does one after a
   wait that outlasted the spin (the partners are not in lockstep: ranks that notice the end
   of a long transfer one sleep apart spun in vain; synchronous 1 MiB all-reduces at 2
   emulated nodes, 1.29 -> 1.22 ms of CPU each; 16 emulated nodes on 2 cores, where a spin
   takes the core from the ranks it waits for, a synchronous 4 KiB all-reduce 6.7 -> 5.2-5.4
   ms; training unchanged; docs/dev/benchmark-record.md). MPI's own blocking waits busy-poll, and a
   spinning coordinator would take the core that backward needs, so waits are tests with
   growing sleeps (see ``wait``).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

MIN_BACKOFF = 100e-6
SPIN_SECONDS = 200e-6
SHORT_SLEEP_SECONDS = 160e-6
LONG_WAIT_SECONDS = 20e-3
MAX_SLEEP_SECONDS = 1e-3


class WaitPolicy:
    """The rules above, as state updated once per cycle."""

    def __init__(self, heartbeat: float):
        self.heartbeat = heartbeat
        self.backoff = MIN_BACKOFF
        self.progressed = True           # the last cycle executed something
        self.waiting_for_others = False  # rule 2 applies
        self.spin = True                 # rule 5: this cycle was entered with new work
        self.spin_pays = True            # rule 5: the last wait ended within the spin

    def timeout_for_work(self, busy: bool, joined: bool) -> Optional[float]:
        """How long to wait for new work before the next cycle; None: start it at once
        (rules 1-3). ``busy``: this rank has pending work or has joined."""
        if busy and (self.progressed or self.waiting_for_others or joined):
            return None
        return self.backoff if busy else self.heartbeat

    def entered(self, brought_work: bool) -> None:
        """The next cycle starts; ``brought_work``: something new arrived for it."""
        self.spin = brought_work or self.progressed

    def after_cycle(self, executed: bool, all_known: bool, lacking: bool) -> None:
        """Update after a cycle: ``executed`` something; every pending name here is agreed
        (``all_known``); this rank ``lacking`` names others submitted (rules 1, 2, 4)."""
        if executed:
            self.progressed, self.backoff = True, MIN_BACKOFF
        else:
            self.progressed = False
            self.backoff = min(self.backoff * 2, self.heartbeat)
        self.waiting_for_others = all_known and not lacking and not executed
        if all_known and lacking and not executed:
            self.backoff = self.heartbeat

    def wait(self, test: Callable[[], bool]) -> None:
        """Wait until ``test()`` is true (a nonblocking request's Test): spin for up to
        ``SPIN_SECONDS`` if this cycle brought work and the last wait ended within the spin,
        then test with sleeps growing from 10 us to ``SHORT_SLEEP_SECONDS`` and, after
        ``LONG_WAIT_SECONDS``, to ``MAX_SLEEP_SECONDS`` (a partner that arrives is noticed
        within one sleep)."""
        start = time.perf_counter()
        if self.spin and self.spin_pays:
            while time.perf_counter() - start < SPIN_SECONDS:
                if test():
                    return
        sleep, cap, missed = 10e-6, SHORT_SLEEP_SECONDS, start
        while not test():
            missed = time.perf_counter()     # the partner came after this
            time.sleep(sleep)
            if sleep < cap:
                sleep *= 2
            elif cap < MAX_SLEEP_SECONDS and missed - start > LONG_WAIT_SECONDS:
                cap = MAX_SLEEP_SECONDS
        if self.spin:
            # Judged by the last test that missed, not by the sleep that overshot it: a
            # partner that may have come within the spin's time would have been caught by it.
            self.spin_pays = missed - start < SPIN_SECONDS
