"""GPU set-up at ``init()`` (runtime level): which device this rank uses, and whether MPI is
CUDA-aware. (The device is first chosen when mpiddp is imported, before ``MPI_Init``, from
the launcher's local rank: ``local_device.py``; here MPI's node layout confirms it.)

Each rank uses one GPU, its *engine device*: ``local_rank % device_count`` among the devices
it can see, chosen before the first CUDA call so that the CUDA context is created on the
right device (a context on GPU 0 for every rank costs memory there and hides mistakes).
With ``CUDA_VISIBLE_DEVICES`` set per rank, each rank sees one device and uses it. If the
program initialised CUDA before ``init()`` (``torch.cuda.set_device``, a CUDA tensor), its
current device is kept: that was the program's choice.

CUDA tensors must live on the engine device; ``check_tensor_device`` says so at submission.
Nothing here imports CuPy, and torch.cuda is only asked questions that work on CPU builds.
"""
from __future__ import annotations

import logging
from typing import Optional

from .buffers import set_default_device
from . import local_device
from .transport import cuda_aware

log = logging.getLogger("mpiddp")

_engine_device: Optional[int] = None
_how = "no CUDA device"


def choose_device(local_rank: int, device_count: int) -> Optional[int]:
    """The device a rank uses: ``local_rank % device_count`` (None without devices).
    Ranks beyond the device count share GPUs round-robin."""
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, not {local_rank}")
    if device_count <= 0:
        return None
    return local_rank % device_count


def select_device(local_rank: int, cuda=None) -> Optional[int]:
    """Choose and set this rank's engine device through ``cuda`` (default ``torch.cuda``;
    tests pass a stand-in). Returns the device index, or None where CUDA is unavailable."""
    global _engine_device, _how
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available() or cuda.device_count() == 0:
        _engine_device, _how = None, "no CUDA device"
        set_default_device(None)
        return None
    count = cuda.device_count()
    wanted = choose_device(local_rank, count)
    early = local_device.chosen_before_mpi()
    if cuda.is_initialized() and early is not None and early[0] == cuda.current_device():
        # mpiddp's own choice at import, before MPI_Init, from the launcher's local rank;
        # MPI's node layout has the last word.
        if early[0] != wanted:
            cuda.set_device(wanted)
        _engine_device = wanted
        set_default_device(wanted)
        _how = (f"cuda:{wanted} = local rank {local_rank} % {count} visible device(s), "
                f"chosen before MPI_Init from {early[1]}")
        if early[0] != wanted:
            _how += f" (which gave cuda:{early[0]}: MPI's node layout differs)"
        return wanted
    if cuda.is_initialized():
        current = cuda.current_device()
        _engine_device = current
        set_default_device(current)
        _how = f"cuda:{current}, kept: CUDA was initialised before mpiddp.init()"
        if current != wanted:
            _how += f" (local rank {local_rank} of {count} visible devices would use cuda:{wanted})"
        return current
    cuda.set_device(wanted)
    _engine_device = wanted
    set_default_device(wanted)
    _how = f"cuda:{wanted} = local rank {local_rank} % {count} visible device(s)"
    return wanted


def engine_device() -> Optional[int]:
    """This rank's engine device (index among visible devices), None before ``init()`` or
    without CUDA."""
    return _engine_device


def check_tensor_device(index: int) -> None:
    """Raise ValueError for a CUDA tensor that is not on this rank's engine device."""
    if _engine_device is not None and index != _engine_device:
        raise ValueError(
            f"a CUDA tensor on cuda:{index} was given to mpiddp, but this rank uses "
            f"cuda:{_engine_device} ({_how}). Keep the model on that device "
            f"(torch.cuda.set_device({_engine_device}) or tensor.cuda() after mpiddp.init()), "
            "or set CUDA_VISIBLE_DEVICES per rank, or call torch.cuda.set_device() before "
            "mpiddp.init() to choose another device (docs/gpu.md)")


def setup(settings, local_rank: int, cuda=None) -> str:
    """Called by ``init()``: select the device, decide CUDA-awareness, log one line."""
    select_device(local_rank, cuda)
    decision = cuda_aware.configure(settings.cuda_aware)
    line = f"GPU: {_how}; CUDA-aware MPI: {decision.describe()}"
    if _engine_device is not None and not decision.cuda_aware:
        line += "; device buffers are staged through pinned host memory"
    log.info(line)
    return line


def reset() -> None:
    """Forget the selection (tests)."""
    global _engine_device, _how
    _engine_device, _how = None, "no CUDA device"
    set_default_device(None)
    local_device.reset()
    cuda_aware.reset()
