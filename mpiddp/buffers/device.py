"""Device (CuPy) buffers for CUDA tensors: allocation, reduce and scale kernels, and the
stream discipline that keeps MPI and CUDA in order.

Imported only when the engine first meets a CUDA tensor (``buffers.backend_for``), so CPU
jobs never import CuPy.

Ordering, all without timing assumptions:

* Every device has one *engine stream* (non-blocking). All engine work on device buffers
  (packing, reduce kernels, scaling, unpacking, staging copies to the device) is queued on it.
* ``wait_ready(entry)`` makes the engine stream wait (on the device, not the host) for the
  ``torch.cuda.Event`` recorded on the stream that produced the tensor.
* The device transports (``transport.staging``) record the *flush event* on the engine
  stream before each collective. The direct one (CUDA-aware MPI) waits for it on the host
  before MPI reads or writes a device buffer: MPI does not order itself against streams. The
  staging one's copy stream waits for it on the device before it copies engine-written bytes
  to the host; the host waits only for those copies, since MPI touches only pinned memory.
* ``after_unpack`` records the *done event* on the engine stream and waits for it before the
  handles complete; the torch layer makes the caller's stream wait for it too.
* Every host wait is on an event made with ``cudaEventBlockingSync``: the thread sleeps
  instead of spinning a core (``cudaStreamSynchronize`` would spin).
* Outputs the torch layer allocates on the engine thread (allgather, alltoall,
  reduce-scatter) are allocated inside ``allocating()``, on the engine stream that writes
  them; the torch layer records the caller's stream as their other user.
* Every CUDA call is made with the buffer's device current on the calling thread
  (``use_device``), which is left current: CUDA's current device is per host thread, and a
  guard that "restores" device 0 on a thread that never chose one creates a context there.

Buffers come from CuPy's default memory pool (plain ``cudaMalloc`` memory, which every
CUDA-aware MPI can register) and are kept by the engine's ``BufferPool`` for the whole run.
"""
from __future__ import annotations

import threading

import cupy
import numpy as np
from cupy.cuda import runtime

from ..errors import MpiddpError
from ..reduce_ops import ReduceOp, combine_function
from .default_device import default_device
from .adasum_kernels import HostAdasumKernels, TorchAdasumKernels
from .device_kernels import COMPILE_OPTIONS, KERNEL_SOURCE, THREADS_PER_BLOCK, launch_blocks
from .dtypes import DType, as_real
from .host_reduce import reduce_into as host_reduce_into

# Our own kernels for the floating types whose results must equal the host path's bit for
# bit: CuPy's elementwise kernels are compiled with -ftz=true and flush subnormals.
_FLOAT_REDUCE = {"float16": "mpiddp_f16_reduce", "bfloat16": "mpiddp_bf16_reduce",
                 "float32": "mpiddp_f32_reduce"}
_FLOAT_SCALE = {"float16": "mpiddp_f16_scale_kernel", "bfloat16": "mpiddp_bf16_scale_kernel",
                "float32": "mpiddp_f32_scale_kernel"}


def use_device(device_id: int) -> None:
    """Make ``device_id`` current on the calling thread, and leave it so. Not ``with
    cupy.cuda.Device(...)``: leaving that sets back the device that was current, which on a
    thread that never chose one is device 0, and setting it creates a context on GPU 0."""
    if runtime.getDevice() != device_id:
        runtime.setDevice(device_id)


class _DeviceState:
    """Per-device engine resources: streams and the compiled half-precision kernels."""

    def __init__(self, device_id: int):
        self.id = device_id
        self.flushed = None           # the last flush event of the engine stream
        self.torch_stream = None      # the engine stream as torch sees it (allocating)
        use_device(device_id)         # first: the guard below then restores this same device
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)       # the engine stream
            self.copy_stream = cupy.cuda.Stream(non_blocking=True)  # staging device->host
            self._module = cupy.RawModule(code=KERNEL_SOURCE, options=COMPILE_OPTIONS)
            self._kernels = {}

    def flush(self):
        """Record the flush event on the engine stream: it completes once everything queued
        there so far (packing into the fusion buffer, kernels, copies) has."""
        use_device(self.id)
        event = cupy.cuda.Event(block=True, disable_timing=True)
        event.record(self.stream)
        self.flushed = event
        return event

    def synchronize(self):
        """Wait, sleeping rather than spinning, for the engine stream's work so far; returns
        the flush event waited for."""
        event = self.flush()
        event.synchronize()
        return event

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            use_device(self.id)
            k = self._kernels[name] = self._module.get_function(name)
        return k


class CupyCopier:
    """The device side of ``staging.StagedComm``: pinned host buffers and asynchronous
    copies. Device-to-host copies run on a copy stream, after the last flush event (so they
    see every engine-stream write before it); host-to-device copies run on the engine stream,
    so the kernels queued after them are ordered after them."""

    def __init__(self, state: _DeviceState):
        self.state = state
        self.device_id = state.id

    def pinned(self, nbytes: int) -> np.ndarray:
        use_device(self.state.id)
        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)

    def sync(self) -> None:
        self.state.synchronize()

    def flush(self) -> None:
        self.state.flush()

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream):
        use_device(self.state.id)
        runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        event = cupy.cuda.Event(block=True, disable_timing=True)      # waited without spinning
        event.record(stream)
        return event

    def to_host(self, host: np.ndarray, src_ptr: int, nbytes: int):
        state = self.state
        if state.flushed is not None:
            # The copy stream reads what the engine stream wrote: ordered after the flush
            # event on the device, not only through the host's wait for it.
            use_device(state.id)
            runtime.streamWaitEvent(state.copy_stream.ptr, state.flushed.ptr, 0)
        return self._copy(host.ctypes.data, src_ptr, nbytes, runtime.memcpyDeviceToHost,
                          self.state.copy_stream)

    def to_device(self, dst_ptr: int, host: np.ndarray, nbytes: int):
        return self._copy(dst_ptr, host.ctypes.data, nbytes, runtime.memcpyHostToDevice,
                          self.state.stream)

    def wait(self, event) -> None:
        if event is not None:
            event.synchronize()


def _event_pointer(event) -> int:
    """The ``cudaEvent_t`` behind a torch.cuda.Event (``cuda_event``) or a CuPy Event
    (``ptr``); 0 for an event that was never recorded."""
    ptr = getattr(event, "cuda_event", None)
    if ptr is None:
        ptr = getattr(event, "ptr", 0)
    return int(ptr or 0)


class DeviceBackend:
    """Buffer operations for device type 'cuda' (the ``HostBackend`` interface)."""

    device_type = "cuda"

    def __init__(self, device: int | None = None):
        if not cupy.cuda.is_available():
            raise MpiddpError("mpiddp got a CUDA tensor but CuPy finds no usable CUDA device "
                              "(cupy.cuda.is_available() is False): check the driver and that "
                              "the cupy-cudaXXx package matches the CUDA version")
        self._fixed_device = device
        self._states: dict[int, _DeviceState] = {}
        self._copiers: dict[int, CupyCopier] = {}
        self._lock = threading.Lock()
        self._thread = threading.local()

    # ---- devices and streams --------------------------------------------------------------
    def device_id(self, device: str | None = None) -> int:
        """The device index for a device string: 'cuda:N' names it; plain 'cuda' (what
        requests carry) is this rank's engine device, chosen at init."""
        if device and ":" in device:
            return int(device.split(":", 1)[1])
        if self._fixed_device is not None:
            return self._fixed_device
        chosen = default_device()      # set by mpiddp.gpu at init()
        return chosen if chosen is not None else runtime.getDevice()

    def state(self, device_id: int) -> _DeviceState:
        """The resources of ``device_id``, whose device is now current on the calling thread
        (before any CUDA call of the caller)."""
        state = self._states.get(device_id)
        if state is None:
            with self._lock:
                state = self._states.get(device_id)
                if state is None:
                    state = self._states[device_id] = _DeviceState(device_id)
        use_device(device_id)
        return state

    def _array_state(self, array) -> _DeviceState:
        return self.state(array.device.id)

    def stream(self, device: str | None = None):
        """The engine stream of ``device`` (for tests and benchmarks)."""
        return self.state(self.device_id(device)).stream

    def _activate(self, state: _DeviceState) -> None:
        """Make ``state``'s engine stream current on the calling (engine) thread (``state()``
        made its device current)."""
        if getattr(self._thread, "active", None) is not state:
            state.stream.use()
            self._thread.active = state

    def allocating(self):
        """Around an entry's ``allocate``: tensors torch allocates inside belong to the
        engine stream, which writes them (torch's current stream for the moment; the torch
        layer records the caller's stream as a user too)."""
        import torch

        state = self.state(self.device_id())
        if state.torch_stream is None:
            state.torch_stream = torch.cuda.ExternalStream(state.stream.ptr, device=state.id)
        return torch.cuda.stream(state.torch_stream)

    # ---- the backend interface ------------------------------------------------------------
    def empty(self, count: int, dtype: DType):
        state = self.state(self.device_id())
        with state.stream:
            # zeros, queued on the engine stream: later engine work is ordered after it
            return cupy.zeros(count, dtype=dtype.storage)

    def copy(self, dst, src) -> None:
        if dst.size != src.size or dst.dtype.itemsize != src.dtype.itemsize:
            raise ValueError(f"copy of {src.size} x {src.dtype} into {dst.size} x {dst.dtype}")
        if dst.size == 0:
            return
        state = self._array_state(dst)
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            # cudaMemcpyDefault: unified addressing also covers a source on another GPU
            runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                runtime.memcpyDefault, state.stream.ptr)
        else:
            with state.stream:
                dst[...] = src

    def fill(self, array, value) -> None:
        if array.size:
            state = self._array_state(array)
            with state.stream:
                array.fill(value)

    def reduce_into(self, dst, src, op: ReduceOp, dtype: DType) -> None:
        """``dst = op(dst, src)`` elementwise, queued on the engine stream. Host arrays (MPI
        calling a user-defined op on staged host memory) are reduced on the host."""
        if isinstance(dst, np.ndarray):
            host_reduce_into(dst, src, op, dtype)
            return
        if dtype.kind == "complex":              # sums only: part by part
            (dst, dtype), (src, _) = as_real(dst, dtype), as_real(src, dtype)
        n = dst.size
        if n == 0:
            return
        state = self._array_state(dst)
        with state.stream:
            if dtype.name in _FLOAT_REDUCE:
                kernel = state.kernel(_FLOAT_REDUCE[dtype.name])
                kernel((launch_blocks(n),), (THREADS_PER_BLOCK,),
                       (dst, src, np.int64(n), np.int32(int(op))))
            else:
                getattr(cupy, combine_function(op, dtype.kind))(dst, src, out=dst)

    def scale_(self, array, factor: float, dtype: DType, exact: bool = False) -> None:
        """Multiply a floating-point buffer by ``factor`` in place on the device (Average's
        1/size, pre/post scale factors) with our kernels: half types compute in float32 and
        round once; float32 with ``exact`` computes in float64 and rounds once, as the host."""
        if factor == 1.0 or array.size == 0:
            return
        if isinstance(array, np.ndarray):
            from .host_reduce import scale_ as host_scale_

            host_scale_(array, factor, dtype, exact)
            return
        array, dtype = as_real(array, dtype)     # complex: part by part, as its real dtype
        if dtype.kind not in ("float", "int"):
            raise TypeError(f"cannot scale a {dtype.name} buffer by {factor}")
        state = self._array_state(array)
        with state.stream:
            if dtype.kind == "int":     # as on the host: float64, truncated toward zero
                array[...] = (array.astype(cupy.float64) * factor).astype(array.dtype)
            elif dtype.name == "float32" and exact:    # in float64, rounded once, as the host
                self._launch(state, "mpiddp_f32_scale_exact_kernel", array, np.float64(factor))
            elif dtype.name in _FLOAT_SCALE:
                self._launch(state, _FLOAT_SCALE[dtype.name], array, np.float32(factor))
            else:
                cupy.multiply(array, float(factor), out=array)

    @staticmethod
    def _launch(state, name: str, array, factor) -> None:
        n = array.size
        state.kernel(name)((launch_blocks(n),), (THREADS_PER_BLOCK,),
                           (array, np.int64(n), factor))

    def adasum_kernels(self, dtype: DType) -> "EngineStreamAdasumKernels":
        """Adasum's dot products and combinations on device buffers of ``dtype``: torch's
        kernels, queued on the engine stream."""
        return EngineStreamAdasumKernels(TorchAdasumKernels(dtype), HostAdasumKernels(dtype), self)

    def wait_ready(self, entry) -> None:
        """Make the engine stream wait (on the device) for the event recorded on the stream
        that produced the entry's tensor."""
        array = entry.input if entry.input is not None else entry.output
        if isinstance(array, cupy.ndarray):
            state = self._array_state(array)
        else:
            state = self.state(self.device_id(entry.request.device))
        self._activate(state)
        event = entry.ready_event
        if event is None:
            return
        pointer = _event_pointer(event)
        if pointer:
            runtime.streamWaitEvent(state.stream.ptr, pointer, 0)

    def after_unpack(self, device: str):
        """Results are in memory before the handles complete. Returns the done event,
        recorded on the engine stream after the results, for the caller's stream to wait for
        (``torch/streams.py``)."""
        return self.state(self.device_id(device)).synchronize()

    def copier(self) -> CupyCopier:
        """The device side of a staging transport for this rank's engine device (see
        ``mpiddp.transport``)."""
        device_id = self.device_id()
        copier = self._copiers.get(device_id)
        if copier is None:
            copier = self._copiers[device_id] = CupyCopier(self.state(device_id))
        return copier


class EngineStreamAdasumKernels:
    """Adasum's kernels (``adasum_kernels.py``) with the engine stream as torch's current
    stream, so that they run after the engine's packing and received transfers and before its
    later copies; host arrays (staged memory) are handled on the host."""

    def __init__(self, kernels: TorchAdasumKernels, host: HostAdasumKernels,
                 backend: DeviceBackend):
        self.kernels, self.host, self.backend = kernels, host, backend

    def dots(self, a, b, segments):
        if isinstance(a, np.ndarray):
            return self.host.dots(a, b, segments)
        with self.backend.allocating():
            return self.kernels.dots(a, b, segments)

    def combine(self, x, y, segments, coefficients) -> None:
        if isinstance(x, np.ndarray):
            self.host.combine(x, y, segments, coefficients)
            return
        with self.backend.allocating():
            self.kernels.combine(x, y, segments, coefficients)
