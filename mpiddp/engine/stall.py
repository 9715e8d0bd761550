"""Stall inspection: names some ranks submitted long ago that other ranks never did.

A rank that stops submitting (an exception, uneven data) makes the others wait forever;
rank 0 names who is missing what, and can end the wait after a deadline."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    name: str
    waiting_ranks: tuple      # ranks that submitted the name
    missing_ranks: tuple      # ranks that did not
    age: float                # seconds since the earliest submission


def find_stalls(pending_by_rank: dict, joined: set, size: int, min_age: float) -> list[Stall]:
    """``pending_by_rank[r]`` maps the names rank r has in flight to their ages (s)."""
    ages: dict[str, float] = {}
    holders: dict[str, list[int]] = {}
    for rank, pending in pending_by_rank.items():
        for name, age in pending.items():
            holders.setdefault(name, []).append(rank)
            ages[name] = max(ages.get(name, 0.0), age)
    stalls = []
    for name, ranks in holders.items():
        missing = tuple(r for r in range(size) if r not in ranks and r not in joined)
        if missing and ages[name] >= min_age:
            stalls.append(Stall(name, tuple(sorted(ranks)), missing, ages[name]))
    return sorted(stalls, key=lambda s: -s.age)


def find_skipped(pending_by_rank: dict, deadlines: dict, joined: set, size: int,
                 limit: float) -> list[Stall]:
    """The calls every rank must make (``deadlines``: name -> seconds, ``Request.deadline``)
    that some ranks have waited in for their deadline (at most ``limit``) while each rank
    lacking them waits in other collectives, names that the waiting ranks lack: those ranks
    went past the call (made under ``if rank == 0:``, say), so only an error ends the wait."""
    skipped = []
    for stall in find_stalls(pending_by_rank, joined, size, 0.0):
        deadline = deadlines.get(stall.name)
        if not deadline or stall.age < min(deadline, limit):
            continue
        if all(_elsewhere(pending_by_rank, rank, stall.waiting_ranks)
               for rank in stall.missing_ranks):
            skipped.append(stall)
    return skipped


def _elsewhere(pending_by_rank: dict, rank: int, waiting: tuple) -> list[str]:
    """The names ``rank`` has in flight that some of the ``waiting`` ranks have not."""
    return [name for name in pending_by_rank.get(rank, {})
            if any(name not in pending_by_rank.get(other, {}) for other in waiting)]


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def describe_skipped(skipped: list[Stall], pending_by_rank: dict) -> str:
    """The error for ``find_skipped``'s calls: each call, the ranks that made it and those
    that did not, with what the latter wait in instead."""
    lines = []
    for stall in skipped:
        instead = sorted({name for rank in stall.missing_ranks
                          for name in _elsewhere(pending_by_rank, rank, stall.waiting_ranks)})
        shown = ", ".join(repr(n) for n in instead[:3]) + (", ..." if len(instead) > 3 else "")
        lines.append(f"'{stall.name}' was called on {_ranks(stall.waiting_ranks)} but not on "
                     f"{_ranks(stall.missing_ranks)}, which went on to other collectives "
                     f"({shown}); it is a collective call: every rank must make it, at the "
                     f"same point (waited {stall.age:.1f} s)")
    return "\n".join(lines)


def describe_unmatched(stalls: list[Stall], limit: int = 10) -> str:
    """What was in flight on some ranks only when the ranks agreed to stop."""
    parts = [f"'{s.name}' submitted on {_ranks(s.waiting_ranks)} but not on "
             f"{_ranks(s.missing_ranks)}" for s in stalls[:limit]]
    more = f" and {len(stalls) - limit} more" if len(stalls) > limit else ""
    return "in flight on some ranks only: " + "; ".join(parts) + more


def describe_stalls(stalls: list[Stall], limit: int = 10) -> str:
    by_missing: dict[int, list[str]] = {}
    for stall in stalls:
        for rank in stall.missing_ranks:
            by_missing.setdefault(rank, []).append(stall.name)
    oldest = max(s.age for s in stalls)
    lines = [f"{len(stalls)} tensor(s) were submitted by some ranks but not by others; "
             f"the oldest has waited {oldest:.1f} s. Missing ranks:"]
    for rank in sorted(by_missing):
        names = by_missing[rank]
        shown = ", ".join(repr(n) for n in names[:limit])
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        lines.append(f"  rank {rank} has not submitted: {shown}{more}")
    lines.append("This usually means a rank raised an exception, ran out of data, or takes a "
                 "different code path. Use join() for uneven data.")
    return "\n".join(lines)
