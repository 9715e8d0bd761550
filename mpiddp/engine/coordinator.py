"""The engine: a background coordinator thread that owns every collective call.

User threads ``submit_many`` entries and get handles at once. The coordinator thread runs
cycles of the protocol in ``protocol.py`` (what a rank says and learns in a cycle, with no
threads or MPI) over a ``ControlChannel`` (MPI in production, an in-memory fake in tests), waits
between and inside cycles as ``WaitPolicy`` says, and hands each cycle's agreed, ordered list
to the executor. This module is only that shell: threads, the inbox, handles and stopping.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import replace
from typing import Callable, Optional

from mpi4py import MPI

from ..buffers import use_default_device
from ..config import Settings
from ..errors import DuplicateNameError, EngineShutdownError, MpiddpError, PeerLostError
from .autotune import Autotuner, Retune
from .channel import ControlChannel, MPIChannel
from .executor import Executor
from .handle import Handle
from .inbox import Inbox
from .liveness import Watchdog, launch_host
from .protocol import CycleProtocol
from .request import BARRIER, Entry, Request
from .speculation import Speculation
from .stats import EngineStats
from .timeline import Timeline
from .waiting import WaitPolicy

log = logging.getLogger("mpiddp")

_WAKE = object()   # inbox token: "look at the flags" (join, shutdown)
# How long a rank that lost a partner's connection waits for the launcher to end the job
# before ending it itself.
PEER_LOST_GRACE_SECONDS = 5.0

# make_executor(stats, timeline, complete) -> an object with run(responses, entries),
# knobs(), retune(knobs), close(), gradient_cycle_bytes(gradient_bytes) and
# priority_cycle_bytes.
ExecutorFactory = Callable[[EngineStats, Timeline, Callable[..., None]], object]


def start_engine(comm: MPI.Comm, settings: Settings) -> "Engine":
    """The production engine: on a private duplicate of ``comm`` (user traffic can never
    interleave with ours), MPI control channel, MPI executor."""
    private = comm.Dup()
    # The watchdog calls MPI from a thread of its own: only with MPI_THREAD_MULTIPLE. Its
    # communicator and the host names are collectives on ``private``, made here before the
    # coordinator starts: afterwards its collectives on ``private`` could come between them
    # on one rank and not on another (MPI requires the same order on every rank).
    watchdog_comm = names = None
    if private.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        names = private.allgather((MPI.Get_processor_name(), launch_host()))
        watchdog_comm = private.Dup()
    channel = MPIChannel(private)

    def make_executor(stats, timeline, complete):
        executor = Executor(private, settings, stats, timeline, complete)
        # Where transfers across nodes take the engine's own TCP connections, so does the
        # cycle's bit vector (channel.py); the executor owns and closes the connections.
        control = executor.partner_sockets.get("control")
        if control is not None:
            channel.use_sockets(control)
        return executor

    engine = Engine(channel, settings, make_executor)
    if watchdog_comm is not None:
        engine.watchdog = watchdog = Watchdog(
            watchdog_comm, [n for n, _ in names], lambda: engine.stats.cycles,
            settings.peer_check_time, launch_hosts=[h for _, h in names],
            position=lambda: (engine.cycles_begun, engine.waiting_for_work,
                              len(engine.protocol.pending)),
            end_behind_after=settings.stall_shutdown_time)
        engine.on_stop.append(watchdog.stop)
    return engine


class Engine:
    def __init__(self, channel: ControlChannel, settings: Settings,
                 make_executor: ExecutorFactory):
        self.channel = channel
        self.rank, self.size = channel.rank, channel.size
        self.stats = EngineStats()
        self.timeline = Timeline(bool(settings.timeline))
        self.executor = make_executor(self.stats, self.timeline, self._complete)
        # The cycle budget and the speculative bytes as the executor resolved them (unset:
        # sized from the measured links; forward overlap's requests then carry a budget of
        # their own, sized for its gradients: Request.cycle_bytes, torch/gradients/cycle_budget.py).
        self.cycle_budget_sized = settings.priority_cycle_bytes is None
        self.settings = settings = replace(
            settings, priority_cycle_bytes=self.executor.priority_cycle_bytes,
            speculation_bytes=self.executor.speculation_bytes)
        self.speculation = Speculation(settings.speculation_bytes)
        self.protocol = CycleProtocol(self.rank, self.size, settings)
        self.policy = WaitPolicy(settings.cycle_time / 1000)
        self.on_stop: list[Callable[[], None]] = []   # run on the coordinator when it stops
        self.watchdog: Optional[Watchdog] = None      # start_engine's, where MPI allows it
        # Autotune: rank 0 searches; every rank records what it applied at which cycle.
        self.tuner = Autotuner(settings, self.executor.knobs()) \
            if settings.autotune and self.rank == 0 and self.size > 1 else None
        self.retunes: list[tuple[int, Retune]] = []

        self._lock = threading.Lock()
        self._inbox = Inbox()                   # entries and wake-up tokens
        self.cycles_begun = 0                   # cycles whose agreement this rank entered
        self.waiting_for_work = False           # in the inbox's wait (both: the watchdog)
        self._in_flight: set[str] = set()       # names submitted and not finished
        self._shutdown_reason: str | None = None  # set by shutdown() on this rank
        self._stopped_reason: str | None = None   # why the engine stopped (all ranks agree)
        self._join_handle: Handle | None = None
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
            stats = self.stats
            for entry in entries:
                entry.handle.stats = stats       # the time callers wait for it counts there
            self._inbox.put_many(entries)
        if self.timeline.enabled:
            for entry in entries:
                self.timeline.record(entry.request.name, "submit", entry.submitted)
        return [entry.handle for entry in entries]

    def barrier(self, name: str, action: Callable[[], None] | None = None,
                deadline: float = 0.0) -> Handle:
        """Submit a barrier; ``action`` runs on the coordinator at the barrier's place in the
        agreed order, i.e. at the same point on every rank (engine reconfiguration).
        ``deadline`` > 0: a library call every rank must make (``Request.deadline``)."""
        entry = Entry(Request(name, BARRIER, "uint8", (), deadline=deadline), None, None,
                      Handle(name), action=action)
        return self.submit_many([entry])[0]

    def gradient_cycle_bytes(self, gradient_bytes: int) -> int:
        """Forward overlap's cycle budget for ``gradient_bytes`` of gradients a step, from the
        links this engine measured (``cost_model.gradient_cycle_bytes``): the same on every
        rank, whose links are measured together."""
        return self.executor.gradient_cycle_bytes(gradient_bytes)

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
            self._join_handle.stats = self.stats
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
            # This thread's CUDA calls (device buffers, kernels, streams) go to the rank's
            # own GPU: a new thread starts on device 0.
            use_default_device()
            while self._cycle():
                pass
        except BaseException as exc:  # a bug or an MPI failure: other ranks would hang
            detail = traceback.format_exc()
            log.critical("mpiddp coordinator on rank %d failed:\n%s", self.rank, detail)
            if isinstance(exc, PeerLostError):
                # A partner's process died (the kernel closed its sockets at once). Its
                # launcher reports how (mpiexec: "KILLED BY SIGNAL: 9 ... RUNNING AT host";
                # srun: "Killed"), which the elastic launcher (mpiddp.run) reads to leave
                # the node out; it also ends the job. Give it that time before this rank
                # ends the job itself (and before the user's handles fail and their
                # thread ends it), else the report would be this rank's abort alone.
                time.sleep(PEER_LOST_GRACE_SECONDS)
            self._stop(f"the coordinator thread on rank {self.rank} failed: {exc!r}",
                       close=False)
            self.channel.abort()
            return
        self._stop(self._stopped_reason or "shut down")

    def _collect(self) -> list[Entry]:
        """Wait for work as the policy says, then take everything submitted so far."""
        protocol = self.protocol
        timeout = self.policy.timeout_for_work(bool(protocol.pending) or protocol.joined,
                                               protocol.joined)
        self.waiting_for_work = True
        items = self._inbox.take(timeout)
        self.waiting_for_work = False
        self.policy.entered(bool(items))
        return [item for item in items if item is not _WAKE]

    def _cycle(self) -> bool:
        """One negotiation and execution cycle. Returns False once the ranks agreed to stop."""
        protocol, channel, stats = self.protocol, self.channel, self.stats
        protocol.add(self._collect())
        # Plain attribute reads: user threads set these once, under the lock.
        shutdown_reason = self._shutdown_reason
        if self._join_handle is not None:
            protocol.join()
        # Small cached all-reduces ride beside the negotiation (speculation.py).
        sums = self.speculation.begin(protocol.cache, protocol.pending)
        self.cycles_begun += 1          # the watchdog's roll calls compare it across ranks
        reduced = channel.and_reduce(protocol.encode(shutdown_reason is not None),
                                     self.policy.wait, self.policy.spin, sums)
        bits = protocol.decode(reduced)
        stats.cycles += 1
        speculated = ()
        if sums:
            bits, speculated = self._finish_speculated(bits)
        plan = None
        if bits.slow:
            message = protocol.slow_message(bits, shutdown_reason)
            gathered = channel.gather_to_root(message)
            plan = channel.broadcast_from_root(
                protocol.make_plan(gathered) if self.rank == 0 else None)
            stats.slow_cycles += 1
        else:
            stats.cached_cycles += 1
        result = protocol.conclude(bits, plan)
        if result.retune is not None:       # the same cycle on every rank, before running it
            self._retune(result.retune)
        stats.cache_hits += len(bits.ready) + len(speculated)
        if self.timeline.enabled:
            for name in result.entries:
                self.timeline.record(name, "agreed")
        if self.tuner is not None and (result.ready or speculated):
            # The bytes finished in the negotiation count too.
            retune = self.tuner.observe(result.ready + [r for _, r, _ in speculated],
                                        time.perf_counter())
            if retune is not None:
                protocol.announce(retune)
        if result.ready:
            self.executor.run(result.ready, result.entries)
        self.policy.after_cycle(bool(result.ready or speculated), result.all_known,
                                result.lacking)
        if result.stop_reason:
            self._stopped_reason = result.stop_reason
            return False
        if result.join_complete:
            self._complete_join()
        return True

    def _finish_speculated(self, bits):
        """Finish the small all-reduces whose sum came with the negotiation (speculation.py)
        and take them out of the cycle's ready list; returns the bits left and those done."""
        done, ready = self.speculation.finish(bits.ready, self.protocol.pending)
        if not done:
            return bits, done
        if self.timeline.enabled:
            for entry, _, _ in done:
                if entry is not None:
                    self.timeline.record(entry.request.name, "agreed")
        self.executor.complete_speculated(done)
        return bits._replace(ready=ready), done

    def _retune(self, retune: Retune) -> None:
        """Apply autotune's settings (from rank 0's plan, at this cycle on every rank)."""
        self.executor.retune(retune.knobs)
        self.policy.heartbeat = retune.knobs.cycle_time / 1000
        self.retunes.append((self.stats.cycles, retune))
        if self.tuner is not None:
            self.tuner.applied(retune)

    @property
    def autotune_finished(self) -> bool:
        """The search has ended on this rank and its best settings apply."""
        return bool(self.retunes) and self.retunes[-1][1].final

    def _complete_join(self) -> None:
        # The last rank to join is the one that joined in the latest cycle (ties: highest).
        last_rank = self.channel.max((self.protocol.join_cycle, self.rank))[1]
        with self._lock:
            handle, self._join_handle = self._join_handle, None
        handle.complete(last_rank)

    def _complete(self, entry: Entry, info=None, error: BaseException | None = None) -> None:
        """Release the entry's name (so it may be submitted again) and complete its handle."""
        with self._lock:
            self._in_flight.discard(entry.request.name)
        if error is not None:
            entry.handle.fail(error)
        else:
            entry.handle.info = info
            entry.handle.complete()

    def _stop(self, reason: str, close: bool = True) -> None:
        """Fail everything still waiting on this rank with the reason the engine stopped."""
        with self._lock:
            self._stopped_reason = reason
            leftovers = self.protocol.take_pending()
            leftovers += [item for item in self._inbox.drain() if item is not _WAKE]
            self._in_flight.clear()
            join_handle, self._join_handle = self._join_handle, None
        error_text = f"mpiddp has shut down before this collective finished: {reason}"
        for entry in leftovers:
            entry.handle.fail(EngineShutdownError(f"'{entry.request.name}': {error_text}"))
        if join_handle is not None:
            join_handle.fail(EngineShutdownError(f"join(): {error_text}"))
        if close:                       # an orderly stop (a failure aborts the job instead)
            for action in self.on_stop:
                action()
            self.executor.close()
            self.channel.close()
