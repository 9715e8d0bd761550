"""Communicators for device buffers: the collectives in ``mpiddp/collectives`` call
``Sendrecv``, ``Allreduce``, ``Bcast``, ``Allgatherv`` and ``Alltoallv`` on whatever
communicator they get, so device buffers only need a communicator-like wrapper.

* ``DirectComm`` (MPI is CUDA-aware): device pointers go straight to MPI, after the engine
  stream is synchronised (MPI does not order itself against CUDA streams). An all-reduce with
  a user-defined op (float16/bfloat16 on the native path) is staged anyway: MPI would call our
  Python reduction with pointers into device memory.
* ``StagedComm`` (MPI is not CUDA-aware): every buffer is copied through pinned host memory.
  Large transfers are cut into segments and pipelined: the device-to-host copy of segment
  k+1 and the host-to-device copy of segment k-1 run while MPI moves segment k. MPI only
  touches the pinned buffers, so the host waits for the copies alone: the copies to the
  host wait for the engine stream's work on the device (``Copier.flush``), not through a
  host-side synchronize (each is a round trip to the GPU, several per collective).

Both take a *copier* that does the device side (see ``Copier``); ``device.CupyCopier`` is the
CuPy one. This module imports neither CuPy nor torch, so its logic is tested on machines
without a GPU with a host-memory stand-in for device arrays.

Device arrays are flat and contiguous (the engine only hands out flat buffers and slices of
them); they are addressed by pointer through ``.data.ptr`` (CuPy) or
``__cuda_array_interface__``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import numpy as np
from mpi4py import MPI

from .base import CommWrapper

#: Default segment of a pipelined staged transfer. Large enough that per-segment costs
#: (one MPI message, two copy launches) are small; small enough for the pipeline to fill.
SEGMENT_BYTES = 1 << 20
#: Pinned slots in flight per direction: a slot is refilled only once its earlier copy is
#: done, and three keep that wait off the critical path.
_RING_SLOTS = 3


class Copier(Protocol):
    """The device side of staging. Copies are asynchronous and return an event."""

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of ``nbytes`` (uint8)."""

    def sync(self) -> None:
        """Wait until all device work queued so far (the engine stream) is done."""

    def flush(self) -> None:
        """Mark the device work queued so far (the engine stream): copies to the host started
        after it wait for that work on the device. The host does not wait."""

    def to_host(self, host: np.ndarray, src_ptr: int, nbytes: int) -> Any:
        """Start copying ``nbytes`` from device address ``src_ptr`` into ``host``."""

    def to_device(self, dst_ptr: int, host: np.ndarray, nbytes: int) -> Any:
        """Start copying ``nbytes`` from ``host`` to device address ``dst_ptr``, ordered before
        any device work queued after it on the engine stream."""

    def wait(self, event: Any) -> None:
        """Block until the copy behind ``event`` has finished (``None``: nothing to wait)."""


def device_span(array) -> tuple[int, int]:
    """(device pointer, bytes) of a flat contiguous device array."""
    data = getattr(array, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:                                   # CuPy
        if not array.flags.c_contiguous:
            raise ValueError("device buffers handed to MPI must be contiguous")
        return int(ptr), int(array.nbytes)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"not a device array: {type(array).__name__}")
    itemsize = np.dtype(cai["typestr"]).itemsize
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is not None and len(shape) == 1 and shape[0] > 1 and strides[0] != itemsize:
        raise ValueError("device buffers handed to MPI must be contiguous")
    return int(cai["data"][0]), math.prod(shape) * itemsize


def _parse(spec) -> tuple[Any, tuple, MPI.Datatype]:
    """``[array, datatype]`` or ``[array, counts, displs, datatype]`` -> parts."""
    if not isinstance(spec, (list, tuple)) or not isinstance(spec[-1], MPI.Datatype):
        raise TypeError("device communicators take buffer specs [array, (counts, displs,) "
                        "datatype]")
    return spec[0], tuple(spec[1:-1]), spec[-1]


def segments(nbytes: int, segment: int) -> list[tuple[int, int]]:
    """Byte ranges ``(lo, hi)`` of at most ``segment`` bytes covering ``nbytes``."""
    return [(lo, min(lo + segment, nbytes)) for lo in range(0, nbytes, segment)]


class _Slot:
    """A pinned host buffer and the last asynchronous copy that reads or writes it."""

    __slots__ = ("array", "pending")

    def __init__(self, array: np.ndarray):
        self.array = array
        self.pending = None


class StagedComm(CommWrapper):
    """A communicator over device buffers for an MPI that can only read host memory."""

    def __init__(self, comm: MPI.Comm, copier: Copier, segment_bytes: int = SEGMENT_BYTES):
        if segment_bytes < 1:
            raise ValueError("segment_bytes must be positive")
        super().__init__(comm)
        self.copier = copier
        self.segment_bytes = int(segment_bytes)
        self._slots: dict[tuple[str, int], _Slot] = {}
        self.staged_bytes = 0          # bytes that went through host memory (statistics)

    # ---- what the collectives need from a communicator ----------------------------------
    # ---- pinned slots ---------------------------------------------------------------------
    def _slot(self, role: str, index: int, nbytes: int) -> _Slot:
        """Pinned slot ``(role, index)`` with room for ``nbytes``, free for reuse (its last
        copy has finished)."""
        key = (role, index)
        slot = self._slots.get(key)
        if slot is not None:
            self.copier.wait(slot.pending)
            slot.pending = None
            if len(slot.array) >= nbytes:
                return slot
        size = max(nbytes, 2 * len(slot.array) if slot is not None else 0, 64)
        slot = self._slots[key] = _Slot(self.copier.pinned(size))
        return slot

    @staticmethod
    def _wait(requests: list) -> None:
        MPI.Request.Waitall(requests)

    def finish(self) -> None:
        """Wait for every copy still in flight (the engine stream orders them anyway)."""
        for slot in self._slots.values():
            self.copier.wait(slot.pending)
            slot.pending = None

    # ---- point to point -------------------------------------------------------------------
    def Sendrecv(self, sendbuf, dest: int, sendtag: int = 0, recvbuf=None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG, status=None) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``, in
        segments. The receiver cuts its buffer the same way the sender cuts the same
        bytes, so each segment message matches one posted receive."""
        send, _, _ = _parse(sendbuf)
        recv, _, _ = _parse(recvbuf)
        send_ptr, send_bytes = device_span(send)
        recv_ptr, recv_bytes = device_span(recv)
        seg = self.segment_bytes
        send_parts, recv_parts = segments(send_bytes, seg), segments(recv_bytes, seg)
        copier = self.copier
        copier.flush()                      # the copies read the bytes once final
        send_slots = [self._slot("send", i, min(seg, send_bytes)) for i in range(2)] \
            if send_parts else []
        ready = {}
        if send_parts:
            lo, hi = send_parts[0]
            ready[0] = copier.to_host(send_slots[0].array, send_ptr + lo, hi - lo)
        for k in range(max(len(send_parts), len(recv_parts))):
            requests = []
            if k < len(recv_parts):
                lo, hi = recv_parts[k]
                slot = self._slot("recv", k % _RING_SLOTS, min(seg, recv_bytes))
                requests.append(self.comm.Irecv([slot.array[:hi - lo], MPI.BYTE], source,
                                                recvtag))
            if k < len(send_parts):
                lo, hi = send_parts[k]
                copier.wait(ready.pop(k))
                requests.append(self.comm.Isend([send_slots[k % 2].array[:hi - lo], MPI.BYTE],
                                                dest, sendtag))
                if k + 1 < len(send_parts):  # overlap the next copy with this transfer
                    nlo, nhi = send_parts[k + 1]
                    ready[k + 1] = copier.to_host(send_slots[(k + 1) % 2].array,
                                                  send_ptr + nlo, nhi - nlo)
            self._wait(requests)
            if k < len(recv_parts):
                lo, hi = recv_parts[k]
                slot = self._slots[("recv", k % _RING_SLOTS)]
                slot.pending = copier.to_device(recv_ptr + lo, slot.array, hi - lo)
        self.staged_bytes += send_bytes + recv_bytes

    # ---- collectives on one buffer: pipelined segment by segment --------------------------
    def _pipeline(self, src_ptr: int, dst_ptr: int, nbytes: int, align: int,
                  host_op: Callable[[np.ndarray], None], stage_in: bool,
                  stage_out: bool) -> None:
        """For each segment: copy in (if ``stage_in``), ``host_op`` on the host segment, copy
        out (if ``stage_out``). Every rank cuts the buffer identically, so the per-segment
        collectives match across ranks."""
        seg = max(align, self.segment_bytes // align * align)
        parts = segments(nbytes, seg)
        if not parts:
            return
        copier = self.copier
        copier.flush()
        width = min(seg, nbytes)
        slots = [self._slot("pipe", i, width) for i in range(min(_RING_SLOTS, len(parts)))]
        ready = {}

        def start_in(k):
            lo, hi = parts[k]
            slot = slots[k % len(slots)]
            copier.wait(slot.pending)
            slot.pending = None
            ready[k] = copier.to_host(slot.array, src_ptr + lo, hi - lo)

        if stage_in:
            start_in(0)
        for k, (lo, hi) in enumerate(parts):
            slot = slots[k % len(slots)]
            if stage_in:
                copier.wait(ready.pop(k))
                if k + 1 < len(parts):
                    start_in(k + 1)
            else:
                copier.wait(slot.pending)
                slot.pending = None
            host_op(slot.array[:hi - lo])
            if stage_out:
                slot.pending = copier.to_device(dst_ptr + lo, slot.array, hi - lo)
        self.staged_bytes += nbytes

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        recv, _, datatype = _parse(recvbuf)
        dst_ptr, nbytes = device_span(recv)
        src_ptr = dst_ptr if sendbuf is MPI.IN_PLACE else device_span(_parse(sendbuf)[0])[0]
        if self.comm.Get_size() == 1 and src_ptr == dst_ptr:
            return
        self._pipeline(src_ptr, dst_ptr, nbytes, datatype.Get_size(),
                       lambda host: self.comm.Allreduce(MPI.IN_PLACE, [host, datatype], op),
                       stage_in=True, stage_out=True)

    def Bcast(self, buf, root: int = 0) -> None:
        array, _, datatype = _parse(buf)
        ptr, nbytes = device_span(array)
        is_root = self.comm.Get_rank() == root
        self._pipeline(ptr, ptr, nbytes, datatype.Get_size(),
                       lambda host: self.comm.Bcast([host, datatype], root=root),
                       stage_in=is_root, stage_out=not is_root)

    # ---- v-collectives: staged whole ------------------------------------------------------
    def _stage_whole(self, send, recv, call: Callable[[np.ndarray, np.ndarray], None]) -> None:
        send_ptr, send_bytes = device_span(send)
        recv_ptr, recv_bytes = device_span(recv)
        copier = self.copier
        copier.flush()
        host_send = self._slot("whole-send", 0, send_bytes)
        host_recv = self._slot("whole-recv", 0, recv_bytes)
        if send_bytes:
            copier.wait(copier.to_host(host_send.array, send_ptr, send_bytes))
        call(host_send.array[:send_bytes], host_recv.array[:recv_bytes])
        if recv_bytes:
            host_recv.pending = copier.to_device(recv_ptr, host_recv.array, recv_bytes)
        self.staged_bytes += send_bytes + recv_bytes

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        send, _, send_type = _parse(sendbuf)
        recv, (counts, displs), recv_type = _parse(recvbuf)
        self._stage_whole(send, recv, lambda hs, hr: self.comm.Allgatherv(
            [hs, send_type], [hr, counts, displs, recv_type]))

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        send, (s_counts, s_displs), send_type = _parse(sendbuf)
        recv, (r_counts, r_displs), recv_type = _parse(recvbuf)
        self._stage_whole(send, recv, lambda hs, hr: self.comm.Alltoallv(
            [hs, s_counts, s_displs, send_type], [hr, r_counts, r_displs, recv_type]))


def _predefined(op: MPI.Op) -> bool:
    return bool(getattr(op, "is_predefined", True))


class DirectComm(CommWrapper):
    """A communicator over device buffers for a CUDA-aware MPI: device pointers go to MPI
    after the engine stream is synchronised. User-defined reduction ops run through
    ``staged`` (host memory), because MPI would call them with device pointers."""

    def __init__(self, comm: MPI.Comm, sync: Callable[[], None], staged: StagedComm):
        super().__init__(comm)
        self.sync = sync
        self.staged = staged

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None) -> None:
        self.sync()
        self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        if not _predefined(op):
            self.staged.Allreduce(sendbuf, recvbuf, op)
            return
        self.sync()
        self.comm.Allreduce(sendbuf, recvbuf, op)

    def Bcast(self, buf, root: int = 0) -> None:
        self.sync()
        self.comm.Bcast(buf, root=root)

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        self.sync()
        self.comm.Allgatherv(sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        self.sync()
        self.comm.Alltoallv(sendbuf, recvbuf)


def device_comm(comm: MPI.Comm, cuda_aware: bool, copier: Copier,
                segment_bytes: int = SEGMENT_BYTES):
    """The communicator the engine uses for device buffers: direct when MPI is CUDA-aware,
    staged through pinned host memory otherwise."""
    staged = StagedComm(comm, copier, segment_bytes)
    return DirectComm(comm, copier.sync, staged) if cuda_aware else staged
