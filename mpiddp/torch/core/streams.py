"""The caller's CUDA streams against the engine's: what the torch layer records and waits for.

* Before the engine reads a tensor it waits for an event recorded on the stream that produced
  it (``ready_event``), recorded where the tensor was produced: at the call, or in a
  gradient's hook (a bucket is flushed later, maybe on another stream).
* Outputs the engine allocates on its thread belong to the engine stream (the engine thread's
  current torch stream); ``record_use`` tells torch's caching allocator that the caller's
  stream uses them too, so their memory is not handed out again while work queued there may
  still read it.
* ``wait_done`` makes the caller's current stream wait, on the device, for the event the
  engine recorded after writing the results (the engine has also waited for it on the host
  before the handle completed: this keeps the caller's stream ordered on its own).

CPU tensors need none of this: every function here does nothing for them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import gpu


def caller_stream(tensor: torch.Tensor):
    """The current stream of ``tensor``'s device on the calling thread (None on the CPU)."""
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def ready_event(tensor: torch.Tensor):
    """An event on the stream producing ``tensor`` (the current one), for the engine to wait
    for before reading it; None on the CPU."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def record_use(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator that ``stream`` (the caller's) uses ``tensor``, allocated on
    another stream (the engine's)."""
    if stream is not None:
        tensor.record_stream(stream)


def wait_done(events: list) -> None:
    """Make the current stream of the engine's device wait for each done event (recorded by
    the engine after writing results: ``DeviceBackend.after_unpack``)."""
    if not events:
        return
    from cupy.cuda import runtime     # device results came from CuPy: it is imported

    device: Optional[int] = gpu.engine_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    for event in events:
        runtime.streamWaitEvent(stream, event.ptr, 0)
