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
Ranks that end up on one physical GPU (every rank on GPU 0 after a wrong
``CUDA_VISIBLE_DEVICES``, more ranks than GPUs) take turns on it; ``warn_about_shared_devices``
names them once per job. Nothing here imports CuPy, and torch.cuda is only asked questions
that work on CPU builds.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

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


def device_identity(cuda=None) -> Optional[str]:
    """The engine device's UUID as CUDA reports it (the same for every process and every
    ``CUDA_VISIBLE_DEVICES`` numbering of one physical GPU, or MIG instance), or None without
    an engine device or where the driver does not say."""
    if _engine_device is None:
        return None
    if cuda is None:
        import torch

        cuda = torch.cuda
    try:
        return str(cuda.get_device_properties(_engine_device).uuid)
    except Exception:           # an old driver or build without it: no check, not a failure
        return None


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def shared_devices_report(identities: Sequence, shown: int = 4) -> Optional[str]:
    """What to tell the user when ranks share a physical GPU, or None when none do.
    ``identities[r]``: rank r's (host, engine device index, UUID), or None (no GPU, or no
    UUID)."""
    by_uuid: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        if identity is not None and identity[2]:
            by_uuid.setdefault(identity[2], []).append(rank)
    shared = [ranks for ranks in by_uuid.values() if len(ranks) > 1]
    if not shared:
        return None
    groups = []
    for ranks in shared[:shown]:
        host, index, uuid = identities[ranks[0]]
        groups.append(f"ranks {_rank_ranges(ranks)} on {host} use one GPU "
                      f"(cuda:{index}, {uuid})")
    if len(shared) > shown:
        groups.append(f"and {len(shared) - shown} more GPUs shared alike")
    return ("several ranks share a GPU: " + "; ".join(groups) + ". Ranks sharing a GPU take "
            "turns on it (each switch between their CUDA contexts costs time). Give each rank "
            "its own GPU (as many ranks per node as GPUs, e.g. srun with --ntasks-per-node "
            "equal to --gpus-per-node: mpiddp uses GPU <local rank>), or run the ranks under "
            "CUDA MPS if the sharing is meant; training on the CPU only: "
            "CUDA_VISIBLE_DEVICES= hides the GPUs (docs/running.md, \"GPUs\")")


def warn_about_shared_devices(comm, host: str, cuda=None) -> Optional[str]:
    """A collective of ``comm`` (called by ``init()`` after ``setup``): gather every rank's
    GPU identity; rank 0 logs a warning naming the ranks that share a physical GPU. Returns
    the warning (on every rank), or None."""
    uuid = device_identity(cuda)
    mine = None if uuid is None else (host, _engine_device, uuid)
    report = shared_devices_report(comm.allgather(mine))
    if report is not None and comm.Get_rank() == 0:
        log.warning(report)
    return report


def reset() -> None:
    """Forget the selection (tests)."""
    global _engine_device, _how
    _engine_device, _how = None, "no CUDA device"
    set_default_device(None)
    local_device.reset()
    cuda_aware.reset()
