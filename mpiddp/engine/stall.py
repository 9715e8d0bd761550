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
