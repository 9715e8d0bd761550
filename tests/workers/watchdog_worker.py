"""The lost-peer watchdog among healthy ranks: it must never report one of them lost.

Usage: watchdog_worker.py roll-calls | long-transfer | frozen-coordinator. Prints 'OK ...'
on rank 0.

The watchdog (mpiddp/engine/liveness.py) holds a roll call when its rank's coordinator makes
no progress. ``roll-calls``: each rank's watchdog is told that nothing progresses, so all of
them hold roll calls at once from their own threads, as in a real stall; none may find a
rank missing. ``long-transfer`` (with a short ``MPIDDP_PEER_CHECK_TIME``): an all-reduce that
outlasts the check time, during which the watchdogs hold their roll calls; it must complete.
Over TCP this MPICH lost the answers to wildcard receives: healthy ranks were reported lost
and the job was ended. ``frozen-coordinator`` (3 ranks, ``MPIDDP_PEER_CHECK_TIME=1``,
``MPIDDP_STALL_SHUTDOWN_TIME=4``): rank 1's coordinator stops collecting once it has a
collective pending (as CPython 3.11-3.12's ``SimpleQueue.get`` made it do); every rank still
answers, so no rank is lost, but rank 0 must name rank 1 as behind (a warning, once) and end
the job after the stall shutdown time; released, the collective completes.
"""
import sys
import threading
import time

import torch
from mpi4py import MPI

import mpiddp
from mpiddp.runtime import current

ANSWER_WITHIN = 3.0
STALL_SECONDS = 6.0
LONG_TRANSFER_FLOATS = 100 * 2**20    # 400 MB: ~6 s at 4 nodes on 1 Gbit/s links

torch.set_num_threads(1)
mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
tensor = torch.ones(256)
for _ in range(5):                      # the engine's connections in use, as in training
    mpiddp.allreduce_(tensor, name="warm-up", op=mpiddp.Sum)

watchdog = current.require("watchdog test").engine.watchdog
assert watchdog is not None, "no watchdog: MPI without MPI_THREAD_MULTIPLE?"
calls, lost = [], []
roll_call = watchdog.roll_call


def timed_roll_call(answer_within=ANSWER_WITHIN):
    start = time.monotonic()
    missing = roll_call(answer_within)
    calls.append((missing, time.monotonic() - start))
    return missing


watchdog.roll_call = timed_roll_call
watchdog.on_lost = lost.append          # record instead of ending the job
mpiddp.barrier()
if sys.argv[1] == "roll-calls":
    progress, stalled_after = watchdog.progress, watchdog.stalled_after
    watchdog.stalled_after = 0.5
    watchdog.progress = lambda: 0       # from now on its thread sees a stalled coordinator
    time.sleep(STALL_SECONDS)
    watchdog.progress, watchdog.stalled_after = progress, stalled_after
    done = "held at once"
elif sys.argv[1] == "frozen-coordinator":
    engine = current.require("watchdog test").engine

    def record_and_keep_answering(report):
        """The stand-in for ending the job: record, then go on answering roll calls until
        stopped. (Its thread would otherwise return, as after MPI_Abort, and a rank still
        waiting would find this one silent and report it lost, which the real end of the
        job never lets happen: seen once under CI load.)"""
        lost.append(report)
        while not watchdog._stop.wait(0.05):
            watchdog._answer_pings()
    watchdog.on_lost = record_and_keep_answering
    release = threading.Event()
    if rank == 1:
        take = engine._inbox.take

        def freezing_take(timeout):
            items = take(timeout)
            if engine.protocol.pending and not release.is_set():
                release.wait()          # pending work, and the coordinator collects no more
            return items
        engine._inbox.take = freezing_take
        threading.Timer(9.0, release.set).start()
    else:
        time.sleep(0.5)                 # rank 1's name is pending before the others submit
    try:
        out = mpiddp.allreduce(torch.ones(4), name="frozen", op=mpiddp.Sum)
        assert float(out[0]) == size, out
        outcome = "completed"
    except mpiddp.EngineShutdownError as exc:   # released after the stall shutdown time:
        assert "MPIDDP_STALL_SHUTDOWN_TIME" in str(exc), exc    # the stall check ends it
        outcome = "ended by the stall check"
    everyone = MPI.COMM_WORLD.allgather((lost, outcome))     # the engine may have stopped
    if rank == 0:
        assert [len(reports) for reports, _ in everyone] == [1, 0, 0], everyone
        report = everyone[0][0][0]
        for needle in ("rank 1 on ", "wait for work instead of beginning cycle",
                       "1 collectives pending", "pid ",
                       "Ending the job after 4 s"):
            assert needle in report, (needle, report)
        assert "rank 0 on" not in report and "rank 2 on" not in report, report
        print(f"OK rank 0 named the frozen coordinator of rank 1 and ended the job; released, "
              f"the collective {outcome}", flush=True)
    mpiddp.shutdown()
    sys.exit(0)
else:
    big = torch.ones(LONG_TRANSFER_FLOATS)
    start = time.monotonic()
    mpiddp.allreduce_(big, name="long", op=mpiddp.Sum)
    seconds = time.monotonic() - start
    assert float(big[0]) == float(big[-1]) == size, (big[0], big[-1])
    done = f"during a {seconds:.1f} s all-reduce"

everyone = mpiddp.allgather_object((calls, lost))
if rank == 0:
    for who, (made, reports) in enumerate(everyone):
        assert not reports, f"rank {who}'s watchdog ended the job: {reports}"
        assert made, f"rank {who}'s watchdog held no roll call"
        missed = [missing for missing, _ in made if missing]
        assert not missed, f"rank {who}'s roll calls missed healthy ranks: {missed}"
    slowest = max(seconds for made, _ in everyone for _, seconds in made)
    count = sum(len(made) for made, _ in everyone)
    print(f"OK {count} roll calls on {size} ranks {done} heard every rank "
          f"(slowest {slowest:.2f} s)", flush=True)
mpiddp.shutdown()
