"""The device communicators of mpiddp.transport.staging over real MPI, without a GPU.

The "device" arrays are host memory behind ``__cuda_array_interface__`` (gpu_fakes), and the
collectives are the engine's own (ring, native), unchanged. Checks, each against a NumPy
reference: the ring all-reduce and reduce-scatter, native all-reduce (predefined op and the
float16 user op), broadcast, allgatherv and alltoallv through StagedComm with tiny segments
(many segments, uneven tails); that no fake device array ever reaches MPI; the pipeline's
issue order; and DirectComm (synchronise before every MPI call, user ops staged).
Prints 'OK <check>' on rank 0.
"""
import functools
import sys
import zlib

import numpy as np
from mpi4py import MPI

import checks
from gpu_fakes import FakeCopier, FakeDeviceArray, RecordingComm
from mpiddp.buffers.dtypes import dtype_named
from mpiddp.buffers.host_reduce import reduce_into
from mpiddp.transport.staging import DirectComm, StagedComm, device_comm
from mpiddp.collectives.native import allgatherv, alltoallv, broadcast, native_allreduce
from mpiddp.collectives.ring import chunk_bounds, ring_allreduce, ring_reduce_scatter
from mpiddp.reduce_ops import ReduceOp

COMM = MPI.COMM_WORLD.Dup()
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [0, 1, 2, 3, 7, 31, 100, 1000, 4099]
SEGMENT = 40          # bytes: not a multiple of 8, so segments split elements in Sendrecv


ok = functools.partial(checks.ok, rank=RANK, barrier=COMM.Barrier)


def data(rank, name, count, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{rank}/{name}".encode()))
    return rng.integers(-50, 51, size=count).astype(dtype)


def fake(array):
    return FakeDeviceArray(np.ascontiguousarray(array).copy())


def staged(log=None, segment=SEGMENT, allow_device=False):
    log = [] if log is None else log
    comm = RecordingComm(COMM, log, allow_device=allow_device)
    return StagedComm(comm, FakeCopier(log), segment), comm, log


def host_kernel(op, dtype):
    def reduce(dst, src):
        reduce_into(dst.host, src.host, op, dtype)
    return reduce


def check_ring():
    comm, _, _ = staged()
    for dtype_name in ("float32", "float64", "int32", "int8", "float16"):
        dtype = dtype_named(dtype_name)
        for count in SIZES:
            name = f"ring/{dtype_name}/{count}"
            buf = fake(data(RANK, name, count, dtype.storage))
            scratch = fake(np.zeros(-(-count // SIZE) or 1, dtype.storage))
            ring_allreduce(comm, buf, scratch, host_kernel(ReduceOp.SUM, dtype))
            want = sum(data(r, name, count, np.float64) for r in range(SIZE))
            if dtype_name == "int8":
                want = want.astype(np.int64).astype(np.int8)     # wraps as int8 does
            np.testing.assert_array_equal(buf.host.astype(np.float64), want, err_msg=name)
    ok("ring allreduce through StagedComm")


def check_reduce_scatter():
    comm, _, _ = staged()
    dtype = dtype_named("float32")
    for count in (0, 5, 97, 1000):
        name = f"rs/{count}"
        bounds = chunk_bounds(count, SIZE)
        largest = max(bounds[i + 1] - bounds[i] for i in range(SIZE)) or 1
        buf = fake(data(RANK, name, count, np.float32))
        scratch = fake(np.zeros(largest, np.float32))
        ring_reduce_scatter(comm, buf, scratch, bounds, host_kernel(ReduceOp.MAX, dtype))
        want = np.max([data(r, name, count, np.float32) for r in range(SIZE)], axis=0)
        mine = slice(bounds[RANK], bounds[RANK + 1])
        np.testing.assert_array_equal(buf.host[mine], want[mine], err_msg=name)
    ok("ring reduce-scatter through StagedComm")


def check_native():
    comm, _, log = staged()
    for dtype_name, op in (("float32", ReduceOp.SUM), ("int32", ReduceOp.MIN),
                           ("float16", ReduceOp.SUM), ("bfloat16", ReduceOp.MAX),
                           ("float64", ReduceOp.PRODUCT)):
        dtype = dtype_named(dtype_name)
        for count in SIZES:
            name = f"native/{dtype_name}/{count}"
            if dtype_name == "bfloat16":       # raw bits of small integers
                values = [_bf16_bits(data(r, name, count, np.float32)) for r in range(SIZE)]
                buf = fake(values[RANK])
                native_allreduce(comm, buf, dtype, op, reduce_into)
                got = (buf.host.astype(np.uint32) << 16).view(np.float32)
                want = np.max([(v.astype(np.uint32) << 16).view(np.float32) for v in values],
                              axis=0)
            else:
                inputs = [data(r, name, count, np.float64) for r in range(SIZE)]
                if op == ReduceOp.PRODUCT:
                    inputs = [np.sign(x) + (x == 0) for x in inputs]
                buf = fake(inputs[RANK].astype(dtype.storage))
                native_allreduce(comm, buf, dtype, op, reduce_into)
                got = buf.host.astype(np.float64)
                reducer = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min,
                           ReduceOp.PRODUCT: np.prod}[op]
                want = reducer(inputs, axis=0)
            np.testing.assert_array_equal(got, want, err_msg=name)
    assert any(entry[0] == "Allreduce" for entry in log)
    ok("native allreduce through StagedComm (predefined and user ops)")


def _bf16_bits(values):
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def check_broadcast_gathers():
    comm, _, _ = staged()
    for count in SIZES:
        for root in range(SIZE):
            name = f"bcast/{count}/{root}"
            buf = fake(data(RANK, name, count, np.float64))
            broadcast(comm, buf, root)
            np.testing.assert_array_equal(buf.host, data(root, name, count, np.float64),
                                          err_msg=name)
    for row in (1, 3):
        counts = [(r * 5 + 1) % 7 * row for r in range(SIZE)]        # includes zero rows
        mine = fake(data(RANK, f"ag/{row}", counts[RANK], np.int64))
        out = fake(np.zeros(sum(counts), np.int64))
        allgatherv(comm, mine, out, counts, 8)
        want = np.concatenate([data(r, f"ag/{row}", counts[r], np.int64) for r in range(SIZE)])
        np.testing.assert_array_equal(out.host, want)
    # alltoall: rank s sends (s + d) % 3 + 1 elements to rank d
    send_counts = [(RANK + d) % 3 + 1 for d in range(SIZE)]
    recv_counts = [(s + RANK) % 3 + 1 for s in range(SIZE)]
    send = fake(np.concatenate([np.full(n, RANK * 100 + d, np.int32)
                                for d, n in enumerate(send_counts)]))
    recv = fake(np.zeros(sum(recv_counts), np.int32))
    alltoallv(comm, send, send_counts, recv, recv_counts, 4)
    want = np.concatenate([np.full(n, s * 100 + RANK, np.int32) for s, n in enumerate(recv_counts)])
    np.testing.assert_array_equal(recv.host, want)
    ok("broadcast, allgatherv and alltoallv through StagedComm")


def check_pipeline_order():
    """One Sendrecv of 4 segments and one Allreduce of 4 segments: each next device->host copy
    is started before the current segment's transfer is waited for, and each host->device copy
    is started before the next segment's transfer is posted."""
    log = []
    comm, _, _ = staged(log, segment=64)
    comm._wait = lambda requests: (log.append(("Waitall",)), MPI.Request.Waitall(requests))
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    send = fake(np.arange(64, dtype=np.float32) + RANK)       # 256 bytes: 4 segments of 64
    recv = fake(np.zeros(64, np.float32))
    del log[:]
    comm.Sendrecv([send, MPI.BYTE], right, 5, [recv, MPI.BYTE], left, 5)
    np.testing.assert_array_equal(recv.host, np.arange(64, dtype=np.float32) + left)
    ops = [entry[0] for entry in log if entry[0] != "pinned"]
    assert ops[0] == "flush", ops      # the copies wait for the device, not the host
    to_host = [i for i, o in enumerate(ops) if o == "to_host"]
    to_device = [i for i, o in enumerate(ops) if o == "to_device"]
    waits = [i for i, o in enumerate(ops) if o == "Waitall"]
    isends = [i for i, o in enumerate(ops) if o == "Isend"]
    irecvs = [i for i, o in enumerate(ops) if o == "Irecv"]
    assert len(to_host) == len(to_device) == len(waits) == len(isends) == len(irecvs) == 4, ops
    for k in range(3):
        assert to_host[k + 1] < waits[k], ("copy of the next segment not overlapped", ops)
        assert waits[k] < to_device[k] < irecvs[k + 1], ops
        assert to_host[k] < isends[k], ops

    del log[:]
    buf = fake(np.full(64, float(RANK + 1), np.float32))
    comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
    np.testing.assert_array_equal(buf.host, np.full(64, SIZE * (SIZE + 1) / 2, np.float32))
    ops = [entry[0] for entry in log if entry[0] not in ("pinned", "wait")]
    assert ops[:3] == ["flush", "to_host", "to_host"], ops    # segment 1 starts before 0's MPI
    reduces = [i for i, o in enumerate(ops) if o == "Allreduce"]
    to_host = [i for i, o in enumerate(ops) if o == "to_host"]
    assert len(reduces) == 4 and len(to_host) == 4, ops
    for k in range(3):
        assert to_host[k + 1] < reduces[k], ops
    ok("staged pipeline issue order (Sendrecv and Allreduce)")


def check_direct_comm():
    log = []
    copier = FakeCopier(log)
    recording = RecordingComm(COMM, log, allow_device=True)
    comm = device_comm(recording, True, copier, SEGMENT)
    assert isinstance(comm, DirectComm)
    assert isinstance(device_comm(recording, False, copier), StagedComm)
    dtype = dtype_named("float32")
    buf = fake(np.full(1000, float(RANK + 1), np.float32))
    scratch = fake(np.zeros(1000, np.float32))
    before = copier.syncs
    ring_allreduce(comm, buf, scratch, host_kernel(ReduceOp.SUM, dtype))
    np.testing.assert_array_equal(buf.host, np.full(1000, SIZE * (SIZE + 1) / 2))
    sendrecvs = sum(1 for entry in log if entry[0] == "Sendrecv")
    assert sendrecvs == 2 * (SIZE - 1) and copier.syncs - before == sendrecvs, log
    # every MPI call is preceded by a sync
    for i, entry in enumerate(log):
        if entry[0] == "Sendrecv":
            assert log[i - 1] == ("sync",), log[i - 2:i + 1]
    assert recording.device_buffers_seen == 4 * (SIZE - 1)   # device pointers went to MPI
    # a float16 sum needs a user op: staged through host memory even though MPI is aware
    seen = recording.device_buffers_seen
    half = fake(np.full(77, RANK + 1, np.float16))
    native_allreduce(comm, half, dtype_named("float16"), ReduceOp.SUM, reduce_into)
    np.testing.assert_array_equal(half.host, np.full(77, SIZE * (SIZE + 1) / 2, np.float16))
    assert recording.device_buffers_seen == seen, "user op got device pointers"
    # a predefined op goes straight to MPI
    ints = fake(np.full(9, RANK, np.int32))
    native_allreduce(comm, ints, dtype_named("int32"), ReduceOp.MAX, reduce_into)
    np.testing.assert_array_equal(ints.host, np.full(9, SIZE - 1))
    assert recording.device_buffers_seen == seen + 1
    ok("DirectComm: sync before MPI, user ops staged")


CHECKS = [check_ring, check_reduce_scatter, check_native, check_broadcast_gathers,
          check_pipeline_order, check_direct_comm]

if __name__ == "__main__":
    wanted = sys.argv[1:]
    for check in CHECKS:
        if not wanted or check.__name__ in wanted:
            check()
    COMM.Barrier()
    if RANK == 0:
        print("DONE", flush=True)
