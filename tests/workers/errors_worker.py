"""Error cases that must fail cleanly on every rank, with messages naming what and where.

Usage: errors_worker.py <scenario>. Each rank prints 'OK <rank> <check>' per passed check.
"""
import sys
import time

import torch

import checks
import mpiddp
from checks import expect

torch.set_num_threads(1)


def ok(check):
    checks.ok(check, rank=mpiddp.rank() if mpiddp.is_initialized() else "-", every_rank=True)


def mismatches():
    before_init = expect(mpiddp.NotInitializedError, lambda: mpiddp.allreduce(torch.ones(2)),
                         "init()")
    expect(mpiddp.NotInitializedError, mpiddp.rank, "rank()", "init()")
    mpiddp.init()
    mpiddp.init()      # idempotent
    rank, size = mpiddp.rank(), mpiddp.size()
    ok(f"use before init: {before_init}")

    shape = (4, 3) if rank != size - 1 else (3, 4)
    text = expect(mpiddp.TensorMismatchError,
                  lambda: mpiddp.allreduce(torch.ones(shape), name="layer1.weight"),
                  "layer1.weight", "shapes", "[4, 3]", f"rank {size - 1} sent [3, 4]")
    ok(f"shape mismatch: {text}")

    dtype = torch.float32 if rank % 2 == 0 else torch.float64
    expect(mpiddp.TensorMismatchError,
           lambda: mpiddp.allreduce(torch.ones(3, dtype=dtype), name="mixed.dtype"),
           "mixed.dtype", "dtypes", "float32", "float64", "rank 1 sent float64")
    ok("dtype mismatch")

    op = mpiddp.Sum if rank == 0 else mpiddp.Max
    expect(mpiddp.TensorMismatchError,
           lambda: mpiddp.allreduce(torch.ones(3), name="mixed.op", op=op),
           "mixed.op", "reduction ops", "Sum", "Max")
    ok("op mismatch")

    root = 0 if rank == 0 else 1
    expect(mpiddp.TensorMismatchError,
           lambda: mpiddp.broadcast(torch.ones(3), root_rank=root, name="mixed.root"),
           "mixed.root", "root ranks")
    ok("root mismatch")

    def mixed_kind():
        if rank == 0:
            return mpiddp.allreduce(torch.ones(3), name="mixed.kind")
        return mpiddp.allgather(torch.ones(3), name="mixed.kind")
    expect(mpiddp.TensorMismatchError, mixed_kind, "mixed.kind", "allreduce", "allgather")
    ok("operation mismatch")

    trailing = (2, 3) if rank == 0 else (2, 4)
    expect(mpiddp.TensorMismatchError,
           lambda: mpiddp.allgather(torch.ones(trailing), name="gather.trailing"),
           "gather.trailing", "beyond the first dimension")
    ok("allgather trailing-shape mismatch")

    # The engine keeps serving after errors, the same names included.
    out = mpiddp.allreduce(torch.ones(4, 3), name="layer1.weight", op=mpiddp.Sum)
    assert torch.all(out == size)
    ok("engine serves after errors")

    handle = mpiddp.allreduce_async(torch.ones(2), name="dup")
    expect(mpiddp.DuplicateNameError, lambda: mpiddp.allreduce_async(torch.ones(2), name="dup"),
           "dup", "already in flight", f"rank {rank}")
    mpiddp.synchronize(handle)
    mpiddp.synchronize(mpiddp.allreduce_async(torch.ones(2), name="dup"))   # free again
    ok("duplicate in-flight name")

    expect(TypeError, lambda: mpiddp.allreduce(torch.ones(2, dtype=torch.complex32),
                                               name="cplx"), "cplx", "complex32", "supported")
    expect(ValueError, lambda: mpiddp.allreduce(torch.ones(2, dtype=torch.bool), name="bsum",
                                                op=mpiddp.Sum), "bsum", "bool")
    expect(ValueError, lambda: mpiddp.broadcast(torch.ones(2), root_rank=size, name="badroot"),
           "badroot", "root_rank")
    expect(ValueError, lambda: mpiddp.alltoall(torch.ones(size + 1), splits=[1] * size,
                                               name="badsplit"), "badsplit", "splits")
    expect(ValueError, lambda: mpiddp.allgather(torch.tensor(1.0), name="scalar.gather"),
           "scalar.gather", "scalar")
    expect(TypeError, lambda: mpiddp.allreduce([1, 2], name="notatensor"), "notatensor")
    expect(ValueError, lambda: mpiddp.allreduce(torch.ones(2, dtype=torch.bool), name="bscale",
                                                op=mpiddp.Max, prescale_factor=2.0), "bscale")
    expect(ValueError, lambda: mpiddp.allreduce(torch.ones(2, dtype=torch.int64),
                                                op=mpiddp.Adasum, name="adasum"),
           "op=Adasum combines floating-point tensors", "int64")
    # Horovod's integer rules: scale factors and Average on integers, truncated toward zero.
    scaled = mpiddp.allreduce(torch.full((2,), 3, dtype=torch.int32), name="iscale",
                              op=mpiddp.Sum, prescale_factor=0.5)
    assert scaled.tolist() == [size, size], scaled      # trunc(3 * 0.5) = 1 on every rank
    ok("bad input rejected on every rank (negotiated)")

    mpiddp.shutdown()
    mpiddp.shutdown()  # idempotent
    expect(mpiddp.EngineShutdownError, lambda: mpiddp.allreduce(torch.ones(2)), "shutdown()")
    ok("use after shutdown")


def stall():
    """Rank size-1 never submits 'lonely'; the others wait until the stall deadline."""
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    start = time.monotonic()
    if rank != size - 1:
        text = expect(mpiddp.EngineShutdownError,
                      lambda: mpiddp.allreduce(torch.ones(3), name="lonely"),
                      "lonely", "stalled", f"rank {size - 1}")
        ok(f"stalled request failed after {time.monotonic() - start:.1f} s: {text!r}")
    else:
        while mpiddp.runtime.require_engine("x").running:   # wait for the agreed shutdown
            time.sleep(0.05)                # (none: the test's timeout ends the job)
        expect(mpiddp.EngineShutdownError, lambda: mpiddp.allreduce(torch.ones(3), name="late"),
               "stalled")
        ok("the missing rank's engine shut down too")


def shutdown_with_pending():
    """Rank 0 shuts down while the others wait for a collective it never submits."""
    mpiddp.init()
    rank = mpiddp.rank()
    if rank == 0:
        time.sleep(0.5)
        mpiddp.shutdown()
        ok("shutdown returned")
    else:
        expect(mpiddp.EngineShutdownError,
               lambda: mpiddp.allreduce(torch.ones(3), name="never"),
               "never", "rank 0", "shutdown()")
        ok("pending request failed with the reason")


def rejected_on_some_ranks():
    """Input that only some ranks reject (Horovod's type-error tests): every rank gets the
    agreed error at once, naming the rejecting ranks and why; nobody waits; the engine goes
    on."""
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    odd = rank % 2 == 1
    # Rank 0, 2..: bool with op=Sum (rejected: Sum of bools); odd ranks: float32.
    tensor = torch.ones(17, 3, dtype=torch.float32 if odd else torch.bool)
    text = expect(mpiddp.InvalidInputError,
                  lambda: mpiddp.allreduce(tensor, name="typed", op=mpiddp.Sum),
                  "Invalid input for allreduce 'typed'", "rank 0: ValueError: op=Sum")
    ok("allreduce rejected on some ranks fails on every rank: " + text[:60])
    expect(RuntimeError, lambda: mpiddp.reducescatter(tensor, op=mpiddp.Average),
           "Invalid input for reducescatter")      # Horovod expects RuntimeError; unnamed
    ok("reducescatter rejected on some ranks fails on every rank")
    # A root that is no rank on the last rank only: a TypeError there, InvalidInputError on all.
    root = "0" if rank == size - 1 else 0
    kind = TypeError if rank == size - 1 else mpiddp.InvalidInputError
    expect(kind, lambda: mpiddp.broadcast(torch.ones(3), root_rank=root, name="rooted"),
           f"rank {size - 1}: TypeError: broadcast of 'rooted': root_rank must be an integer")
    ok("broadcast with a bad root on one rank fails on every rank")
    handles = [mpiddp.allreduce_async(torch.ones(2), name=f"async.{i}",
                                      op=mpiddp.Sum if (i != 1 or odd) else "nonsense")
               for i in range(3)]
    results = []
    for i, handle in enumerate(handles):
        try:
            results.append(float(mpiddp.synchronize(handle)[0]))
        except mpiddp.InvalidInputError as exc:
            assert i == 1 and "unknown reduction op 'nonsense'" in str(exc), (i, exc)
            results.append(None)
    assert results == [size, None, size], results
    ok("async: only the rejected call fails, the others complete")
    assert float(mpiddp.allreduce(torch.ones(1), name="after", op=mpiddp.Sum)) == size
    ok("the engine goes on")


def uncaught_exception():
    """Rank 1 dies of an uncaught exception while the others wait: the job must end."""
    mpiddp.init()
    if mpiddp.rank() == 1:
        time.sleep(0.3)
        raise RuntimeError("boom on rank 1")
    mpiddp.allreduce(torch.ones(3), name="waits.forever")
    print("UNREACHABLE", flush=True)


def uncaught_exception_in_thread():
    """Rank 1's data-loading thread dies, so its main thread waits for a batch that never
    comes, while the other ranks wait for rank 1 in an all-reduce."""
    import queue
    import threading
    mpiddp.init()
    batches = queue.Queue()
    if mpiddp.rank() == 1:
        def loader():
            time.sleep(0.3)
            raise OSError("loader thread lost its file on rank 1")
        threading.Thread(target=loader, name="data-loader").start()
    else:
        batches.put(torch.ones(3))
    mpiddp.allreduce(batches.get(), name="waits.forever")
    print("UNREACHABLE", flush=True)


def join_uneven():
    """Rank r has r+2 batches; ranks that run out call join() and contribute each op's
    identity: zeros to sums, nothing to min/max/product."""
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    mpiddp.broadcast(torch.ones(2), root_rank=0, name="bc.cached")    # now in the cache
    pending = mpiddp.allreduce_async(torch.ones(1), name="inflight")
    expect(mpiddp.MpiddpError, mpiddp.join, "in flight", "'inflight'")
    mpiddp.synchronize(pending)
    for step in range(rank + 2):
        active = [r for r in range(size) if r + 2 > step]
        handles = [
            mpiddp.allreduce_async(torch.ones(5), name="grad", op=mpiddp.Sum),
            mpiddp.allreduce_async(torch.full((3,), -5.0 - rank), name="max", op=mpiddp.Max),
            mpiddp.allreduce_async(torch.full((3,), rank + 1, dtype=torch.int32), name="min",
                                   op=mpiddp.Min),
            mpiddp.allreduce_async(torch.full((2,), 3.0), name="prod", op=mpiddp.Product),
            mpiddp.allreduce_async(torch.tensor([True, rank % 2 == 0]), name="and",
                                   op=mpiddp.Min),
        ]
        total, high, low, prod, both = [mpiddp.synchronize(h) for h in handles]
        assert torch.all(total == len(active)), (step, total, active)
        assert torch.all(high == -5.0 - min(active)), (step, high)
        assert torch.all(low == min(active) + 1), (step, low)
        assert torch.all(prod == 3.0 ** len(active)), (step, prod)
        assert both.tolist() == [True, all(r % 2 == 0 for r in active)], (step, both)
    if rank == size - 1:
        # Everyone else has joined: anything but allreduce is an error, cached or not.
        for name in ("bc.cached", "bc.new"):
            expect(mpiddp.MpiddpError,
                   lambda: mpiddp.broadcast(torch.ones(2), root_rank=0, name=name),
                   name, "join()")
        ok("broadcast while others have joined is an error")
    last = mpiddp.join()
    assert last == size - 1, last
    out = mpiddp.allreduce(torch.ones(2), name="after.join", op=mpiddp.Sum)
    assert torch.all(out == size)
    ok(f"join returned last rank {last}")


def settings_differ():
    """A protocol setting that differs between ranks is a clear error on every rank."""
    import os
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        os.environ["MPIDDP_FUSION_THRESHOLD"] = "1"
    expect(ValueError, mpiddp.init, "MPIDDP_FUSION_THRESHOLD must be the same on every rank",
           "rank 1 has 1")
    ok("differing settings")


def algorithm_switch_in_flight():
    """Switching algorithms while gradients are in flight stays consistent across ranks."""
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    for round_ in range(20):
        handles = [mpiddp.allreduce_async(torch.full((5000,), float(rank)), name=f"sw.{i}",
                                          op=mpiddp.Sum) for i in range(8)]
        mpiddp.set_allreduce_algorithm(("ring", "native", "auto")[round_ % 3])
        for h in handles:
            assert torch.all(mpiddp.synchronize(h) == sum(range(size)))
    t = torch.ones(3)
    mpiddp.broadcast_(t, root_rank=torch.tensor(size - 1), name="tensor.root")
    expect(TypeError, lambda: mpiddp.broadcast(t, root_rank=True, name="bool.root"), "root_rank")
    ok("algorithm switches and integer-like roots")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
