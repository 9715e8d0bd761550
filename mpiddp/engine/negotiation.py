"""Negotiation state: the response cache every rank keeps, and rank 0's table of requests
that checks the ranks agree before anything runs. Pure logic, no MPI: easy to test."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

from ..reduce_ops import ReduceOp
from .request import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, CACHEABLE, INVALID,
                      REDUCESCATTER, REFUSED, Request, Response)


class ResponseCache:
    """Slot-numbered agreed responses. Every rank holds an identical copy: slots are handed
    out by rank 0 only and every change travels in the cycle's broadcast plan, so a cycle for
    known names is one bitwise AND over slot bits, with no strings on the wire."""

    def __init__(self, capacity: int):
        self.capacity = capacity    # only grows (``grow``): every slot handed out stays valid
        self._by_slot: dict[int, Response] = {}
        self._slot_by_name: dict[str, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # rank 0's recency order
        self._high = 0              # slots below this have been handed out before
        self._holes: set[int] = set()   # of those, the ones empty now (at most capacity)
        self.version = 0            # changes with the contents (speculation's layout follows)

    def __len__(self) -> int:
        return len(self._by_slot)

    def slot_of(self, name: str):
        return self._slot_by_name.get(name)

    def response(self, slot: int) -> Response:
        return self._by_slot[slot]

    def slots(self):
        """The filled slots, in the order they were filled (the same on every rank)."""
        return self._by_slot.keys()

    def put(self, slot: int, response: Response) -> Optional[str]:
        """Give ``response`` ``slot``; returns the name that held the slot before, if another."""
        self.version += 1
        replaced = self._by_slot.get(slot)
        self.evict(slot)
        old = self._slot_by_name.get(response.name)
        if old is not None:
            self.evict(old)
        self._by_slot[slot] = response
        self._slot_by_name[response.name] = slot
        self._lru[slot] = None
        self._holes.discard(slot)
        for hole in range(self._high, slot):    # a slot skipped (only if given out of order)
            self._holes.add(hole)
        self._high = max(self._high, slot + 1)
        return replaced.name if replaced is not None and replaced.name != response.name \
            else None

    def evict(self, slot: int) -> None:
        response = self._by_slot.pop(slot, None)
        if response is not None:
            self.version += 1
            del self._slot_by_name[response.name]
            self._holes.add(slot)
        self._lru.pop(slot, None)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` names (more than now; applied by every rank in one cycle)."""
        assert capacity >= self.capacity, (capacity, self.capacity)
        self.capacity = capacity

    def slots_of_kind(self, kind: str) -> list[int]:
        return [slot for slot, response in self._by_slot.items() if response.request.kind == kind]

    def touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def next_slot(self) -> int:
        """A free slot (the lowest emptied one, else the next never used), else the least
        recently used one (rank 0 decides, all apply)."""
        if self._holes:
            return min(self._holes)
        if self._high < self.capacity:
            return self._high
        return next(iter(self._lru))


def _describe_ranks(values_by_rank: dict[int, object], fmt=str) -> str:
    groups: dict = {}
    for rank in sorted(values_by_rank):
        groups.setdefault(fmt(values_by_rank[rank]), []).append(rank)
    parts = []
    for text, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} sent {text}")
    return ", ".join(parts)


def _shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _mismatch(kind: str, what: str, name: str, values: dict, fmt=str) -> str:
    return f"Mismatched {kind} {what} for '{name}': {_describe_ranks(values, fmt)}"


def agree(requests: dict[int, Request], size: int) -> Response:
    """Check that every rank's request for one name agrees; return the agreed Response
    (with per-rank sizes for gathers) or one whose ``error`` says what differs and where."""
    first = requests[min(requests)]
    name = first.name
    rejected = {rank: req.invalid for rank, req in requests.items() if req.invalid}
    if rejected:
        reasons = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(rejected.items()))
        return Response(first, error=f"Invalid input for {first.kind} '{name}' on "
                                     f"{len(rejected)} of {len(requests)} ranks: {reasons}",
                        error_kind=INVALID)

    def field_values(getter):
        return {rank: getter(req) for rank, req in requests.items()}

    kinds = field_values(lambda r: r.kind)
    if len(set(kinds.values())) > 1:
        return Response(first, error=f"Mismatched collective operations for '{name}': "
                                     f"{_describe_ranks(kinds)}")
    kind = first.kind
    checks = [("dtypes", lambda r: r.dtype, str),
              ("devices", lambda r: r.device_type, str)]
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks.append(("reduction ops", lambda r: r.op, lambda op: ReduceOp(op).name.title()))
        checks.append(("prescale factors", lambda r: r.prescale, str))
        checks.append(("postscale factors", lambda r: r.postscale, str))
    if kind in (REDUCESCATTER, ALLGATHER):
        checks.append(("chunk orders (ring_order)", lambda r: r.ring_order, str))
    if kind == BROADCAST:
        checks.append(("root ranks", lambda r: r.root, str))
    if kind in (ALLGATHER, ALLTOALL):
        checks.append(("ranks of tensor (number of dimensions)", lambda r: len(r.shape), str))
        checks.append(("shapes (beyond the first dimension)", lambda r: r.shape[1:], _shape_text))
    else:
        checks.append(("shapes", lambda r: r.shape, _shape_text))
    for what, getter, fmt in checks:
        values = field_values(getter)
        if len(set(values.values())) > 1:
            return Response(first, error=_mismatch(kind, what, name, values, fmt))

    if kind == ALLGATHER:
        return Response(first, sizes=tuple(requests[r].shape[0] for r in range(size)))
    if kind == ALLTOALL:
        matrix = tuple(tuple(requests[r].splits) for r in range(size))
        return Response(first, sizes=matrix)
    return Response(first)


class RequestTable:
    """Rank 0's table of requests for names not (or no longer) in the cache. A name is
    complete when every rank that has not joined has submitted it; completion order is the
    order the ranks execute in."""

    def __init__(self, size: int):
        self.size = size
        self._table: dict[str, dict[int, Request]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def add(self, rank: int, request: Request) -> None:
        self._table.setdefault(request.name, {})[rank] = request

    def take_complete(self, joined: Iterable[int]) -> list[Response]:
        """Responses for the names every rank that has not joined has submitted, in table
        order. While some rank has joined, a collective other than allreduce fails at once on
        the ranks that submitted it, without waiting for the others: ranks whose generated
        names drifted apart (different numbers of calls before the join) still get the error
        instead of waiting for each other under different names."""
        joined = set(joined)
        needed = [r for r in range(self.size) if r not in joined]
        done = []
        for name, by_rank in list(self._table.items()):
            first = by_rank[min(by_rank)]
            if joined and first.kind != ALLREDUCE:
                del self._table[name]
                done.append(Response(first, error=(
                    f"Cannot run {first.kind} '{name}': rank(s) "
                    f"{', '.join(map(str, sorted(joined)))} have called join(); only allreduce "
                    "runs until every rank has joined"), error_kind=REFUSED))
                continue
            if any(r not in by_rank for r in needed):
                continue
            del self._table[name]
            done.append(agree(by_rank, self.size))
        return done


def cacheable(response: Response) -> bool:
    request = response.request
    # A ring-order all-gather's ranks all name the whole output: it depends on the request.
    return response.error is None and (request.kind in CACHEABLE or
                                       (request.kind == ALLGATHER and request.ring_order))
