"""The engine: a background coordinator thread that owns every collective MPI call.

User threads ``submit`` entries and get handles at once. The coordinator runs cycles; in each,
the ranks agree which names are ready everywhere and execute them in the same order:

* Bit-vector all-reduce (every cycle): one ``MPI_Iallreduce(BAND)`` over
  ``[~or_flags, and_flags, ready slot bits..., ~invalid slot bits...]``. Inverting before an
  AND gives an OR, so one small message carries both "ready on every rank" (cache slots) and
  "some rank needs attention" (new names, shutdown, stall check, join, invalidated slots).
* Slow path (only when some rank needs attention): requests for new names are gathered on
  rank 0, which checks agreement, fixes the order, assigns cache slots, decides shutdown and
  stall warnings, and broadcasts the plan.

A cycle starts as soon as a rank has new work (not on a fixed tick); an idle rank joins a
heartbeat cycle every ``cycle_time`` ms so that stalls and shutdowns are noticed, and waits
in between without spinning.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback

from mpi4py import MPI

from ..collectives.waiting import wait_politely
from ..config import Settings
from ..errors import DuplicateNameError, EngineShutdownError, MpiddpError
from .executor import Executor
from .handle import Handle
from .negotiation import RequestTable, ResponseCache, cacheable
from .request import ALLREDUCE, Entry
from .stall import describe_stalls, find_stalls
from .stats import EngineStats
from .timeline import Timeline

log = logging.getLogger("mpiddp")

# Bits of the OR-flags word.
_NEW_NAMES, _SHUTDOWN, _STALL_CHECK, _JOIN_CHANGED = 1, 2, 4, 8
# Bits of the AND-flags word.
_JOINED = 1
_MASK64 = (1 << 64) - 1
_MIN_BACKOFF = 100e-6
_WAKE = object()   # inbox token: "look at the flags" (join, shutdown)


class Engine:
    def __init__(self, comm: MPI.Comm, settings: Settings):
        self.comm = comm.Dup()      # private: user traffic can never interleave with ours
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.settings = settings
        self.stats = EngineStats()
        self.timeline = Timeline(settings.timeline)
        self.cache = ResponseCache(settings.cache_capacity)
        self.table = RequestTable(self.size) if self.rank == 0 else None
        self.executor = Executor(self.comm, settings, self.stats, self.timeline, self._finish)
        # Slots rounded up to whole 64-bit words; the message is two flag words and three bits
        # per slot (ready on every rank, pending on some rank, invalid on some rank).
        self._slots = (settings.cache_capacity + 63) // 64 * 64
        self._slot_mask = (1 << self._slots) - 1
        self._send = bytearray(16 + 3 * self._slots // 8)
        self._recv = bytearray(len(self._send))

        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # entries and wake-up tokens
        self._in_flight: set[str] = set()       # names submitted and not finished
        self._shutdown_reason: str | None = None  # set by shutdown() on this rank
        self._stopped_reason: str | None = None   # why the engine stopped (all ranks agree)
        self._join_handle: Handle | None = None

        # Coordinator-thread state.
        self._pending: dict[str, Entry] = {}
        self._joined = False
        self._others_joined = False     # some rank has joined (known from the last plan)
        self._join_changed = False
        self._join_cycle = 0
        self._progressed = True
        self._waiting_for_others = False   # all my pending names are cached, others lack some
        self._table_waiting = False        # rank 0 holds uncached names not yet complete
        self._entered_with_work = True
        self._cycles = 0
        self._backoff = _MIN_BACKOFF
        self._heartbeat = settings.cycle_time / 1000
        # How often to compare pending names across ranks (and so notice a stall deadline).
        self._stall_period = settings.stall_check_time
        if settings.stall_shutdown_time:
            self._stall_period = min(self._stall_period, settings.stall_shutdown_time)
        self._last_stall_check = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="mpiddp-coordinator", daemon=True)
        self._thread.start()

    # ---- called from user threads ---------------------------------------------------------
    def submit_many(self, entries: list[Entry]) -> list[Handle]:
        """Queue entries for the coordinator (together, so they can fuse together)."""
        names = [entry.request.name for entry in entries]
        with self._lock:
            self._check_running()
            clash = [n for n in names if n in self._in_flight]
            if clash:
                raise DuplicateNameError(
                    f"a collective named '{clash[0]}' is already in flight on rank {self.rank}; "
                    "wait for it (synchronize) or give the new one another name")
            if len(set(names)) != len(names):
                twice = next(n for n in names if names.count(n) > 1)
                raise DuplicateNameError(f"the name '{twice}' appears twice in one grouped "
                                         f"submission on rank {self.rank}")
            self._in_flight.update(names)
            for entry in entries:
                self._inbox.put(entry)
        if self.timeline.enabled:
            for entry in entries:
                self.timeline.record(entry.request.name, "submit", entry.submitted)
        return [entry.handle for entry in entries]

    def join(self) -> Handle:
        with self._lock:
            self._check_running()
            if self._join_handle is not None:
                raise RuntimeError(f"join() is already in progress on rank {self.rank}")
            if self._in_flight:
                names = ", ".join(repr(n) for n in sorted(self._in_flight)[:5])
                raise MpiddpError(
                    f"join() was called on rank {self.rank} while collectives are still in "
                    f"flight ({names}{', ...' if len(self._in_flight) > 5 else ''}): "
                    "synchronize them first")
            self._join_handle = Handle("join")
            self._inbox.put(_WAKE)
            return self._join_handle

    def shutdown(self, reason: str) -> None:
        """Ask every rank to stop (agreed in the next cycle) and wait for this rank's thread."""
        with self._lock:
            if self._shutdown_reason is None:
                self._shutdown_reason = reason
            self._inbox.put(_WAKE)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._stopped_reason is None and self._thread.is_alive()

    @property
    def stopped_reason(self) -> str | None:
        return self._stopped_reason

    def _check_running(self) -> None:
        if self._stopped_reason is not None:
            raise EngineShutdownError(f"mpiddp has shut down: {self._stopped_reason}")
        if self._shutdown_reason is not None:
            raise EngineShutdownError(f"mpiddp is shutting down: {self._shutdown_reason}")

    # ---- the coordinator thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._cycle():
                pass
        except BaseException as exc:  # a bug or an MPI failure: other ranks would hang
            detail = traceback.format_exc()
            log.critical("mpiddp coordinator on rank %d failed:\n%s", self.rank, detail)
            self._stop(f"the coordinator thread on rank {self.rank} failed: {exc!r}",
                       free_comm=False)
            MPI.COMM_WORLD.Abort(1)
            return
        self._stop(self._stopped_reason or "shut down")

    def _collect(self) -> list[Entry]:
        """Wait for work, then take everything submitted so far.

        * After a productive cycle, a rank with unfinished work goes straight on.
        * A rank that has submitted every name some rank is waiting for (all cached) enters
          the next cycle at once and waits *inside* it, politely: the ranks it waits for join
          the moment they submit, so their last gradients are not delayed by a back-off.
        * Otherwise (this rank itself lacks names others submitted, or names are still being
          negotiated) it waits for its own new work, with a growing back-off for liveness;
          an idle rank waits up to ``cycle_time`` before a heartbeat cycle.
        """
        busy = self._pending or self._joined
        inbox = self._inbox
        items = []
        # A joined rank has no work of its own coming: it always waits inside the next cycle.
        if not (busy and (self._progressed or self._waiting_for_others or self._joined)):
            timeout = self._backoff if busy else self._heartbeat
            try:
                items.append(inbox.get(timeout=timeout))
            except queue.Empty:
                pass
        while not inbox.empty():            # this thread is the only consumer
            items.append(inbox.get_nowait())
        entries = [item for item in items if item is not _WAKE]
        # Spin briefly only when this rank brings new work: partners in lockstep answer within
        # microseconds. A cycle entered to wait for others goes straight to sleeping polls.
        self._entered_with_work = bool(items) or self._progressed
        return entries

    def _cycle(self) -> bool:
        """One negotiation and execution cycle. Returns False once the ranks agreed to stop."""
        for entry in self._collect():
            self._pending[entry.request.name] = entry
        # Plain attribute reads: user threads set these once, under the lock.
        shutdown_requested = self._shutdown_reason is not None
        if self._join_handle is not None and not self._joined:
            self._joined = self._join_changed = True
            self._join_cycle = self._cycles

        self._fill_bits(shutdown_requested)
        request = self.comm.Iallreduce([self._send, MPI.BYTE], [self._recv, MPI.BYTE], MPI.BAND)
        wait_politely(request, spin=self._entered_with_work)
        any_flags, all_joined, ready_bits, pending_bits, invalid_bits = self._read_bits()
        ready_bits &= ~invalid_bits      # a joined rank marks its own changed entries both
        ready_slots = self._set_bits(ready_bits) if ready_bits else []
        invalid_slots = self._set_bits(invalid_bits) if invalid_bits else []
        stats = self.stats
        stats.cycles += 1
        self._cycles += 1                # private: users may reset the stats

        for slot in invalid_slots:       # a rank saw a different signature: renegotiate
            name = self.cache.response(slot).name
            self.cache.evict(slot)
            entry = self._pending.get(name)
            if entry is not None:
                entry.sent = False
        if all_joined:
            ready_slots = []             # every rank set every bit: nothing real is ready

        ready = []
        for slot in ready_slots:
            ready.append(self.cache.response(slot))
            self.cache.touch(slot)
        stats.cache_hits += len(ready)

        plan = None
        if any_flags or invalid_slots:
            plan = self._slow_path(any_flags)
            ready.extend(plan["responses"])
            stats.slow_cycles += 1
        else:
            stats.cached_cycles += 1

        entries = {}
        for response in ready:
            entry = self._pending.pop(response.name, None)
            if entry is not None:
                entries[response.name] = entry
        if self.timeline.enabled:
            for name in entries:
                self.timeline.record(name, "agreed")
        if ready:
            self.executor.run(ready, entries)
            self._progressed = True
            self._backoff = _MIN_BACKOFF
        else:
            self._progressed = False
            self._backoff = min(self._backoff * 2, self._heartbeat)

        # Every name pending anywhere is cached; then either this rank has them all (it only
        # waits for others: wait inside the next cycle) or it lacks some, which only its own
        # next submission can supply (wait for that; the timeout is just a heartbeat).
        known = bool(self._pending) and not self._table_waiting and self._all_pending_cached
        lacking = pending_bits & ~self._my_pending_bits
        self._waiting_for_others = known and not lacking and not ready
        if known and lacking and not ready:
            self._backoff = self._heartbeat
        if plan is not None and plan["shutdown"]:
            self._stopped_reason = plan["shutdown"]
            return False
        if all_joined and self._joined:
            self._finish_join()
        return True

    def _fill_bits(self, shutdown_requested: bool) -> None:
        """Write this rank's cycle message into ``self._send``: one little-endian bit string
        ``~or_flags | and_flags << 64 | ready << 128 | ~invalid << (128 + slots)``, built as a
        Python int (fast bit operations in C) and copied into the send buffer."""
        ready = invalid = pending = or_flags = 0
        all_cached = True
        now = time.perf_counter()
        oldest = now
        joined = self._joined
        cache = self.cache
        for name, entry in self._pending.items():
            if entry.submitted < oldest:
                oldest = entry.submitted
            slot = cache.slot_of(name)
            if slot is None:
                all_cached = False
                if not entry.sent:
                    or_flags |= _NEW_NAMES
                continue
            pending |= 1 << slot
            cached = cache.response(slot).request
            if cached == entry.request and not (self._others_joined and cached.kind != ALLREDUCE):
                ready |= 1 << slot
            else:
                # A new signature, or a non-allreduce while some rank has joined: send it back
                # through rank 0, which reports the mismatch or the join conflict.
                invalid |= 1 << slot
        if joined:
            # A joined rank takes part in every allreduce the others are ready for.
            for slot in cache.slots_of_kind(ALLREDUCE):
                ready |= 1 << slot
                pending |= 1 << slot
        if shutdown_requested:
            or_flags |= _SHUTDOWN
        if self._join_changed:
            or_flags |= _JOIN_CHANGED
        stall_period = self._stall_period
        if now - oldest >= stall_period and now - self._last_stall_check >= stall_period:
            or_flags |= _STALL_CHECK
        self._my_pending_bits = pending
        self._all_pending_cached = all_cached
        slots, mask = self._slots, self._slot_mask
        message = ((~or_flags & _MASK64) | ((_JOINED if joined else 0) << 64) | (ready << 128)
                   | ((~pending & mask) << (128 + slots))
                   | ((~invalid & mask) << (128 + 2 * slots)))
        self._send[:] = message.to_bytes(len(self._send), "little")

    def _read_bits(self) -> tuple[int, bool, int, int, int]:
        """Decode the reduced message: (OR of flags, all joined, ready bits (AND), pending
        bits (OR), invalid bits (OR))."""
        message = int.from_bytes(self._recv, "little")
        slots, mask = self._slots, self._slot_mask
        any_flags = ~message & _MASK64
        all_joined = bool((message >> 64) & _JOINED)
        ready = (message >> 128) & mask
        pending = ~(message >> (128 + slots)) & mask
        invalid = ~(message >> (128 + 2 * slots)) & mask
        return any_flags, all_joined, ready, pending, invalid

    @staticmethod
    def _set_bits(bits: int) -> list[int]:
        slots = []
        while bits:
            low = bits & -bits
            slots.append(low.bit_length() - 1)
            bits ^= low
        return slots

    def _slow_path(self, any_flags: int) -> dict:
        now = time.perf_counter()
        new_requests = []
        for name, entry in self._pending.items():
            if not entry.sent and self.cache.slot_of(name) is None:
                new_requests.append(entry.request)
                entry.sent = True
        stall_check = bool(any_flags & _STALL_CHECK)
        if stall_check:
            self._last_stall_check = now
        payload = {
            "requests": new_requests,
            "shutdown": self._shutdown_reason,
            "joined": self._joined,
            "pending": ({n: now - e.submitted for n, e in self._pending.items()}
                        if stall_check else None),
        }
        self._join_changed = False
        gathered = self.comm.gather(payload, root=0)
        plan = self._make_plan(gathered) if self.rank == 0 else None
        plan = self.comm.bcast(plan, root=0)
        if self.rank != 0:
            for slot, response in plan["cache"]:
                self.cache.put(slot, response)
        self._others_joined = bool(plan["joined"])
        self._table_waiting = plan["table_waiting"]
        if plan["stall"]:
            # Every rank learns why it waits; rank 0 has already logged the warning.
            log.debug("stall report from rank 0:\n%s", plan["stall"])
        return plan

    def _make_plan(self, gathered: list[dict]) -> dict:
        """Rank 0: fold in the new requests, decide what is complete and in what order."""
        for rank, payload in enumerate(gathered):
            for request in payload["requests"]:
                self.table.add(rank, request)
        joined = {rank for rank, payload in enumerate(gathered) if payload["joined"]}
        responses = self.table.take_complete(joined)
        cache_updates = []
        for response in responses:
            if cacheable(response):
                slot = self.cache.next_slot()
                self.cache.put(slot, response)
                cache_updates.append((slot, response))
        shutdown = [f"rank {rank}: {payload['shutdown']}"
                    for rank, payload in enumerate(gathered) if payload["shutdown"]]
        stall_text = None
        if any(payload["pending"] is not None for payload in gathered):
            pending = {rank: payload["pending"] or {} for rank, payload in enumerate(gathered)}
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
        return {"responses": responses, "cache": cache_updates,
                "shutdown": "; ".join(shutdown) if shutdown else None, "stall": stall_text,
                "joined": sorted(joined), "table_waiting": len(self.table) > 0}

    def _finish_join(self) -> None:
        # The last rank to join is the one that joined in the latest cycle (ties: highest).
        last_rank = self.comm.allreduce((self._join_cycle, self.rank), op=MPI.MAX)[1]
        with self._lock:
            handle, self._join_handle = self._join_handle, None
        self._joined = self._others_joined = False
        handle.complete(last_rank)

    def _finish(self, entry: Entry, info=None, error: BaseException | None = None) -> None:
        """Release the entry's name (so it may be submitted again) and complete its handle."""
        with self._lock:
            self._in_flight.discard(entry.request.name)
        if error is not None:
            entry.handle.fail(error)
        else:
            entry.handle.info = info
            entry.handle.complete()

    def _stop(self, reason: str, free_comm: bool = True) -> None:
        """Fail everything still waiting on this rank with the reason the engine stopped."""
        with self._lock:
            self._stopped_reason = reason
            leftovers = list(self._pending.values())
            while not self._inbox.empty():
                item = self._inbox.get_nowait()
                if item is not _WAKE:
                    leftovers.append(item)
            self._pending = {}
            self._in_flight.clear()
            join_handle, self._join_handle = self._join_handle, None
        error_text = f"mpiddp has shut down before this collective finished: {reason}"
        for entry in leftovers:
            entry.handle.fail(EngineShutdownError(f"'{entry.request.name}': {error_text}"))
        if join_handle is not None:
            join_handle.fail(EngineShutdownError(f"join(): {error_text}"))
        if free_comm:
            self.comm.Free()
