"""Host-memory stand-ins for the device side of mpiddp.transport.staging, for machines without
a GPU.

``FakeDeviceArray`` is host memory that exposes only ``__cuda_array_interface__`` (a pointer),
as a CuPy array does; the staging code reaches it only by pointer, so the byte offsets and
segment arithmetic are exercised for real. ``FakeCopier`` copies synchronously with
``ctypes.memmove`` and logs every operation; ``RecordingComm`` forwards to a real
communicator, logs every MPI call into the same log and (unless told otherwise) fails if a
fake device array ever reaches MPI. Copies here are synchronous, so tests check the *issue
order* of the pipeline (the next copy is started before this segment's transfer is waited
for), not actual overlap.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
from mpi4py import MPI


class FakeDeviceArray:
    def __init__(self, host: np.ndarray):
        if host.ndim != 1 or not host.flags.c_contiguous:
            raise ValueError("flat contiguous arrays only")
        self._host = host

    @property
    def host(self) -> np.ndarray:
        """The memory behind the array, for checking results."""
        return self._host

    @property
    def dtype(self):
        return self._host.dtype

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    def __len__(self) -> int:
        return len(self._host)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("fake device arrays support contiguous slices only")
        return FakeDeviceArray(self._host[index])

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.ctypes.data, False), "version": 3, "strides": None,
                "stream": None}


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, what: str):
        self.id = next(self._ids)
        self.what = what

    def __repr__(self):
        return f"<event {self.id} {self.what}>"


class FakeCopier:
    """Synchronous copies between host "device" memory and host buffers, logged."""

    def __init__(self, log: list):
        self.log = log
        self.syncs = 0

    def pinned(self, nbytes: int) -> np.ndarray:
        self.log.append(("pinned", nbytes))
        return np.zeros(nbytes, dtype=np.uint8)

    def sync(self) -> None:
        self.syncs += 1
        self.log.append(("sync",))

    def flush(self) -> None:
        self.log.append(("flush",))

    def to_host(self, host: np.ndarray, src_ptr: int, nbytes: int):
        assert host.dtype == np.uint8 and len(host) >= nbytes, (host.dtype, len(host), nbytes)
        ctypes.memmove(host.ctypes.data, src_ptr, nbytes)
        self.log.append(("to_host", nbytes))
        return FakeEvent("to_host")

    def to_device(self, dst_ptr: int, host: np.ndarray, nbytes: int):
        assert host.dtype == np.uint8 and len(host) >= nbytes
        ctypes.memmove(dst_ptr, host.ctypes.data, nbytes)
        self.log.append(("to_device", nbytes))
        return FakeEvent("to_device")

    def wait(self, event) -> None:
        if event is not None:
            self.log.append(("wait", event.what))


def _buffers(spec):
    if isinstance(spec, (list, tuple)):
        return [spec[0]]
    return []


class RecordingComm:
    """Forwards the calls the collectives make to ``comm``; logs them; checks that only host
    memory reaches MPI (unless ``allow_device``)."""

    def __init__(self, comm: MPI.Comm, log: list, allow_device: bool = False):
        self.comm = comm
        self.log = log
        self.allow_device = allow_device
        self.device_buffers_seen = 0

    def _check(self, *specs):
        for spec in specs:
            for array in _buffers(spec):
                if isinstance(array, FakeDeviceArray):
                    self.device_buffers_seen += 1
                    assert self.allow_device, "a device buffer reached a non-CUDA-aware MPI"
                else:
                    assert isinstance(array, np.ndarray), type(array)

    def Get_rank(self):
        return self.comm.Get_rank()

    def Get_size(self):
        return self.comm.Get_size()

    def Isend(self, buf, dest, tag=0):
        self._check(buf)
        self.log.append(("Isend", len(buf[0]) if buf[0] is not None else 0))
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        self._check(buf)
        self.log.append(("Irecv", len(buf[0])))
        return self.comm.Irecv(buf, source, tag)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None):
        self._check(sendbuf, recvbuf)
        self.log.append(("Sendrecv",))
        return self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self._check(sendbuf, recvbuf)
        self.log.append(("Allreduce", len(recvbuf[0])))
        return self.comm.Allreduce(sendbuf, recvbuf, op)

    def Bcast(self, buf, root=0):
        self._check(buf)
        self.log.append(("Bcast", len(buf[0])))
        return self.comm.Bcast(buf, root=root)

    def Allgatherv(self, sendbuf, recvbuf):
        self._check(sendbuf, recvbuf)
        self.log.append(("Allgatherv",))
        return self.comm.Allgatherv(sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf):
        self._check(sendbuf, recvbuf)
        self.log.append(("Alltoallv",))
        return self.comm.Alltoallv(sendbuf, recvbuf)
