"""The cycle protocol: what one rank says in a cycle and what it learns, with no threads and no
MPI, so that any number of fake ranks can run it in one process.

A cycle, on every rank:

1. ``encode()``: this rank's pending entries become one bit message,
   ``[~or_flags, and_flags, ready slot bits, ~pending slot bits, ~invalid slot bits]``.
2. The channel reduces the messages of all ranks with a bitwise AND. Inverting before an AND
   gives an OR, so one small message carries both "ready on every rank" (cache slots) and
   "some rank needs attention" (new names, shutdown, stall check, join, invalidated slots).
3. ``decode()``: the reduced message becomes ``CycleBits``.
4. Only if ``CycleBits.slow`` (some rank needs attention): ``slow_message()`` on every rank is
   gathered on rank 0, whose ``make_plan()`` checks agreement, fixes the order of newly
   complete names, assigns cache slots (growing the cache first where names evicted for room
   keep coming back, ``cache_capacity.py``: the plan carries the new capacity), decides
   shutdown and stall reports; the ``Plan`` is broadcast. Rank 0's plan also carries
   autotune's next settings (``announce``: a ``RETUNE`` flag in rank 0's message makes the
   cycle slow), which every rank applies before executing that cycle, so all switch at the
   same point of the order.
5. ``conclude()``: cached ready names and the plan's responses, in that order, become the
   ``CycleResult`` that every rank executes identically. Prioritized all-reduces
   (``Request.priority > 0``) go last, most urgent first, up to the largest budget their
   requests carry (``Request.cycle_bytes``), else ``priority_cycle_bytes``; the rest stay
   pending for the next cycle. Every rank computes the same cut from the same agreed
   list, so the ranks never disagree on what runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..buffers.dtypes import dtype_named
from ..config import Settings
from .cache_capacity import CACHE_CAPACITY_LIMIT, CapacityWatch
from .negotiation import RequestTable, ResponseCache, cacheable
from .request import ALLREDUCE, Entry
from .stall import describe_skipped, describe_stalls, describe_unmatched, find_skipped, \
    find_stalls

log = logging.getLogger("mpiddp")

# Bits of the OR-flags word.
NEW_NAMES, SHUTDOWN, STALL_CHECK, JOIN_CHANGED, RETUNE = 1, 2, 4, 8, 16
# Bits of the AND-flags word.
JOINED = 1
_MASK64 = (1 << 64) - 1
# Seconds between the stall checks while a call every rank must make (Request.deadline) has
# waited past its deadline (the ranks that lack it may not be waiting elsewhere yet).
DEADLINE_RECHECK = 1.0


class CycleBits(NamedTuple):
    """The reduced cycle message, decoded (a NamedTuple: built every cycle, so cheap)."""

    any_flags: int              # OR of every rank's flags
    all_joined: bool            # every rank has joined
    ready: list                 # Responses of cached names ready on every rank (slot order),
                                # read before a plan can reassign their slots
    invalid_slots: list         # cached names whose signature changed on some rank
    pending_bits: int           # slots pending on some rank

    @property
    def slow(self) -> bool:
        """Some rank needs the slow path (rank 0's plan) this cycle."""
        return bool(self.any_flags or self.invalid_slots)


@dataclass(frozen=True)
class SlowMessage:
    """What one rank sends to rank 0 in a slow cycle."""

    requests: list              # Requests for names rank 0 has not seen from this rank
    shutdown: Optional[str]     # this rank's shutdown reason
    joined: bool
    pending: Optional[dict]     # name -> age (s), only when a stall check is due (or a
                                # shutdown: the reason then names what was in flight)
    deadlines: Optional[dict] = None    # name -> Request.deadline of those pending names


@dataclass(frozen=True)
class Plan:
    """Rank 0's decision in a slow cycle, the same on every rank."""

    responses: list             # newly complete names, in execution order
    cache: list                 # (slot, Response) updates every rank applies
    shutdown: Optional[str]     # the agreed reason to stop, if any
    stall: Optional[str]        # stall report, if any
    joined: tuple               # ranks that have joined
    table_waiting: bool         # rank 0 still holds uncached names that are incomplete
    retune: object = None       # autotune's next settings (autotune.Retune), if any
    cache_capacity: int = 0     # the response cache's new capacity (0: unchanged)


class CycleResult(NamedTuple):
    """What this rank executes, in order, and what else the cycle decided."""

    ready: list                 # Responses, in the agreed order
    entries: dict               # name -> this rank's Entry (absent for a joined rank)
    stop_reason: Optional[str]  # the ranks agreed to stop
    join_complete: bool         # every rank has joined (this one too): join() returns
    # For the waiting policy: every name pending here is agreed, and this rank lacks names
    # other ranks have submitted (only its own next submission can supply them).
    all_known: bool
    lacking: bool
    retune: object = None       # settings to apply before executing ``ready`` (autotune)


def _set_bits(bits: int) -> list:
    slots = []
    while bits:
        low = bits & -bits
        slots.append(low.bit_length() - 1)
        bits ^= low
    return slots


class CycleProtocol:
    """One rank's side of the cycle protocol (see the module docstring)."""

    def __init__(self, rank: int, size: int, settings: Settings):
        self.rank, self.size = rank, size
        self.settings = settings
        self.cache = ResponseCache(settings.cache_capacity)
        self.table = RequestTable(size) if rank == 0 else None
        self._size_message(settings.cache_capacity)
        # Rank 0: whether the job keeps using more names than the cache holds; the cache then
        # grows (in a plan, on every rank alike) unless the user set its capacity.
        self._capacity_watch = CapacityWatch() if rank == 0 else None
        self._capacity_warned = False

        self.pending: dict[str, Entry] = {}
        self.joined = False
        self._others_joined = False     # some rank has joined (known from the last plan)
        self._join_changed = False
        self.join_cycle = 0             # the cycle this rank joined in
        self.cycles = 0
        self._table_waiting = False
        self._my_pending_bits = 0
        self._all_pending_cached = True
        # How often to compare pending names across ranks (and so notice a stall deadline).
        self._stall_period = settings.stall_check_time
        if settings.stall_shutdown_time:
            self._stall_period = min(self._stall_period, settings.stall_shutdown_time)
        self._last_stall_check = time.perf_counter()
        self._deadlined: dict[str, Entry] = {}  # pending calls with a Request.deadline
        self._announce = None           # rank 0: autotune's settings for the next plan

    def _size_message(self, capacity: int) -> None:
        # Slots rounded up to whole 64-bit words; the message is two flag words and three
        # bits per slot (ready on every rank, pending on some rank, invalid on some rank).
        self.slots = (capacity + 63) // 64 * 64
        self._slot_mask = (1 << self.slots) - 1
        self.message_bytes = 16 + 3 * self.slots // 8

    def _grow_cache(self, capacity: int) -> None:
        """Room for ``capacity`` names from the next cycle's message on (every rank applies
        it in the same cycle: rank 0 as it makes the plan, the others as they conclude)."""
        self.cache.grow(capacity)
        self._size_message(capacity)

    def announce(self, retune) -> None:
        """Rank 0: send ``retune`` to every rank in the next plan (forces a slow cycle)."""
        self._announce = retune

    # ---- this rank's state ----------------------------------------------------------------
    def add(self, entries) -> None:
        for entry in entries:
            self.pending[entry.request.name] = entry
            if entry.request.deadline:
                self._deadlined[entry.request.name] = entry

    def join(self) -> None:
        """This rank has joined (from the next message on)."""
        if not self.joined:
            self.joined = self._join_changed = True
            self.join_cycle = self.cycles

    def take_pending(self) -> list:
        """Remove and return every pending entry (the engine stops)."""
        entries, self.pending = list(self.pending.values()), {}
        return entries

    # ---- 1. encode ------------------------------------------------------------------------
    def encode(self, shutdown_requested: bool, now: Optional[float] = None) -> bytes:
        """This rank's cycle message: one little-endian bit string
        ``~or_flags | and_flags << 64 | ready << 128 | ~pending << (128 + slots)
        | ~invalid << (128 + 2 slots)``, built as a Python int (fast bit operations in C)."""
        now = time.perf_counter() if now is None else now
        ready = invalid = pending = or_flags = 0
        all_cached = True
        oldest = now
        cache = self.cache
        for name, entry in self.pending.items():
            if entry.submitted < oldest:
                oldest = entry.submitted
            slot = cache.slot_of(name)
            if slot is None:
                all_cached = False
                if not entry.sent:
                    or_flags |= NEW_NAMES
                continue
            pending |= 1 << slot
            cached = cache.response(slot).request
            if cached == entry.request and not (self._others_joined and cached.kind != ALLREDUCE):
                ready |= 1 << slot
            else:
                # A new signature, or a non-allreduce while some rank has joined: send it back
                # through rank 0, which reports the mismatch or the join conflict.
                invalid |= 1 << slot
        if self.joined:
            # A joined rank takes part in every allreduce the others are ready for.
            for slot in cache.slots_of_kind(ALLREDUCE):
                ready |= 1 << slot
                pending |= 1 << slot
        if shutdown_requested:
            or_flags |= SHUTDOWN
        if self._join_changed:
            or_flags |= JOIN_CHANGED
        if self._announce is not None:
            or_flags |= RETUNE
        period = self._stall_period
        if now - oldest >= period and now - self._last_stall_check >= period:
            or_flags |= STALL_CHECK
        elif self._deadlined and self._deadline_check_due(now):
            or_flags |= STALL_CHECK
        self._my_pending_bits = pending
        self._all_pending_cached = all_cached
        slots, mask = self.slots, self._slot_mask
        message = ((~or_flags & _MASK64) | ((JOINED if self.joined else 0) << 64)
                   | (ready << 128) | ((~pending & mask) << (128 + slots))
                   | ((~invalid & mask) << (128 + 2 * slots)))
        return message.to_bytes(self.message_bytes, "little")

    def _deadline_check_due(self, now: float) -> bool:
        """Some pending call every rank must make has waited past its deadline (at most
        the stall check time), and the last stall check is older than that deadline or
        ``DEADLINE_RECHECK``; forgets the calls no longer pending."""
        due = False
        for name, entry in list(self._deadlined.items()):
            if self.pending.get(name) is not entry:
                del self._deadlined[name]
                continue
            deadline = min(entry.request.deadline, self.settings.stall_check_time)
            if now - entry.submitted >= deadline and \
                    now - self._last_stall_check >= min(deadline, DEADLINE_RECHECK):
                due = True
        return due

    # ---- 3. decode ------------------------------------------------------------------------
    def decode(self, reduced: bytes) -> CycleBits:
        """Read the AND-reduced message of all ranks. Invalidated cache slots are evicted on
        every rank here (their names go back through rank 0)."""
        message = int.from_bytes(reduced, "little")
        slots, mask = self.slots, self._slot_mask
        invalid = ~(message >> (128 + 2 * slots)) & mask
        invalid_slots = _set_bits(invalid) if invalid else []
        self.cycles += 1
        for slot in invalid_slots:        # a rank saw a different signature: renegotiate
            name = self.cache.response(slot).name
            self.cache.evict(slot)
            entry = self.pending.get(name)
            if entry is not None:
                entry.sent = False
        all_joined = bool((message >> 64) & JOINED)
        ready_bits = (message >> 128) & mask & ~invalid  # a joined rank marks changed ones both
        ready = []
        if ready_bits and not all_joined:   # all joined: every rank set every bit, none real
            for slot in _set_bits(ready_bits):
                ready.append(self.cache.response(slot))
                self.cache.touch(slot)
        return CycleBits(any_flags=~message & _MASK64, all_joined=all_joined, ready=ready,
                         invalid_slots=invalid_slots,
                         pending_bits=~(message >> (128 + slots)) & mask)

    # ---- 4. the slow path -----------------------------------------------------------------
    def slow_message(self, bits: CycleBits, shutdown_reason: Optional[str],
                     now: Optional[float] = None) -> SlowMessage:
        now = time.perf_counter() if now is None else now
        requests = []
        for name, entry in self.pending.items():
            if not entry.sent and self.cache.slot_of(name) is None:
                requests.append(entry.request)
                entry.sent = True
        stall_check = bool(bits.any_flags & STALL_CHECK)
        if stall_check:
            self._last_stall_check = now
        self._join_changed = False
        report = stall_check or bool(bits.any_flags & SHUTDOWN)
        deadlines = {n: e.request.deadline for n, e in self._deadlined.items()
                     if self.pending.get(n) is e} if report else None
        return SlowMessage(
            requests=requests, shutdown=shutdown_reason, joined=self.joined,
            pending=({n: now - e.submitted for n, e in self.pending.items()}
                     if report else None), deadlines=deadlines or None)

    def make_plan(self, messages: list) -> Plan:
        """Rank 0: fold in the new requests, decide what is complete and in what order."""
        for rank, message in enumerate(messages):
            for request in message.requests:
                self.table.add(rank, request)
        joined = {rank for rank, message in enumerate(messages) if message.joined}
        responses = self.table.take_complete(joined)
        admitted = [response for response in responses if cacheable(response)]
        capacity = self._capacity_for(admitted) if admitted else 0
        cache_updates = []
        for response in admitted:
            slot = self.cache.next_slot()
            evicted = self._cache_put(slot, response)
            if evicted is not None:
                self._capacity_watch.evicted_for_room(evicted, self.cache.capacity)
            cache_updates.append((slot, response))
        shutdown = [f"rank {rank}: {message.shutdown}"
                    for rank, message in enumerate(messages) if message.shutdown]
        stall_text = None
        if any(message.pending is not None for message in messages):
            pending = {rank: message.pending or {} for rank, message in enumerate(messages)}
            if shutdown:            # asked for by some rank: say what it left waiting
                unmatched = find_stalls(pending, joined, self.size, 0.0)
                if unmatched:
                    shutdown.append(describe_unmatched(unmatched))
            deadlines = {name: deadline for message in messages
                         for name, deadline in (message.deadlines or {}).items()}
            skipped = find_skipped(pending, deadlines, joined, self.size,
                                   self.settings.stall_check_time) if deadlines else []
            if skipped:
                shutdown.append(describe_skipped(skipped, pending))
            stalls = find_stalls(pending, joined, self.size, self.settings.stall_check_time)
            shutdown_after = self.settings.stall_shutdown_time
            if shutdown_after:
                late = find_stalls(pending, joined, self.size, shutdown_after)
                if late:
                    shutdown.append(f"stalled for more than {shutdown_after:g} s "
                                    f"(MPIDDP_STALL_SHUTDOWN_TIME).\n" + describe_stalls(late))
            if stalls:
                stall_text = describe_stalls(stalls)
                log.warning("mpiddp stall warning (rank 0):\n%s", stall_text)
        retune, self._announce = self._announce, None
        return Plan(responses=responses, cache=cache_updates,
                    shutdown="; ".join(shutdown) if shutdown else None, stall=stall_text,
                    joined=tuple(sorted(joined)), table_waiting=len(self.table) > 0,
                    retune=retune, cache_capacity=capacity)

    def _capacity_for(self, admitted: list) -> int:
        """Rank 0, before giving ``admitted`` their places: a larger capacity for the cache
        (applied here, and by every rank from the plan), or 0. The cache doubles when the
        job keeps using more names than it holds (``cache_capacity.py``), unless the user
        set ``MPIDDP_CACHE_CAPACITY`` or it reached its limit: then rank 0 says so, once."""
        watch = self._capacity_watch
        for response in admitted:
            watch.admit(response.name)
        capacity = self.cache.capacity
        verdict = watch.too_small(capacity)
        if verdict is None:
            return 0
        explicit = "cache_capacity" in self.settings.explicit
        if explicit or capacity >= CACHE_CAPACITY_LIMIT:
            if not self._capacity_warned:
                self._capacity_warned = True
                advice = ("Raise MPIDDP_CACHE_CAPACITY above the number of names a step "
                          "uses, or unset it: mpiddp then grows the cache as needed."
                          if explicit else "The cache has reached its largest size.")
                log.warning("mpiddp: the response cache holds %d names, and %d of the last %d "
                            "names given a place in it had been evicted from it for room "
                            "before: each such name costs a negotiation through rank 0 every "
                            "time it is used. %s", capacity, verdict[0], verdict[1], advice)
            return 0
        grown = min(2 * capacity, CACHE_CAPACITY_LIMIT)
        log.info("mpiddp: the response cache grows from %d to %d names (%d of the last %d "
                 "names given a place in it had been evicted from it for room before)",
                 capacity, grown, *verdict)
        self._grow_cache(grown)
        watch.grown()
        return grown

    def _cache_put(self, slot: int, response) -> Optional[str]:
        """Put an agreed response in ``slot``; returns the name it evicted, if any. A name
        still pending here whose slot is taken (least recently used) goes back through rank
        0: without its slot it could never be ready again. Every rank evicts the same slot,
        so they all send it again."""
        evicted = self.cache.put(slot, response)
        if evicted is not None:
            entry = self.pending.get(evicted)
            if entry is not None:
                entry.sent = False
        return evicted

    # ---- 5. conclude ----------------------------------------------------------------------
    def conclude(self, bits: CycleBits, plan: Optional[Plan]) -> CycleResult:
        """The ordered list to execute: cached ready names (slot order), then the plan's."""
        ready = bits.ready
        if plan is not None:
            if self.rank != 0:
                if plan.cache_capacity:
                    self._grow_cache(plan.cache_capacity)
                for slot, response in plan.cache:
                    self._cache_put(slot, response)
            self._others_joined = bool(plan.joined)
            self._table_waiting = plan.table_waiting
            if plan.stall:
                # Every rank learns why it waits; rank 0 has already logged the warning.
                log.debug("stall report from rank 0:\n%s", plan.stall)
            ready = ready + plan.responses
        ready = self._by_urgency(ready)
        entries = {}
        for response in ready:
            entry = self.pending.pop(response.name, None)
            if entry is not None:
                entries[response.name] = entry
        stop_reason = plan.shutdown if plan is not None else None
        join_complete = not stop_reason and bits.all_joined and self.joined
        if join_complete:
            self.joined = self._others_joined = False
        all_known = bool(self.pending) and not self._table_waiting and self._all_pending_cached
        lacking = bool(bits.pending_bits & ~self._my_pending_bits)
        return CycleResult(ready, entries, stop_reason, join_complete, all_known, lacking,
                           plan.retune if plan is not None else None)

    def _by_urgency(self, ready: list) -> list:
        """``ready`` with the prioritized requests last, most urgent first, cut after
        ``priority_cycle_bytes``; the cut ones stay pending (they are cached, so they are
        ready again in the next cycle, next to anything more urgent submitted meanwhile).
        Unchanged when nothing in it has a priority (the standard path)."""
        if not any(response.request.priority for response in ready):
            return ready
        def urgent(r):   # all-reduces, and a sharded optimizer's ring halves
            return r.request.priority and r.error is None and \
                (r.request.kind == ALLREDUCE or r.request.ring_order)
        plain = [r for r in ready if not urgent(r)]
        by_urgency = sorted(filter(urgent, ready), key=lambda r: r.request.priority)
        # The requests' own budget (the largest among them: a cycle carries a whole piece of
        # each), else the engine's.
        budget = max(r.request.cycle_bytes for r in by_urgency) if by_urgency else 0
        budget = budget or self.settings.priority_cycle_bytes
        taken, used = [], 0
        for response in by_urgency:
            request = response.request
            if budget and taken and used >= budget and self.cache.slot_of(request.name) \
                    is not None:
                continue                # waits one cycle (still pending, still cached)
            taken.append(response)
            used += request.numel * dtype_named(request.dtype).itemsize
        return plain + taken
