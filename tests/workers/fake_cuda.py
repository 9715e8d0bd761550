"""A fake CUDA machine for running mpiddp's device code on a CPU: a fake ``cupy`` and a fake
``torch.cuda``, sharing one ``FakeGPU`` state, that fail on the two classes of GPU defect a
CPU test otherwise cannot see.

* **Devices, per host thread.** As in CUDA, each host thread has its own current device,
  device 0 until the thread sets one. Every call that uses a device (setting it, creating a
  stream, an event or memory, launching a copy or kernel) *touches* it, which creates its
  context. ``FakeGPU(allowed=k)`` fails (``DeviceError``) on any touch of another device, from
  any thread: the check that each rank uses only its own GPU. A launch on a stream of another
  device than the thread's current one fails too, as in CUDA.
* **Ordering.** Work is executed at once (the data are right), but each stream keeps a
  vector clock: an operation on stream S is the next step of S, and S learns of other
  streams' steps only through ``wait_event`` on an event recorded after them, or through the
  host having waited for them (``synchronize``) before it enqueued the work. Each allocation
  remembers its last write and the reads since; reading a buffer whose last write the reader
  cannot have seen, or overwriting one whose readers it cannot have seen, fails
  (``OrderingError``), by byte range. The host is a reader and writer too (MPI on pinned
  memory through ``CheckingComm``, the test reading results): see ``host_read``.
  ``strict=True``: a stream learns of other streams' work only through events it waited for,
  not through the host having waited, which checks the device-side ordering on its own.
* **Spinning.** ``synchronize`` on an event made without the blocking flag, or on a stream,
  spins a core in CUDA; the fake counts such waits in ``spin_waits``.

Memory is host memory (NumPy); a "device pointer" is its address, so pointer arithmetic and
``ctypes.memmove`` work. ``install(gpu, monkeypatch=None)`` puts the fake ``cupy`` into
``sys.modules`` and the fake functions onto ``torch.cuda``.
"""
from __future__ import annotations

import bisect
import ctypes
import importlib
import itertools
import sys
import threading
import types
from typing import Optional

import numpy as np


class DeviceError(AssertionError):
    """A thread touched a device other than the one this process may use."""


class OrderingError(AssertionError):
    """A buffer was read (or overwritten) before the event guarding it was waited for."""


_HOST = "host"


def _merge(into: dict, other: dict) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


class _Memory:
    """One allocation (device or pinned): the ordering state of its bytes."""

    def __init__(self, gpu, kind: str, device: Optional[int], host: np.ndarray, name: str):
        self.gpu, self.kind, self.device, self.host, self.name = gpu, kind, device, host, name
        self.start = host.ctypes.data
        self.end = self.start + host.nbytes
        # Accesses by byte range: [(lo, hi, clock key, step, what)]. A write drops the
        # accesses it covers (after checking them): later accesses need only see it.
        self.writes: list = []
        self.reads: list = []

    def __repr__(self):
        return f"<{self.kind} memory {self.name} on {self.device}>"


class FakeGPU:
    """The state of the fake machine in one process (see the module docstring)."""

    def __init__(self, device_count: int = 1, allowed: Optional[int] = None,
                 strict: bool = False):
        self.count = device_count
        self.allowed = allowed
        # strict: a stream learns of other streams' work only through events it waited for,
        # not through the host having synchronized (checks the device-side ordering alone).
        self.strict = strict
        self.lock = threading.RLock()
        self._tls = threading.local()
        self.host_clock: dict = {}
        self.touched: dict[int, set] = {}       # device -> names of the threads that touched it
        self.violations: list[str] = []
        self.spin_waits = 0
        self.kernel_calls: list[str] = []        # names of the RawModule kernels launched
        self.log: list[tuple] = []               # (thread, what, device, stream name)
        self._memories: list[_Memory] = []       # sorted by start address
        self._starts: list[int] = []
        self._ptrs = itertools.count(0x1000)
        self._streams: dict[int, "FakeStream"] = {}
        self._defaults = {}
        self._events: dict = {}
        self.dlpack_syncs = 0
        self.initialized = False

    # ---- devices -------------------------------------------------------------------------
    def current(self) -> int:
        return getattr(self._tls, "device", 0)       # CUDA: device 0 until the thread sets one

    def touch(self, device: int, what: str) -> None:
        name = threading.current_thread().name
        if not 0 <= device < self.count:
            raise DeviceError(f"{what}: no device {device} (there are {self.count})")
        with self.lock:
            self.touched.setdefault(device, set()).add(name)
            self.initialized = True
        if self.allowed is not None and device != self.allowed:
            message = (f"thread {name!r} touched cuda:{device} ({what}), but this rank may "
                       f"use only cuda:{self.allowed}")
            with self.lock:
                self.violations.append(message)
            raise DeviceError(message)

    def set_device(self, device: int, what: str = "setDevice") -> None:
        self.touch(device, what)
        self._tls.device = device

    def use_current(self, what: str) -> int:
        device = self.current()
        self.touch(device, what)
        return device

    # ---- streams -------------------------------------------------------------------------
    def new_ptr(self) -> int:
        return next(self._ptrs) * 16

    def register_stream(self, stream) -> None:
        self._streams[stream.ptr] = stream

    def default_stream(self, device: int) -> "FakeStream":
        with self.lock:
            stream = self._defaults.get(device)
            if stream is None:
                stream = self._defaults[device] = FakeStream(self, device, "default",
                                                             register=False)
            return stream

    def stream_at(self, ptr: int) -> "FakeStream":
        if ptr in (0, 1, 2):                # the legacy / per-thread default stream
            return self.default_stream(self.current())
        return self._streams[ptr]

    def cupy_stream(self) -> "FakeStream":
        """The calling thread's current CuPy stream (CuPy: per thread and device)."""
        streams = getattr(self._tls, "cupy_streams", {})
        return streams.get(self.current()) or self.default_stream(self.current())

    def set_cupy_stream(self, stream) -> None:
        if not hasattr(self._tls, "cupy_streams"):
            self._tls.cupy_streams = {}
        self._tls.cupy_streams[stream.device] = stream

    def torch_stream(self, device: Optional[int] = None) -> "FakeStream":
        device = self.current() if device is None else device
        streams = getattr(self._tls, "torch_streams", {})
        return streams.get(device) or self.default_stream(device)

    def set_torch_stream(self, stream) -> None:
        if not hasattr(self._tls, "torch_streams"):
            self._tls.torch_streams = {}
        self._tls.torch_streams[stream.device] = stream

    # ---- memory --------------------------------------------------------------------------
    def register(self, kind: str, device: Optional[int], host: np.ndarray, name: str) -> _Memory:
        memory = _Memory(self, kind, device, host, name)
        with self.lock:
            index = bisect.bisect(self._starts, memory.start)
            self._starts.insert(index, memory.start)
            self._memories.insert(index, memory)
        return memory

    def memory_at(self, ptr: int) -> Optional[_Memory]:
        with self.lock:
            index = bisect.bisect(self._starts, ptr) - 1
            while index >= 0:
                memory = self._memories[index]
                if memory.start <= ptr < max(memory.end, memory.start + 1):
                    return memory
                index -= 1
                break
        return None

    # ---- ordering ------------------------------------------------------------------------
    def _check(self, clock: dict, span, write: bool, who: str) -> None:
        memory, lo, hi = span
        if memory is None:
            return
        pending = memory.writes + memory.reads if write else memory.writes
        for a_lo, a_hi, key, step, what in pending:
            if a_lo < hi and lo < a_hi and clock.get(key, 0) < step:
                message = (f"{who} {'writes' if write else 'reads'} {memory.name} "
                           f"[{lo - memory.start}:{hi - memory.start}] before waiting for "
                           f"{what}")
                self.violations.append(message)
                raise OrderingError(message)

    def _access(self, key, step, span, write: bool, what: str) -> None:
        memory, lo, hi = span
        if memory is None:
            return
        record = (lo, hi, key, step, what)
        if write:
            memory.writes = [a for a in memory.writes if not (lo <= a[0] and a[1] <= hi)]
            memory.reads = [a for a in memory.reads if not (lo <= a[0] and a[1] <= hi)]
            memory.writes.append(record)
        else:
            memory.reads.append(record)

    def enqueue(self, stream: "FakeStream", what: str, reads=(), writes=()) -> None:
        """One step of ``stream``: check the thread's device, then every access."""
        device = self.use_current(what)
        if device != stream.device:
            raise DeviceError(f"{what} on a stream of cuda:{stream.device} while cuda:{device} "
                              "is current")
        with self.lock:
            if self.strict:       # only the host's own writes (program order) are known
                _merge(stream.clock, {_HOST: self.host_clock.get(_HOST, 0)})
            else:
                _merge(stream.clock, self.host_clock)
            key = stream.key
            step = stream.clock.get(key, 0) + 1
            for span in reads:
                self._check(stream.clock, span, False, f"{what} on {key}")
            for span in writes:
                self._check(stream.clock, span, True, f"{what} on {key}")
            stream.clock[key] = step
            for span in reads:
                self._access(key, step, span, False, f"{what} on {key}")
            for span in writes:
                self._access(key, step, span, True, f"{what} on {key}")
            self.log.append((threading.current_thread().name, what, device, key))

    def span_at(self, ptr: int, nbytes: int) -> tuple:
        return (self.memory_at(ptr), ptr, ptr + nbytes)

    def host_access(self, span, write: bool, what: str) -> None:
        """The host (MPI, the test) reads or writes the bytes of ``span`` now."""
        if span[0] is None:
            return
        with self.lock:
            step = self.host_clock.get(_HOST, 0) + 1
            self._check(self.host_clock, span, write, what)
            self.host_clock[_HOST] = step
            self._access(_HOST, step, span, write, what)

    def host_read(self, array, what: str = "the host") -> np.ndarray:
        self.host_access(array.span, False, what)
        return array.host

    def host_write(self, array, what: str = "the host") -> None:
        self.host_access(array.span, True, what)

    def host_wait(self, clock: dict) -> None:
        with self.lock:
            _merge(self.host_clock, clock)

    def check_clean(self) -> None:
        assert not self.violations, "\n".join(self.violations)


class FakeStream:
    _names = itertools.count()

    def __init__(self, gpu: FakeGPU, device: int, label: str = "stream", register=True,
                 non_blocking: bool = True):
        self.gpu, self.device = gpu, device
        self.key = f"{label}{next(self._names)}@cuda:{device}"
        self.clock: dict = {}
        self.ptr = 0 if not register else gpu.new_ptr()
        self.non_blocking = non_blocking
        self._previous: list = []
        if register:
            gpu.register_stream(self)

    def __repr__(self):
        return f"<FakeStream {self.key}>"

    # CuPy
    def use(self):
        self.gpu.set_cupy_stream(self)
        return self

    def __enter__(self):
        self._previous.append(self.gpu.cupy_stream())
        self.use()
        return self

    def __exit__(self, *exc):
        self.gpu.set_cupy_stream(self._previous.pop())

    def record(self, event=None):
        event = event or FakeEvent(self.gpu)
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        self.gpu.enqueue(self, "wait_event")
        with self.gpu.lock:
            _merge(self.clock, event.clock)

    def synchronize(self) -> None:
        self.gpu.use_current("stream synchronize")
        self.gpu.spin_waits += 1            # cudaStreamSynchronize spins by default
        self.gpu.host_wait(dict(self.clock))

    # torch
    @property
    def cuda_stream(self) -> int:
        return self.ptr

    def record_event(self, event=None):
        return self.record(event)

    def query(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.key == self.key

    def __hash__(self):
        return hash(self.key)


class FakeEvent:
    """A CuPy or torch.cuda event (``block``/``blocking``: cudaEventBlockingSync)."""

    def __init__(self, gpu: FakeGPU, block: bool = False, disable_timing: bool = True,
                 interprocess: bool = False):
        gpu.use_current("event create")
        self.gpu, self.block, self.device = gpu, block, gpu.current()
        self.ptr = gpu.new_ptr()
        self.clock: Optional[dict] = None
        self.stream = None                    # where it was last recorded
        gpu._events[self.ptr] = self

    @property
    def cuda_event(self) -> int:
        return self.ptr if self.clock is not None else 0

    def record(self, stream=None) -> None:
        stream = stream or self.gpu.cupy_stream()
        self.gpu.enqueue(stream, "event record")
        with self.gpu.lock:
            self.clock = dict(stream.clock)
            self.stream = stream

    def wait(self, stream=None) -> None:          # torch: stream waits for this event
        (stream or self.gpu.torch_stream()).wait_event(self)

    def synchronize(self) -> None:
        self.gpu.use_current("event synchronize")
        if not self.block:
            self.gpu.spin_waits += 1
        if self.clock is not None:
            self.gpu.host_wait(self.clock)

    def query(self) -> bool:
        return True

    @property
    def done(self) -> bool:
        return True



# ---- the fake cupy ------------------------------------------------------------------------
class _Data:
    def __init__(self, ptr):
        self.ptr = ptr


class _Where:
    def __init__(self, device):
        self.id = device


class FakeArray:
    """A flat (or any) device array: host memory plus its allocation's ordering state."""

    _gpu: Optional[FakeGPU] = None       # for cupy.ndarray(shape, dtype, memptr)

    def __init__(self, gpu, memory=None, host=None, memptr=None, strides=None):
        if not isinstance(gpu, FakeGPU):      # cupy.ndarray(shape, dtype, memptr): a view
            shape, dtype = gpu, np.dtype(memory if memory is not None else np.float32)
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            gpu, memptr = FakeArray._gpu, memptr if memptr is not None else host
            nbytes = int(np.prod(shape)) * dtype.itemsize
            memory = gpu.memory_at(memptr.ptr)
            assert memory is not None and memptr.ptr + nbytes <= memory.end, "not device memory"
            gpu.use_current("ndarray from a pointer")
            buffer = (ctypes.c_uint8 * max(nbytes, 1)).from_address(memptr.ptr)
            host = np.frombuffer(buffer, np.uint8, nbytes).view(dtype).reshape(shape)
        self.gpu, self.memory, self.host = gpu, memory, host

    # attributes CuPy arrays have
    dtype = property(lambda self: self.host.dtype)
    size = property(lambda self: self.host.size)
    nbytes = property(lambda self: self.host.nbytes)
    shape = property(lambda self: self.host.shape)
    itemsize = property(lambda self: self.host.itemsize)
    flags = property(lambda self: self.host.flags)
    device = property(lambda self: _Where(self.memory.device))
    data = property(lambda self: _Data(self.host.ctypes.data))

    def __len__(self):
        return len(self.host)

    @property
    def span(self) -> tuple:
        start = self.host.ctypes.data
        return (self.memory, start, start + self.host.nbytes)

    def __repr__(self):
        return f"<FakeArray {self.host.dtype}[{self.host.size}] of {self.memory.name}>"

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.host.shape, "typestr": self.host.dtype.str, "version": 3,
                "data": (self.host.ctypes.data, False), "strides": None}

    def __getitem__(self, index):
        return FakeArray(self.gpu, self.memory, self.host[index])

    def view(self, dtype):
        return FakeArray(self.gpu, self.memory, self.host.view(dtype))

    def reshape(self, *shape):
        return FakeArray(self.gpu, self.memory, self.host.reshape(*shape))

    def _run(self, what, reads=(), write=True):
        stream = self.gpu.cupy_stream()
        spans = [a.span for a in reads if isinstance(a, FakeArray)]
        self.gpu.enqueue(stream, what, reads=spans, writes=[self.span] if write else ())

    def __setitem__(self, index, value):
        self._run("setitem", reads=[value])
        self.host[index] = value.host if isinstance(value, FakeArray) else value

    def fill(self, value):
        self._run("fill")
        self.host.fill(value)

    def astype(self, dtype):
        out = self.gpu.cupy.empty(self.host.shape, dtype)
        out._run("astype", reads=[self])
        out.host[...] = self.host.astype(dtype)
        return out

    def __mul__(self, factor):
        out = self.gpu.cupy.empty(self.host.shape, self.host.dtype)
        out._run("multiply", reads=[self])
        out.host[...] = self.host * factor
        return out


def _elementwise(gpu, name):
    fn = getattr(np, name)

    def call(a, b, out=None):
        target = out if out is not None else gpu.cupy.empty(a.shape, a.dtype)
        target._run(name, reads=[a, b])
        target.host[...] = fn(a.host if isinstance(a, FakeArray) else a,
                              b.host if isinstance(b, FakeArray) else b)
        return target
    return call


class _Device:
    """``cupy.cuda.Device``: as CuPy does, ``with`` sets the device and restores the one
    that was current (``getDevice``: device 0 on a thread that never set one)."""

    def __init__(self, gpu, device=None):
        self.gpu = gpu
        self.id = gpu.current() if device is None else int(device)
        self._stack: list = []

    def use(self):
        self.gpu.set_device(self.id, f"Device({self.id}).use()")

    def __enter__(self):
        previous = self.gpu.current()
        self._stack.append(previous)
        if previous != self.id:
            self.gpu.set_device(self.id, f"with Device({self.id})")
        return self

    def __exit__(self, *exc):
        previous = self._stack.pop()          # CuPy sets it back unconditionally
        self.gpu.set_device(previous, f"leaving Device({self.id}): restoring cuda:{previous}")


class _Kernel:
    def __init__(self, gpu, name):
        self.gpu, self.name = gpu, name

    def __call__(self, grid, block, args):
        from mpiddp.buffers.dtypes import dtype_named
        from mpiddp.buffers.host_reduce import reduce_into, scale_
        from mpiddp.reduce_ops import ReduceOp

        # The kernels' arithmetic is the host path's (tests/test_gpu_kernels.py proves it).
        self.gpu.kernel_calls.append(self.name)
        dtype = dtype_named("bfloat16" if "bf16" in self.name else
                            "float32" if "f32" in self.name else "float16")
        if "reduce" in self.name:
            dst, src, _, op = args
            dst._run(self.name, reads=[dst, src])
            reduce_into(dst.host, src.host, ReduceOp(int(op)), dtype)
        else:
            array, _, factor = args
            array._run(self.name, reads=[array])
            scale_(array.host, float(factor), dtype, exact="exact" in self.name)


class _Module:
    def __init__(self, gpu, code=None, options=()):
        gpu.use_current("RawModule")
        self.gpu, self.options = gpu, tuple(options)

    def get_function(self, name):
        self.gpu.use_current(f"get_function {name}")
        return _Kernel(self.gpu, name)


def _make_cupy(gpu: FakeGPU) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__fake__ = gpu
    cupy.ndarray = FakeArray
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    cupy.cuda = cuda
    cuda.runtime = runtime
    gpu.cupy = cupy

    def empty(shape, dtype=np.float32, name="device buffer"):
        device = gpu.use_current("malloc")
        host = np.zeros(shape, dtype=dtype)
        return FakeArray(gpu, gpu.register("device", device, host, name), host)

    def zeros(shape, dtype=np.float32):
        array = empty(shape, dtype)
        array._run("zeros")
        return array

    cupy.empty = empty
    cupy.zeros = zeros
    for name in ("add", "multiply", "minimum", "maximum", "logical_and", "logical_or",
                 "bitwise_and", "bitwise_or"):
        setattr(cupy, name, _elementwise(gpu, name))
    cupy.RawModule = lambda code=None, options=(), **kw: _Module(gpu, code, options)

    cuda.is_available = lambda: gpu.count > 0
    cuda.Device = lambda device=None: _Device(gpu, device)
    cuda.Stream = lambda null=False, non_blocking=False, ptds=False: (
        gpu.default_stream(gpu.use_current("stream")) if null else
        FakeStream(gpu, gpu.use_current("stream create"), "stream", non_blocking=non_blocking))
    cuda.ExternalStream = lambda ptr, device_id=-1: gpu.stream_at(ptr)
    cuda.Event = lambda block=False, disable_timing=False, interprocess=False: FakeEvent(
        gpu, block, disable_timing, interprocess)
    cuda.get_current_stream = lambda device_id=-1: gpu.cupy_stream()

    def alloc_pinned_memory(nbytes):
        gpu.use_current("cudaHostAlloc")
        host = np.zeros(max(1, nbytes), np.uint8)
        gpu.register("pinned", None, host, f"pinned {nbytes} B")
        return host               # NumPy wraps it (np.frombuffer) like CuPy's PinnedMemoryPointer

    cuda.alloc_pinned_memory = alloc_pinned_memory

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            if device_id < 0:
                device_id = gpu.use_current("cudaPointerGetAttributes")
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.offset = mem, offset
            self.ptr = mem.ptr + offset

    cuda.UnownedMemory = UnownedMemory
    cuda.MemoryPointer = MemoryPointer

    FakeArray._gpu = gpu

    def from_dlpack(tensor):
        """DLPack's exchange: the consumer's stream (CuPy's current one) waits for the
        producer's (torch's current one), an extra wait that views by pointer do not need."""
        gpu.dlpack_syncs += 1
        event = FakeEvent(gpu)
        event.record(gpu.torch_stream())
        gpu.cupy_stream().wait_event(event)
        return tensor.array.reshape(-1)

    cupy.from_dlpack = from_dlpack

    runtime.memcpyHostToHost, runtime.memcpyHostToDevice = 0, 1
    runtime.memcpyDeviceToHost, runtime.memcpyDeviceToDevice, runtime.memcpyDefault = 2, 3, 4
    runtime.eventDefault, runtime.eventBlockingSync, runtime.eventDisableTiming = 0, 1, 2
    runtime.getDevice = gpu.current
    runtime.setDevice = lambda device: gpu.set_device(int(device))
    runtime.getDeviceCount = lambda: gpu.count

    def memcpyAsync(dst, src, nbytes, kind, stream_ptr):
        stream = gpu.stream_at(stream_ptr)
        gpu.enqueue(stream, f"memcpyAsync kind {kind}", reads=[gpu.span_at(src, nbytes)],
                    writes=[gpu.span_at(dst, nbytes)])
        ctypes.memmove(dst, src, nbytes)

    def streamWaitEvent(stream_ptr, event_ptr, flags=0):
        gpu.stream_at(stream_ptr).wait_event(gpu._events[event_ptr])

    runtime.memcpyAsync = memcpyAsync
    runtime.streamWaitEvent = streamWaitEvent
    return cupy


# ---- the fake torch.cuda ------------------------------------------------------------------
class _StreamContext:
    def __init__(self, gpu, stream):
        self.gpu, self.stream = gpu, stream

    def __enter__(self):
        if self.stream is None:
            return None
        self.previous = self.gpu.torch_stream(self.stream.device)
        self.gpu.set_torch_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.gpu.set_torch_stream(self.previous)


def _device_index(gpu, device) -> int:
    if device is None:
        return gpu.current()
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None and isinstance(device, str):
        index = int(device.split(":")[1]) if ":" in device else None
    return gpu.current() if index is None else int(index)


class FakeCudaTensor:
    """Just enough of a CUDA ``torch.Tensor`` for the torch layer's stream handling: device
    memory of the fake, the stream it was allocated on, the streams recorded for it."""

    is_cuda, is_sparse, requires_grad = True, False, False

    def __init__(self, gpu: FakeGPU, shape, dtype=None, name="tensor", contiguous=True):
        import torch

        self.gpu, self._contiguous = gpu, contiguous
        self.dtype = dtype or torch.float32
        self.shape = torch.Size(shape)
        numpy_dtype = np.uint16 if self.dtype == torch.bfloat16 else \
            torch.empty(0, dtype=self.dtype).numpy().dtype
        self.array = gpu.cupy.empty(tuple(shape), numpy_dtype, name=name)
        self.device = torch.device("cuda", self.array.memory.device)
        self.allocated_on = gpu.torch_stream(self.device.index)
        self.recorded: list = []

    def data_ptr(self) -> int:
        return self.array.data.ptr

    def numel(self) -> int:
        return self.array.size

    def element_size(self) -> int:
        return self.array.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self, memory_format=None) -> bool:
        return self._contiguous

    def is_conj(self) -> bool:          # no lazy conjugation or negation here
        return False

    def is_neg(self) -> bool:
        return False

    def resolve_conj(self):
        return self

    def resolve_neg(self):
        return self

    def contiguous(self):
        """A contiguous copy, written by a kernel on torch's current stream."""
        if self._contiguous:
            return self
        copy = FakeCudaTensor(self.gpu, tuple(self.shape), self.dtype, "contiguous copy")
        with self.gpu.torch_stream(self.device.index):
            copy.array[...] = self.array
        return copy

    def get_device(self) -> int:
        return self.device.index

    def record_stream(self, stream) -> None:
        self.recorded.append(stream)

    def reshape(self, *shape):
        return self

    def view(self, *shape):
        return self

    def __repr__(self):
        return f"<FakeCudaTensor {tuple(self.shape)} on {self.device}>"


def fake_empty(gpu: FakeGPU, real_empty):
    """``torch.empty`` that makes a ``FakeCudaTensor`` for a cuda device."""
    def empty(*shape, dtype=None, device=None, **kw):
        if device is not None and "cuda" in str(device):
            dims = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
            return FakeCudaTensor(gpu, tuple(dims), dtype, name="torch.empty output")
        return real_empty(*shape, dtype=dtype, device=device, **kw)
    return empty


def fake_as_tensor(gpu: FakeGPU, real_as_tensor):
    """``torch.as_tensor(device_array, device="cuda:k")``: a torch view of device memory (how
    mpiddp runs torch's kernels on CuPy buffers, e.g. Adasum's). The view is a CPU tensor over
    the same memory, so torch's kernels on it run at once on the host; the fake counts them as
    one step of torch's *current stream* at the time the view is made, reading and writing the
    whole array: the view fails (``OrderingError``) unless that stream is ordered after the
    buffer's last writer (and readers), and later work on other streams must wait for it.
    Only the order is checked this way, as for every operation of the fake; a kernel queued on
    the view after another stream wrote it in between would go unseen."""
    import torch

    def as_tensor(data, dtype=None, device=None):
        if not isinstance(data, FakeArray):
            return real_as_tensor(data, dtype=dtype, device=device)
        index = int(str(device).split(":")[1]) if ":" in str(device) else gpu.current()
        if device is None or "cuda" not in str(device) or index != data.memory.device:
            raise DeviceError(f"torch.as_tensor of {data!r} with device={device!r}")
        stream = gpu.torch_stream(index)
        gpu.enqueue(stream, "torch kernels on a view of device memory", reads=[data.span],
                    writes=[data.span])
        tensor = torch.from_numpy(data.host)
        return tensor if dtype is None else tensor.to(dtype)
    return as_tensor


class FakeUUID:
    """torch's ``_CUuuid``: its ``str()`` is the UUID."""

    def __init__(self, text: str):
        self._text = text

    def __str__(self) -> str:
        return self._text


def torch_cuda_functions(gpu: FakeGPU) -> dict:
    """The torch.cuda attributes the fake replaces (name -> value)."""
    def set_device(device):
        gpu.set_device(_device_index(gpu, device), "torch.cuda.set_device")

    def current_stream(device=None):
        return gpu.torch_stream(_device_index(gpu, device))

    def new_stream(device=None, priority=0):
        index = _device_index(gpu, device)
        gpu.touch(index, "torch.cuda.Stream")
        return FakeStream(gpu, index, "torch-stream")

    def get_device_properties(device=None):
        # One fake machine: device k is the same physical GPU in every process.
        index = _device_index(gpu, device)
        return types.SimpleNamespace(name=f"Fake GPU {index}",
                                     uuid=FakeUUID(f"00000000-0000-0000-0000-{index:012x}"))

    return {
        "is_available": lambda: gpu.count > 0,
        "get_device_properties": get_device_properties,
        "device_count": lambda: gpu.count,
        "is_initialized": lambda: gpu.initialized,
        "current_device": gpu.current,
        "set_device": set_device,
        "current_stream": current_stream,
        "default_stream": lambda device=None: gpu.default_stream(_device_index(gpu, device)),
        "Stream": new_stream,
        "ExternalStream": lambda ptr, device=None: gpu.stream_at(ptr),
        "Event": lambda enable_timing=False, blocking=False, interprocess=False: FakeEvent(
            gpu, blocking),
        "stream": lambda stream: _StreamContext(gpu, stream),
        "set_stream": gpu.set_torch_stream,
        "synchronize": lambda device=None: None,
    }


def install(gpu: FakeGPU, monkeypatch=None) -> types.ModuleType:
    """Put the fake cupy into ``sys.modules`` and the fake functions onto ``torch.cuda``
    (through ``monkeypatch`` when given, so that a test undoes it; else for good: workers)."""
    import torch

    cupy = _make_cupy(gpu)
    modules = {"cupy": cupy, "cupy.cuda": cupy.cuda, "cupy.cuda.runtime": cupy.cuda.runtime}
    for name, module in modules.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, module)
        else:
            sys.modules[name] = module
    for name, value in torch_cuda_functions(gpu).items():
        if monkeypatch is not None:
            monkeypatch.setattr(torch.cuda, name, value)
        else:
            setattr(torch.cuda, name, value)
    as_tensor = fake_as_tensor(gpu, torch.as_tensor)
    if monkeypatch is not None:
        monkeypatch.setattr(torch, "as_tensor", as_tensor)
    else:
        torch.as_tensor = as_tensor
    if monkeypatch is None:      # a worker, before it imports mpiddp: nothing to replace
        return cupy
    # mpiddp's device module binds CuPy when imported: a copy bound to the fake, which the
    # monkeypatch takes away again (the real one, if imported, comes back).
    name = "mpiddp.buffers.device"
    import mpiddp.buffers as package

    previous_module = sys.modules.pop(name, None)
    previous_attribute = package.__dict__.get("device")
    module = importlib.import_module(name)
    if previous_module is not None:
        sys.modules[name] = previous_module
    else:
        del sys.modules[name]
    if previous_attribute is not None:
        package.device = previous_attribute
    else:
        del package.device
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(package, "device", module, raising=False)
    return cupy


class CheckingComm:
    """Forwards the calls the staging code makes to a real communicator, and tells the fake
    which host buffers MPI reads and writes: MPI may only read a pinned slot after the copy
    into it was waited for, and only write one whose copy to the device has finished."""

    def __init__(self, comm, gpu: FakeGPU):
        self.comm, self.gpu = comm, gpu

    def _host(self, spec, write: bool, what: str):
        if not isinstance(spec, (list, tuple)):
            return
        array = spec[0]
        if isinstance(array, FakeArray):
            raise OrderingError(f"{what}: a device buffer reached a non-CUDA-aware MPI")
        if isinstance(array, np.ndarray) and array.size:
            self.gpu.host_access(self.gpu.span_at(array.ctypes.data, array.nbytes), write, what)

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def Isend(self, buf, dest, tag=0):
        self._host(buf, False, "MPI Isend")
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        self._host(buf, True, "MPI Irecv")
        return self.comm.Irecv(buf, source, tag)

    def Allreduce(self, sendbuf, recvbuf, op=None):
        self._host(sendbuf, False, "MPI Allreduce")
        self._host(recvbuf, True, "MPI Allreduce")
        return self.comm.Allreduce(sendbuf, recvbuf, op) if op is not None else \
            self.comm.Allreduce(sendbuf, recvbuf)

    def Bcast(self, buf, root=0):
        self._host(buf, self.comm.Get_rank() != root, "MPI Bcast")
        return self.comm.Bcast(buf, root=root)

    def Allgatherv(self, sendbuf, recvbuf):
        self._host(sendbuf, False, "MPI Allgatherv")
        self._host(recvbuf, True, "MPI Allgatherv")
        return self.comm.Allgatherv(sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf):
        self._host(sendbuf, False, "MPI Alltoallv")
        self._host(recvbuf, True, "MPI Alltoallv")
        return self.comm.Alltoallv(sendbuf, recvbuf)
