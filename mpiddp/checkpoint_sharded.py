"""``mpiddp.Checkpoint(..., sharded=True)``'s save and restore: every rank writes its own part
at once, rank 0 the manifest last (the format: ``checkpoint_files.py``); every rank reads back
what its shards need, from a save of any rank count and stage."""
from __future__ import annotations

import logging
from typing import Any

from . import checkpoint_files
from .runtime import rank, size
from .torch.core.sharded_registry import zero_stage_of
from .torch.ops.functions import allgather_object, broadcast_object
from .torch.sharding.checkpoint_parts import describe, load_model, model_part


def save(ckpt, epoch: int, step: int, rng: Any) -> None:
    """Collective: write this rank's part of the save, then (rank 0, once every part is on
    disk) the manifest that makes it the checkpoint.

    Raises:
        OSError: a rank could not write its part, or rank 0 the manifest (on every rank:
            the previous checkpoint stays).
    """
    number = broadcast_object(checkpoint_files.next_save(ckpt.path) if rank() == 0 else None,
                              root_rank=0, name="mpiddp.checkpoint.save_number")
    directory = checkpoint_files.save_directory(ckpt.path, number)
    sync = ckpt.optimizer._mpiddp
    sharded = ckpt.optimizer.sharded_state_dict()
    part = {"mpiddp_part": {"version": checkpoint_files.VERSION, "rank": rank(),
                            "world_size": size(), "save": number,
                            "replica": sync.layout.grid.replica},
            "rng": rng, "model": model_part(ckpt.model, ckpt.optimizer, sharded, rank() == 0)}
    if sync.layout.grid.replica:
        sharded["state"] = {}           # (hybrid: another node's copy of the same pieces)
    part["optimizer"] = sharded
    if rank() == 0:
        part.update(epoch=epoch, step=step, extra=ckpt.extra, **describe(ckpt.model))
    error = None
    try:
        checkpoint_files.write_part(directory, rank(), part)
    except OSError as exc:
        error = f"rank {rank()}: {exc}"
    del part, sharded
    # Every part on disk (or a rank's error) before the manifest: this is the barrier.
    errors = [e for e in allgather_object(error, name="mpiddp.checkpoint.parts") if e]
    if errors:
        raise OSError(f"mpiddp.Checkpoint.save: the parts of {directory} were not all "
                      f"written ({'; '.join(errors)}); {ckpt.path} still names the previous "
                      "checkpoint")
    error = None
    if rank() == 0:
        try:
            checkpoint_files.write_manifest(ckpt.path, directory, size(),
                                            {"epoch": epoch, "step": step})
        except OSError as exc:
            error = str(exc)
    error = broadcast_object(error, root_rank=0, name="mpiddp.checkpoint.manifest")
    if error:
        raise OSError(f"mpiddp.Checkpoint.save: rank 0 could not write the manifest "
                      f"{ckpt.path} ({error}); it still names the previous checkpoint")


def find(path: str) -> dict:
    """Rank 0: what the checkpoint file at ``path`` is: ``{"whole": True}``, a sharded save
    ``{"directory": ..., "world_size": ...}`` (the newest complete one), or ``{"error":
    ...}`` (for every rank to raise)."""
    try:
        if not checkpoint_files.is_manifest(path):
            return {"whole": True}
        directory, world_size, skipped = checkpoint_files.complete_save(path)
        if skipped:
            logging.getLogger("mpiddp").warning(
                "mpiddp.Checkpoint.restore: %s: the newest save is incomplete (%s); restoring "
                "the one before, %s", path, "; ".join(skipped), directory)
        return {"directory": directory, "world_size": world_size}
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}


def restore(ckpt, directory: str, world_size: int) -> dict:
    """Collective: load a sharded save into the model and optimizer. Every rank reads the
    parts memory-mapped, so only what its shards need (at stages 0 to 2, the whole model)
    comes from disk.

    Returns:
        The position: epoch, step, ranks, extra, and this rank's random state (None unless
        the save has as many ranks as this run).

    Raises:
        OSError: a rank cannot read the parts (on every rank).
        ValueError: the save is of another model (on every rank).
    """
    parts, error = [], None
    try:
        parts = [checkpoint_files.open_part(directory, r) for r in range(world_size)]
    except Exception as exc:           # (unreadable here: raised on every rank below)
        error = f"rank {rank()}: {exc}"
    errors = [e for e in allgather_object(error, name="mpiddp.checkpoint.open_parts") if e]
    if errors:
        raise OSError(f"mpiddp.Checkpoint.restore: every rank reads the parts of a sharded "
                      f"checkpoint (keep it on a file system all ranks share): "
                      f"{'; '.join(errors)}")
    if zero_stage_of(ckpt.optimizer):
        ckpt.optimizer.load_sharded_state_dict([part["optimizer"] for part in parts])
    else:                               # the whole state, as every rank holds it
        whole = checkpoint_files.WholeState(model=False)
        for part in parts:
            whole.add(part)
        ckpt.optimizer.load_state_dict(whole.optimizer())
    load_model(ckpt.model, ckpt.optimizer,
               [part for part in parts if not part["mpiddp_part"]["replica"]])
    first = parts[0]
    rng = parts[rank()]["rng"] if world_size == size() else None
    return {"epoch": first["epoch"], "step": first["step"], "ranks": world_size,
            "extra": first["extra"], "rng": None if rng is None else {rank(): rng}}
