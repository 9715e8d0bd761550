"""The lost-peer watchdog: a job whose node died or lost its network ends, naming who is gone.

A rank that dies, or whose link goes down, leaves the others inside an MPI call that never
completes: over TCP nothing fails for many minutes, and the stall inspector cannot help (it
needs the control cycle to complete). The coordinator completes a cycle at least every
heartbeat (``MPIDDP_CYCLE_TIME``) while the ranks are healthy, idle or not, so a cycle count
that stands still for ``MPIDDP_PEER_CHECK_TIME`` (20 s) means the coordinator is stuck in one
MPI call (or in one very long transfer). Then this watchdog holds a roll call on a
communicator of its own: it pings every other rank and waits ``ANSWER_SECONDS`` for the
answers, which every rank's watchdog thread gives from its own polling loop, whatever its
coordinator is doing.

* Everyone answers: the operation is merely slow; wait on, and check again after another
  ``MPIDDP_PEER_CHECK_TIME``.
* Some ranks do not: they died or cannot be reached. Every surviving rank prints which ranks
  are missing and on which hosts, and ends the job (``MPI_Abort``; if even that cannot reach
  the launcher, the process exits), so that no rank waits forever and the scheduler can
  requeue the job.
* Everyone answers, but some ranks' coordinators wait for work of their own while the others
  wait for them in the next cycle (each answer carries its rank's count of cycles begun,
  whether its coordinator is waiting for work, its pending collectives and its process id).
  A healthy coordinator waits for work at most a heartbeat before it begins a cycle, so this
  is a defect (CPython 3.11-3.12's ``SimpleQueue.get`` was one: ``inbox.py``). A rank still
  busy in the previous cycle's transfers (a huge broadcast on a slow link) is not behind in
  this sense. The lowest rank that is not behind names them with what they hold, once, when
  a second roll call finds them still behind; after ``MPIDDP_STALL_SHUTDOWN_TIME`` (unless
  0) of it, it ends the job, so that nothing hangs silently.

The watchdog makes MPI calls from its own thread, so it runs only with
``MPI_THREAD_MULTIPLE``.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from ..buffers import use_default_device

POLL_SECONDS = 0.25         # how often the watchdog answers pings and looks at the cycle count
ANSWER_SECONDS = 10.0       # how long a roll call waits for the answers
EXIT_GRACE_SECONDS = 10.0   # MPI_Abort that cannot reach the launcher: exit after this
PING, PONG = 1, 2           # message tags on the watchdog's own communicator
# A pong: the ping's serial, then the answering rank's position (cycles begun, waiting for
# work (0/1), collectives pending, process id).
PONG_FIELDS = 5

log = logging.getLogger("mpiddp")


def describe_missing(missing: list[int], hosts: list[str]) -> str:
    """'ranks 2, 3 on node-b; rank 5 on node-c'."""
    by_host: dict[str, list[int]] = {}
    for rank in missing:
        by_host.setdefault(hosts[rank], []).append(rank)
    parts = []
    for host, ranks in by_host.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))} on {host}")
    return "; ".join(parts)


def furthest_begun(positions: dict) -> int:
    """The most cycles any rank of a roll call has begun (``positions``: rank -> (cycles
    begun, waiting for work, pending, pid))."""
    return max(position[0] for position in positions.values())


class Watchdog:
    """Roll calls when the coordinator makes no progress; ends the job on lost ranks."""

    def __init__(self, comm: MPI.Comm, hosts: list[str], progress: Callable[[], int],
                 stalled_after: float, on_lost: Callable[[str], None] | None = None,
                 launch_hosts: list[str] | None = None,
                 position: Optional[Callable[[], tuple[int, int, int]]] = None,
                 end_behind_after: float = 0.0):
        self.comm = comm
        self.launch_hosts = launch_hosts or hosts
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.hosts = hosts
        self.progress = progress
        self.stalled_after = stalled_after
        self.on_lost = on_lost or end_job
        # (cycles begun, waiting for work, collectives pending) of this rank's coordinator;
        # the last roll call's answers: rank -> that and the pid; end_behind_after 0: never
        # end the job for ranks behind.
        self.position = position or (lambda: (0, 0, 0))
        self.end_behind_after = end_behind_after
        self.positions: dict[int, tuple[int, int, int, int]] = {}
        self._behind_since: Optional[float] = None   # first roll call that found ranks behind
        self._reported: Optional[list[int]] = None    # the ranks last warned of
        self._serial = 0
        # One receive posted per peer, never MPI_ANY_SOURCE: over TCP this MPICH's UCX
        # netmod lost wildcard matches (roll calls across 4 emulated nodes, every rank
        # healthy, missed half their answers; one per peer heard them all).
        self._peers = [peer for peer in range(self.size) if peer != self.rank]
        self._pings = np.zeros(self.size, np.int64)
        self._ping_requests = [self._receive(self._pings, peer, PING) for peer in self._peers]
        # Answers and pings in flight: referenced until complete, never waited for (a send
        # to a lost rank never completes).
        self._sends: list[MPI.Request] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpiddp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and release the communicator (the ranks have agreed to stop)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._cancel(self._ping_requests)
        self.comm.Free()     # answers still in flight complete first (MPI_Comm_free)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        use_default_device()    # a CUDA-aware MPI may touch the current device: the rank's own
        last, since = self.progress(), time.monotonic()
        stalled_since = since
        while not self._stop.wait(POLL_SECONDS):
            self._answer_pings()
            now, count = time.monotonic(), self.progress()
            if count != last:
                last, since, stalled_since = count, now, now
                self._behind_since = self._reported = None
            elif now - since >= self.stalled_after:
                missing = self.roll_call()
                if missing:
                    record_lost(sorted({self.launch_hosts[r] for r in missing}), self.rank,
                                self.launch_hosts[self.rank])
                    self.on_lost(self.report(missing, now - stalled_since))
                    return
                since = time.monotonic()        # everyone is there: a slow operation...
                ending = self._check_behind(since, since - stalled_since)
                if ending:                      # ...unless some coordinators do not cycle
                    self.on_lost(ending)
                    return

    def _check_behind(self, now: float, stalled_for: float) -> Optional[str]:
        """After a roll call everyone answered: warn of ranks behind (see the module
        docstring); return the report to end the job with, once they have been behind for
        ``end_behind_after``."""
        behind = self.behind()
        if not behind:
            self._behind_since = self._reported = None
            return None
        if self._behind_since is None:      # not yet: a rank may have been caught in the
            self._behind_since = now        # moment between two cycles
            return None
        if self.rank != min(set(range(self.size)) - set(behind)):
            return None                     # one rank speaks for all
        ending = 0 < self.end_behind_after <= now - self._behind_since
        text = self.report_behind(behind, stalled_for, ending)
        if ending:
            return text
        if self._reported != behind:
            log.warning(text)
            self._reported = behind
        return None

    def _receive(self, into: np.ndarray, peer: int, tag: int) -> MPI.Request:
        """Receive into row ``peer`` of ``into`` (one value, or a pong's fields)."""
        return self.comm.Irecv([into[peer:peer + 1], MPI.INT64_T], peer, tag)

    @staticmethod
    def _cancel(requests: list) -> None:
        for request in requests:
            if request != MPI.REQUEST_NULL:     # complete ones are null
                request.Cancel()
        MPI.Request.Waitall(requests)

    def _answer_pings(self) -> None:
        """Answer every ping received so far with a pong carrying the ping's serial."""
        for index in MPI.Request.Testsome(self._ping_requests) or ():
            peer = self._peers[index]
            answer = np.array([self._pings[peer], *self.position(), os.getpid()], np.int64)
            self._sends.append(self.comm.Isend([answer, MPI.INT64_T], peer, PONG))
            self._ping_requests[index] = self._receive(self._pings, peer, PING)
        self._sends = [r for r in self._sends if not r.Test()]

    def roll_call(self, answer_within: float = ANSWER_SECONDS) -> list[int]:
        """Ping every other rank; return the ranks that did not answer in time. The answers'
        positions (and this rank's) are left in ``positions``."""
        self._serial += 1
        ping = np.array([self._serial], np.int64)
        for peer in self._peers:
            self._sends.append(self.comm.Isend([ping, MPI.INT64_T], peer, PING))
        pongs = np.zeros((self.size, PONG_FIELDS), np.int64)
        requests = [self._receive(pongs, peer, PONG) for peer in self._peers]
        waiting = set(self._peers)
        deadline = time.monotonic() + answer_within
        while waiting and time.monotonic() < deadline:
            for index in MPI.Request.Testsome(requests) or ():
                peer = self._peers[index]
                if int(pongs[peer, 0]) == self._serial:
                    waiting.discard(peer)       # its request stays complete (null)
                else:                           # a late answer to an earlier call
                    requests[index] = self._receive(pongs, peer, PONG)
            self._answer_pings()            # peers may be holding roll calls of their own
            if waiting:
                time.sleep(0.01)
        self._cancel(requests)
        self.positions = {peer: tuple(int(v) for v in pongs[peer, 1:])
                          for peer in self._peers if peer not in waiting}
        self.positions[self.rank] = (*self.position(), os.getpid())
        return sorted(waiting)

    def behind(self) -> list[int]:
        """The ranks of the last roll call whose coordinators wait for work of their own,
        having begun fewer cycles than the most any rank has begun (the others wait for them
        in that cycle)."""
        if not self.positions:
            return []
        furthest = furthest_begun(self.positions)
        return sorted(r for r, (begun, waiting, _, _) in self.positions.items()
                      if begun < furthest and waiting)

    def report_behind(self, behind: list[int], stuck_for: float, ending: bool) -> str:
        """The warning (and with ``ending``, the job's end) naming the ranks behind."""
        furthest = furthest_begun(self.positions)
        held = "; ".join(
            f"rank {r} on {self.hosts[r]} (pid {self.positions[r][3]}): cycle "
            f"{self.positions[r][0]} begun, {self.positions[r][2]} collectives pending"
            for r in behind[:8]) + (f"; and {len(behind) - 8} more" if len(behind) > 8 else "")
        text = (f"mpiddp: no progress for {stuck_for:.0f} s. Every rank answers, but the "
                f"coordinators of {len(behind)} rank(s) wait for work instead of beginning "
                f"cycle {furthest}, in which the others wait for them: {held}. A coordinator "
                "waits for work a heartbeat at most: this is a defect in mpiddp (their stacks: "
                "py-spy dump --pid PID).")
        if ending:
            return text + (f" Ending the job after {self.end_behind_after:.0f} s of this "
                           "(MPIDDP_STALL_SHUTDOWN_TIME).")
        if self.end_behind_after > 0:
            return text + (f" The job ends if this lasts {self.end_behind_after:.0f} s "
                           "(MPIDDP_STALL_SHUTDOWN_TIME).")
        return text

    def report(self, missing: list[int], stuck_for: float) -> str:
        return (f"mpiddp: rank {self.rank} (on {self.hosts[self.rank]}) has made no progress "
                f"for {stuck_for:.0f} s, and {describe_missing(missing, self.hosts)} did not "
                f"answer within {ANSWER_SECONDS:.0f} s: they have died or cannot be reached "
                "(their node or its network is down). Ending the job so that no rank waits "
                "for them forever.")


LOST_NODES_DIR = "MPIDDP_LOST_NODES_DIR"    # set by ``python -m mpiddp.run``
LAUNCH_HOSTS = "MPIDDP_LAUNCH_HOSTS"        # too: each rank's host as launched, 'a,a,b,b'


def launch_host() -> str:
    """This rank's node as its launcher named it (mpiexec's host list entry, Slurm's node
    name), which the elastic launcher can leave out of the next launch; else the MPI
    processor name. Hydra says it (``PMI_HOSTNAME``), Slurm too; under Open MPI, which does
    not, ``mpiddp.run`` passes its host list and the ranks fill it in order."""
    named = os.environ.get("PMI_HOSTNAME") or os.environ.get("SLURMD_NODENAME")
    if not named and os.environ.get(LAUNCH_HOSTS):
        per_rank = os.environ[LAUNCH_HOSTS].split(",")     # mpiddp.run: rank r on entry r
        rank = MPI.COMM_WORLD.Get_rank()
        named = per_rank[rank] if rank < len(per_rank) else None
    return named or MPI.Get_processor_name()


def record_lost(hosts: list[str], rank: int, reporter: str) -> None:
    """Tell the elastic launcher (``mpiddp.run``) which nodes are lost: one file per
    reporting rank, ``lost.<rank>``, ``# from <reporter's node>`` then a host per line, in the
    directory it names in ``MPIDDP_LOST_NODES_DIR`` (nothing without it). Written before the
    job is ended. The reporter's node lets the launcher discard the report of a node that
    was itself cut off (to it, every other node is lost)."""
    directory = os.environ.get(LOST_NODES_DIR)
    if not directory:
        return
    try:
        tmp = os.path.join(directory, f".lost.{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(f"# from {reporter}\n" + "".join(f"{host}\n" for host in hosts))
        os.replace(tmp, os.path.join(directory, f"lost.{rank}"))
    except OSError as exc:       # the report on stderr still names them
        sys.stderr.write(f"mpiddp: could not record the lost nodes in {directory}: {exc}\n")


def end_job(report: str) -> None:
    """Print the report and end the MPI job; exit on our own if MPI_Abort cannot (it needs
    the launcher, which may be on the far side of the broken link)."""
    sys.stderr.write(report + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    exit_later = threading.Timer(EXIT_GRACE_SECONDS, os._exit, (1,))
    exit_later.daemon = True
    exit_later.start()
    MPI.COMM_WORLD.Abort(1)
