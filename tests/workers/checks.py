"""Helpers shared by the multi-rank test workers: reporting a passed check, and expecting an
error.

A worker asserts inside itself (a failed assertion aborts the job); ``ok`` reports that every
rank got past a check, with the values it measured, as one line the test reads back with
``mpi_launch.reported`` (``OK <check> | {json values}``), so that the test can check values
rather than the wording of a line.
"""
import json
import sys
from typing import Callable, Optional

REPORT_SEPARATOR = " | "


def ok(check: str, rank: int, barrier: Optional[Callable[[], None]] = None,
       every_rank: bool = False, **values) -> None:
    """Report that ``check`` passed. ``barrier()`` first, when given, so that the line means
    every rank got there; printed by rank 0 (``OK <check>``) or, with ``every_rank``, by every
    rank (``OK <rank> <check>``); ``values`` follow as JSON."""
    if barrier is not None:
        barrier()
    if rank != 0 and not every_rank:
        return
    line = f"OK {rank} {check}" if every_rank else f"OK {check}"
    if values:
        line += REPORT_SEPARATOR + json.dumps(values, sort_keys=True)
    # One write, newline included: print() writes the newline separately when Python is
    # unbuffered (the tests' PYTHONUNBUFFERED=1), and another rank's line could come between.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def expect(exc_type, fn, *needles) -> str:
    """Call ``fn`` and require ``exc_type`` whose message contains every needle."""
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        assert not missing, f"message {text!r} lacks {missing}"
        return text
    raise AssertionError(f"expected {exc_type.__name__}")
