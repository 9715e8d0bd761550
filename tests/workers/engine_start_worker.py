"""The engine's communicators, at its start and its stop.

1. start_engine makes its own collectives on the engine's communicator (host names, the
   watchdog's duplicate) before the coordinator thread starts making its cycles' collectives
   there: MPI requires every rank to call a communicator's collectives in the same order, and
   two threads of one rank calling them at once could order them differently on different
   ranks. The communicator records which thread calls each collective, and holds the main
   thread up for a while in each, as a rank descheduled on a busy node would be.
2. Once the engine has stopped, every communicator it made (its own duplicate, the
   watchdog's, the node-local and cross-node ones) is freed: a job that adds and removes
   process sets would otherwise run out of the MPI library's communicators (MPICH: 2048).
3. A timed wait for work that overshoots its deadline (CPython 3.11-3.12) does not hang it.

Prints 'OK <rank> ...' per check on every rank."""
import queue
import threading
import time

import numpy as np
from mpi4py import MPI

import checks
from mpiddp.config import Settings
from mpiddp.engine.coordinator import start_engine
from mpiddp.engine.handle import Handle
from mpiddp.engine.request import ALLREDUCE, Entry, Request
from mpiddp.reduce_ops import ReduceOp

COLLECTIVES = ("allgather", "Allgather", "allreduce", "Allreduce", "Iallreduce", "gather",
               "bcast", "Barrier", "Dup", "Split", "Split_type")
MAKE_COMMUNICATORS = ("Dup", "Split", "Split_type")
calls: list[tuple[str, str]] = []    # (collective, calling thread) on the engine's communicator
made: list[MPI.Comm] = []            # every communicator made from the engine's


class Recording(MPI.Intracomm):
    """An intracommunicator that records its collectives (the main thread arriving late)
    and the communicators made from it (recording in turn)."""


def recorded(method):
    def call(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.2)
        calls.append((method, threading.current_thread().name))
        result = getattr(MPI.Intracomm, method)(self, *args, **kwargs)
        if method in MAKE_COMMUNICATORS and result != MPI.COMM_NULL:
            result = Recording(result)
            made.append(result)
        return result
    return call


for _method in COLLECTIVES:
    setattr(Recording, _method, recorded(_method))


class EngineParent(MPI.Intracomm):
    """The communicator given to start_engine: its duplicate (the engine's own) records."""

    def Dup(self, *args):
        private = Recording(MPI.Intracomm.Dup(self, *args))
        made.append(private)
        return private


rank = MPI.COMM_WORLD.Get_rank()
engine = start_engine(EngineParent(MPI.COMM_WORLD.Dup()), Settings(cycle_time=1.0))
time.sleep(0.3)                        # the coordinator cycles every millisecond meanwhile
engine.shutdown("test over")
first_cycle = next(i for i, (_, thread) in enumerate(calls) if thread == "mpiddp-coordinator")
late = [(method, i) for i, (method, thread) in enumerate(calls)
        if thread != "mpiddp-coordinator" and i > first_cycle]
assert not late, (f"rank {rank}: the main thread's {late} (collective, position) came after "
                  f"the coordinator's first collective (position {first_cycle})")
assert any(method == "Dup" for method, _ in calls[:first_cycle]), calls   # the watchdog's
checks.ok(f"engine start: {first_cycle} collectives before the coordinator's first",
          rank=rank, every_rank=True)
kept = [i for i, comm in enumerate(made) if comm != MPI.COMM_NULL]
assert len(made) >= 4 and not kept, \
    f"rank {rank}: communicators {kept} of the {len(made)} the engine made are not freed"
checks.ok(f"engine stop: the {len(made)} communicators it made are freed", rank=rank,
          every_rank=True)


# 3. CPython 3.11 and 3.12's SimpleQueue.get(timeout=t) can wait without a deadline: when the
#    queue's lock is free (the last get() returned an item) and the thread is descheduled
#    past the deadline between its first try of the lock and its second (a busy node:
#    DataLoader workers on every core, or more ranks than cores), it waits for the next put,
#    however long. A coordinator that waited for work that way while its rank had pending
#    work and no more submissions coming never entered the next cycle, and every rank hung
#    (found with 33 ranks on 2 cores). The inbox here always overshoots in that state; the
#    engine must not depend on a timed get returning.
class DeadlineOvershootingQueue(queue.SimpleQueue):
    lock_free = False

    def get(self, block=True, timeout=None):
        if block and timeout is not None and self.lock_free and self.empty():
            time.sleep(timeout)            # descheduled past the deadline...
            item = super().get()           # ...then waits for a put, however long
        else:
            try:
                item = super().get(block, timeout)
            except queue.Empty:
                self.lock_free = False     # a timed-out get leaves the lock held
                raise
        self.lock_free = True              # a get that returns an item frees it
        return item


queue.SimpleQueue = DeadlineOvershootingQueue    # for every queue made from now on
engine = start_engine(MPI.COMM_WORLD, Settings(cycle_time=5.0))
for step in range(4):
    # the ranks submit in turn, the other one waiting for work meanwhile
    if step % 2 != rank:
        time.sleep(0.1)
    values = np.full(8, rank + 1.0, np.float32)
    entry = Entry(Request(f"overshoot.{step}", ALLREDUCE, "float32", (8,), op=int(ReduceOp.SUM)),
                  values, values, Handle(f"overshoot.{step}"))
    [handle] = engine.submit_many([entry])
    handle.wait(timeout=20)                # a hang is an error here, not a stuck test
    assert np.all(values == 3.0), values
engine.shutdown("test over")
checks.ok("a timed wait for work that overshoots its deadline does not hang the engine",
          rank=rank, every_rank=True)
