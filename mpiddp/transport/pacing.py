"""How a transfer across nodes waits, sized from the link it crosses.

MPI over TCP (UCX's TCP transport, MPICH's sockets) pushes bytes into the socket and drains
them out only inside MPI calls, and each call moves a bounded amount: measured on the
emulated cluster with UCX's default 8 KiB TCP segments, 28-60 KB per call. A thread that
sleeps ``s`` between tests therefore caps the transfer at about that amount per ``s``:

- on fast links that cap is the bottleneck. 2 emulated nodes on ~16 Gbit/s links, ring
  all-reduce of 4-64 MiB: 0.18-0.26 GB/s with 200 us sleeps (0.14-0.23x MPI_Allreduce), 1.1-1.4
  GB/s blocking in MPI (0.78-1.46x); training at 10 Gbit/s 0.52x DDP-gloo before, 1.03-1.09x
  after (docs/dev/benchmark-record.md, "Fast links");
- on slow links a fixed short cap wakes the thread more often than the link needs: each
  wake costs a task switch and a test (200 Mbit/s, the training below: 44 ms of CPU per step
  with a 200 us cap, 40 with 1 ms, 37 with 3 ms).

What the link delivers during a sleep waits in the kernel's socket buffers, and it is the
wake (a task switch), not the test, that costs: so each wake tests ``TESTS_PER_WAKE`` times in
a row, and the cap is the wire time of ``SLEEP_CALLS`` calls' bytes on the measured link,
less than a burst moves (about 1.2 ms at 1 Gbit/s, at most ``MAX_SLEEP_SECONDS``). Measured
at 2 emulated nodes, 1 Gbit/s, ring all-reduce: 1 ms sleeps with one test per wake held the
link to 0.50-0.60x at 4-16 MiB; with 9 tests per wake 0.97-1.00x, and 2 ms with 9 as well.
Where one call's wire time is under ``MIN_SLEEP_SECONDS`` (sleeps that short are not honoured:
the kernel's timer slack alone is 50 us), transfers block in MPI, which busy-polls: on a link
that fast the transfer is over before the CPU it costs matters (at 5 Gbit/s, sleeping with
bursts halved the CPU per GB but cost up to 6% of the bandwidth, once 31%: on GPU nodes the
host CPU is idle and the network is what is short). ``MPIDDP_TRANSFER_SLEEP_US``
overrides the cap (0: always block). Without a measured link the cap is 200 us, as measured
at 1 Gbit/s with one test per wake.

Sleeps start from a tenth of the exchange's expected wire time on the measured link, not
from 10 us: the ramp took most wakes of a 1-4 MiB all-reduce (2 nodes, 1 Gbit/s: 1.2-2.3 ->
0.85-1.6 s of CPU per GB at 1-4 MiB, docs/dev/benchmark-record.md "Fast links").

Which exchanges are left in flight and waited for politely: those whose wire time is at least
``POLITE_MIN_SECONDS`` (shorter ones keep MPI's blocking call, which busy-polls for no
longer than that). Measured at 2 emulated nodes, 200 Mbit/s, simulated ResNet-50 (light
setting, balanced): 58-61 ms of CPU per step per rank with the fixed 256 KiB threshold and
200 us cap (its small steps busy-polled for up to 10 ms each), 40-42 ms with these rules,
the same throughput.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

PROGRESS_BYTES = 24 * 1024          # what one MPI call moves over TCP, conservatively
TESTS_PER_WAKE = 8                  # tests in a row after each sleep
SLEEP_CALLS = 6                     # the cap: the wire time of this many calls' bytes
MIN_SLEEP_SECONDS = 100e-6          # one call's wire time shorter: block in MPI instead
MAX_SLEEP_SECONDS = 2e-3            # slow links: a finished transfer is noticed this late at most
# Keeps 1 Gbit/s full (docs/dev/benchmark-record.md "CPU per byte").
UNKNOWN_LINK_SLEEP_SECONDS = 200e-6
POLITE_MIN_SECONDS = 0.5e-3
POLITE_MIN_BYTES = 256 * 1024       # link unknown, or blocking (pieces stay in flight for overlap)
SMALLEST_POLITE_BYTES = 4 * 1024


@dataclass(frozen=True)
class Pacing:
    """``max_sleep_s``: the longest sleep between tests of a transfer (0: block in MPI);
    ``polite_min_bytes``: exchanges of at least this many bytes are posted as nonblocking
    pieces and waited for with those sleeps; smaller ones use MPI's blocking call;
    ``tests_per_wake``: tests in a row after each sleep (until the transfer completes);
    ``seconds_per_byte``: the measured link's (0: unknown), for a transfer's expected time."""

    max_sleep_s: float = UNKNOWN_LINK_SLEEP_SECONDS
    polite_min_bytes: int = POLITE_MIN_BYTES
    tests_per_wake: int = TESTS_PER_WAKE
    seconds_per_byte: float = 0.0

    @property
    def blocks(self) -> bool:
        return self.max_sleep_s <= 0

    def describe(self) -> str:
        if self.blocks:
            return "transfers across nodes block in MPI (the link is too fast for sleeps)"
        return (f"transfers across nodes of {self.polite_min_bytes / 1024:.0f} KiB or more "
                f"sleep up to {self.max_sleep_s * 1e6:.0f} us between bursts of "
                f"{self.tests_per_wake} tests")


def pacing_for(seconds_per_byte: Optional[float],
               sleep_setting_us: Optional[float] = None) -> Pacing:
    """The pacing for a link of ``seconds_per_byte`` (None: not measured), with the user's
    ``MPIDDP_TRANSFER_SLEEP_US`` (None: derive it; 0: always block)."""
    if sleep_setting_us is not None:
        cap = sleep_setting_us * 1e-6
    elif seconds_per_byte is None:
        cap = UNKNOWN_LINK_SLEEP_SECONDS
    elif PROGRESS_BYTES * seconds_per_byte < MIN_SLEEP_SECONDS:
        cap = 0.0
    else:
        cap = min(SLEEP_CALLS * PROGRESS_BYTES * seconds_per_byte, MAX_SLEEP_SECONDS)
    if cap <= 0:
        return Pacing(0.0, POLITE_MIN_BYTES)
    if seconds_per_byte is None:
        return Pacing(cap, POLITE_MIN_BYTES)
    polite = math.ceil(POLITE_MIN_SECONDS / seconds_per_byte)
    return Pacing(cap, min(max(polite, SMALLEST_POLITE_BYTES), POLITE_MIN_BYTES),
                  seconds_per_byte=seconds_per_byte)
