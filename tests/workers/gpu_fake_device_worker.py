"""The engine on fake GPUs (tests/workers/fake_cuda.py), one node, local rank k on cuda:k of
as many devices as ranks (or of FAKE_GPU_COUNT devices, ranks sharing them round-robin: k on
cuda:k % count): no thread of rank k may touch any other device, no buffer may be read before
the event guarding it, no host wait may spin.

Runs through ``mpiddp.init()`` (device selection before MPI_Init and at init), the
coordinator and watchdog threads, the executor, DeviceBackend and the staging communicator
(whose MPI calls on pinned memory are checked too): allreduce fused and alone with the native,
ring and halving-doubling algorithms, broadcast, allgather of different sizes, and an
allreduce while the last rank has joined. Prints 'OK rank <r>' per rank.
"""
import os
import sys
import zlib

import numpy as np

import fake_cuda

# Hydra's variables, or Open MPI's.
LOCAL = int(os.environ.get("MPI_LOCALRANKID", os.environ.get(
    "OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("PMI_RANK", "0"))))
SIZE = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
COUNT = int(os.environ.get("FAKE_GPU_COUNT", SIZE))
DEVICE = LOCAL % COUNT
GPU = fake_cuda.FakeGPU(COUNT, allowed=DEVICE)
cupy = fake_cuda.install(GPU)           # before mpiddp: it picks the device at import

import mpiddp  # noqa: E402
from mpiddp import runtime, transport  # noqa: E402
from mpiddp.engine.handle import Handle  # noqa: E402
from mpiddp.engine.request import ALLGATHER, ALLREDUCE, BROADCAST, Entry, Request  # noqa: E402
from mpiddp.transport import staging  # noqa: E402
from mpi4py import MPI  # noqa: E402

assert GPU.current() == DEVICE, f"import mpiddp left cuda:{GPU.current()} current"
# Every staged MPI call is checked against the fake's ordering (pinned slots).
transport.device_comm = lambda comm, aware, copier, *a: staging.device_comm(
    fake_cuda.CheckingComm(comm, GPU), aware, copier, *a)

mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
assert mpiddp.local_rank() == LOCAL and size == SIZE
engine = runtime.require_engine("test")
user = cupy.cuda.Stream(non_blocking=True)       # the "training" stream of this rank


def produced(values, name):
    """A device array written on the user's stream, and the event after it."""
    values = np.asarray(values)
    array = cupy.empty(values.shape, values.dtype, name=name)
    with user:
        array[...] = values
    event = cupy.cuda.Event()
    event.record(user)
    return array, event


def run(entries):
    for handle in engine.submit_many(entries):
        try:
            handle.wait(timeout=60)
        except BaseException as exc:
            raise AssertionError(f"{exc!r}; the fake saw: {GPU.violations}") from exc


def data(r, name, n):
    rng = np.random.default_rng(zlib.crc32(f"{r}/{name}".encode()))
    return rng.integers(-20, 21, n).astype(np.float32)


for algorithm in ("native", "ring", "halving_doubling"):     # 3 ranks: the fold too
    mpiddp.set_allreduce_algorithm(algorithm)
    entries, want = [], {}
    for i, n in enumerate((3, 64, 300_001)):          # the last is staged in segments
        name = f"{algorithm}.ar{i}"
        array, event = produced(data(rank, name, n), name)
        request = Request(name, ALLREDUCE, "float32", (n,), "cuda", op=int(mpiddp.Sum))
        entries.append(Entry(request, array, array, Handle(name), ready_event=event))
        want[name] = (array, sum(data(r, name, n) for r in range(size)))
    run(entries)
    for name, (array, expected) in want.items():
        np.testing.assert_array_equal(GPU.host_read(array), expected, err_msg=name)

b, event = produced(np.arange(10, dtype=np.int64) * (rank + 1), "bcast")
run([Entry(Request("bc", BROADCAST, "int64", (10,), "cuda", root=1), b, b, Handle("bc"),
           ready_event=event)])
np.testing.assert_array_equal(GPU.host_read(b), np.arange(10) * 2)

rows = rank + 2
g, event = produced(np.full((rows, 3), rank, np.float32), "gather input")
holder = {}


def allocate(shape):                  # on the coordinator thread, as torch.empty would be
    holder["out"] = cupy.empty(shape, np.float32, name="gathered")
    return holder["out"].reshape(-1)


run([Entry(Request("ag", ALLGATHER, "float32", (rows, 3), "cuda"), g.reshape(-1), None,
           Handle("ag"), allocate=allocate, ready_event=event)])
expected = np.concatenate([np.full((r + 2, 3), r, np.float32) for r in range(size)])
np.testing.assert_array_equal(GPU.host_read(holder["out"]), expected)

# The last rank joins; the others reduce without it (it contributes zeros on its device).
if rank == size - 1:
    mpiddp.join()
else:
    array, event = produced(np.full(1000, rank + 1, np.float32), "after join")
    run([Entry(Request("aj", ALLREDUCE, "float32", (1000,), "cuda", op=int(mpiddp.Sum)),
               array, array, Handle("aj"), ready_event=event)])
    np.testing.assert_array_equal(GPU.host_read(array), sum(range(1, size)))
    mpiddp.join()

mpiddp.shutdown()
GPU.check_clean()
assert set(GPU.touched) == {DEVICE}, f"rank {rank} touched {GPU.touched}"
threads = GPU.touched[DEVICE]
assert any("coordinator" in t for t in threads), threads
if MPI.Query_thread() == MPI.THREAD_MULTIPLE and DEVICE != 0:
    # the watchdog runs, and made cuda:k current (on cuda:0 it was current already)
    assert any("watchdog" in t for t in threads), threads
assert GPU.spin_waits == 0, f"{GPU.spin_waits} host waits spun a core"
print(f"OK rank {rank} on cuda:{DEVICE}, threads {sorted(threads)}", flush=True)
sys.exit(0)
