"""Device (CuPy) buffers for CUDA tensors: allocation, reduce and scale kernels, and the
stream discipline that keeps MPI and CUDA in order.

Imported only when the engine first meets a CUDA tensor (``buffers.backend_for``), so CPU
jobs never import CuPy.

Ordering, all without timing assumptions:

* Every device has one *engine stream* (non-blocking). All engine work on device buffers
  (packing, reduce kernels, scaling, unpacking, staging copies to the device) is queued on it.
* ``wait_ready(entry)`` makes the engine stream wait (on the device, not the host) for the
  ``torch.cuda.Event`` recorded on the stream that produced the tensor.
* ``before_mpi`` and the staging transport (``transport.staging``) synchronise the engine stream
  before MPI reads or writes a device buffer: MPI does not order itself against streams.
* ``after_unpack`` synchronises the engine stream before the handles complete, so the
  results are visible to any stream the caller uses next.
* The engine thread's current CuPy stream is the engine stream, so a tensor the engine
  allocates (allgather output) is handed over through DLPack with the producer's stream
  (torch's current stream) ordered before the engine stream, as the DLPack protocol promises.

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
from .device_kernels import COMPILE_OPTIONS, KERNEL_SOURCE, THREADS_PER_BLOCK, launch_blocks
from .dtypes import DType
from .host_reduce import reduce_into as host_reduce_into

_HALF_REDUCE = {"float16": "mpiddp_f16_reduce", "bfloat16": "mpiddp_bf16_reduce"}
_HALF_SCALE = {"float16": "mpiddp_f16_scale_kernel", "bfloat16": "mpiddp_bf16_scale_kernel"}


class _DeviceState:
    """Per-device engine resources: streams and the compiled half-precision kernels."""

    def __init__(self, device_id: int):
        self.id = device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)       # the engine stream
            self.copy_stream = cupy.cuda.Stream(non_blocking=True)  # staging device->host
            self._module = cupy.RawModule(code=KERNEL_SOURCE, options=COMPILE_OPTIONS)
            self._kernels = {}

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            with cupy.cuda.Device(self.id):
                k = self._kernels[name] = self._module.get_function(name)
        return k


class CupyCopier:
    """The device side of ``staging.StagedComm``: pinned host buffers and asynchronous
    copies. Device-to-host copies run on a copy stream (after ``sync``, so they see every
    engine-stream write); host-to-device copies run on the engine stream, so the kernels
    queued after them are ordered after them."""

    def __init__(self, state: _DeviceState):
        self.state = state
        self.device_id = state.id

    def pinned(self, nbytes: int) -> np.ndarray:
        with cupy.cuda.Device(self.state.id):
            memory = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)

    def sync(self) -> None:
        self.state.stream.synchronize()

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream):
        with cupy.cuda.Device(self.state.id):
            runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
        return event

    def to_host(self, host: np.ndarray, src_ptr: int, nbytes: int):
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
        state = self._states.get(device_id)
        if state is None:
            with self._lock:
                state = self._states.get(device_id)
                if state is None:
                    state = self._states[device_id] = _DeviceState(device_id)
        return state

    def _array_state(self, array) -> _DeviceState:
        return self.state(array.device.id)

    def stream(self, device: str | None = None):
        """The engine stream of ``device`` (for tests and benchmarks)."""
        return self.state(self.device_id(device)).stream

    def _activate(self, state: _DeviceState) -> None:
        """Make ``state``'s device and engine stream current on the calling (engine) thread."""
        if getattr(self._thread, "active", None) is not state:
            cupy.cuda.Device(state.id).use()
            state.stream.use()
            self._thread.active = state

    # ---- the backend interface ------------------------------------------------------------
    def empty(self, count: int, dtype: DType):
        state = self.state(self.device_id())
        with cupy.cuda.Device(state.id), state.stream:
            # zeros, queued on the engine stream: later engine work is ordered after it
            return cupy.zeros(count, dtype=dtype.storage)

    def copy(self, dst, src) -> None:
        if dst.size != src.size or dst.dtype.itemsize != src.dtype.itemsize:
            raise ValueError(f"copy of {src.size} x {src.dtype} into {dst.size} x {dst.dtype}")
        if dst.size == 0:
            return
        state = self._array_state(dst)
        with cupy.cuda.Device(state.id):
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
            with cupy.cuda.Device(state.id), state.stream:
                array.fill(value)

    def reduce_into(self, dst, src, op: ReduceOp, dtype: DType) -> None:
        """``dst = op(dst, src)`` elementwise, queued on the engine stream. Host arrays (MPI
        calling a user-defined op on staged host memory) are reduced on the host."""
        if isinstance(dst, np.ndarray):
            host_reduce_into(dst, src, op, dtype)
            return
        n = dst.size
        if n == 0:
            return
        state = self._array_state(dst)
        with cupy.cuda.Device(state.id), state.stream:
            if dtype.name in _HALF_REDUCE:
                kernel = state.kernel(_HALF_REDUCE[dtype.name])
                kernel((launch_blocks(n),), (THREADS_PER_BLOCK,),
                       (dst, src, np.int64(n), np.int32(int(op))))
            else:
                getattr(cupy, combine_function(op, dtype.kind))(dst, src, out=dst)

    def scale_(self, array, factor: float, dtype: DType, exact: bool = False) -> None:
        """Multiply a floating-point buffer by ``factor`` in place on the device (Average's
        1/size, pre/post scale factors). Half types compute in float32 and round once."""
        if factor == 1.0 or array.size == 0:
            return
        if isinstance(array, np.ndarray):
            from .host_reduce import scale_ as host_scale_

            host_scale_(array, factor, dtype, exact)
            return
        if dtype.kind not in ("float", "int"):
            raise TypeError(f"cannot scale a {dtype.name} buffer by {factor}")
        state = self._array_state(array)
        with cupy.cuda.Device(state.id), state.stream:
            if dtype.kind == "int":     # as on the host: float64, truncated toward zero
                array[...] = (array.astype(cupy.float64) * factor).astype(array.dtype)
            elif dtype.name in _HALF_SCALE:
                kernel = state.kernel(_HALF_SCALE[dtype.name])
                n = array.size
                kernel((launch_blocks(n),), (THREADS_PER_BLOCK,),
                       (array, np.int64(n), np.float32(factor)))
            elif dtype.name == "float32":
                cupy.multiply(array, np.float32(factor), out=array)
            else:
                cupy.multiply(array, float(factor), out=array)

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
            with cupy.cuda.Device(state.id):
                runtime.streamWaitEvent(state.stream.ptr, pointer, 0)

    def _sync_all(self) -> None:
        for state in list(self._states.values()):
            state.stream.synchronize()

    def before_mpi(self, device: str) -> None:
        """Everything queued on the engine stream is done before MPI touches a buffer."""
        self._sync_all()

    def after_unpack(self, device: str) -> None:
        """Results are in memory before the handles complete: the caller may read them on
        any stream."""
        self._sync_all()

    def copier(self) -> CupyCopier:
        """The device side of a staging transport for this rank's engine device (see
        ``mpiddp.transport``)."""
        device_id = self.device_id()
        copier = self._copiers.get(device_id)
        if copier is None:
            copier = self._copiers[device_id] = CupyCopier(self.state(device_id))
        return copier
