"""Turn a sharded checkpoint (``mpiddp.Checkpoint(..., sharded=True)``) into one whole file,
offline, without MPI (docs/checkpointing.md, "Sharded checkpoints"):

    python -m mpiddp.checkpoint_convert checkpoints/run.pt whole.pt
    python -m mpiddp.checkpoint_convert checkpoints/run.pt model.pt --model-only

The whole file is the one ``mpiddp.Checkpoint`` writes without ``sharded``: ``torch.load`` it
and give ``["model"]`` to ``model.load_state_dict`` and ``["optimizer"]`` to the plain torch
optimizer's ``load_state_dict`` (``--model-only``: the model's state dict alone, as DeepSpeed's
``zero_to_fp32.py`` writes). The parts are read one at a time, memory-mapped, into tensors
backed by a scratch file beside the output, so the process holds one piece at a time, not
the model: the output's bytes pass through the page cache, which the kernel can reclaim.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from . import checkpoint_files
from .durable import write_durably

# torch dtypes numpy lacks travel as unsigned integers of their size.
_BYTES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _Scratch:
    """Tensors backed by one file, each a memory-mapped region of it (its own storage, so
    ``torch.save`` writes each alone)."""

    def __init__(self, path: str):
        self.path, self.size = path, 0
        open(path, "wb").close()

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        if numel == 0 or itemsize not in _BYTES:
            return torch.empty(numel, dtype=dtype)
        offset = -(-self.size // 64) * 64              # (aligned for any dtype)
        self.size = offset + numel * itemsize
        array = np.memmap(self.path, dtype=_BYTES[itemsize], mode="r+", offset=offset,
                          shape=(numel,))
        return torch.from_numpy(array).view(dtype)


def source(checkpoint: str) -> tuple[str, int]:
    """(save directory, world size) of ``checkpoint``: a manifest (its newest complete save)
    or a save directory (``run.pt.parts/save-7``)."""
    if os.path.isdir(checkpoint):
        return checkpoint, checkpoint_files.open_part(checkpoint, 0)["mpiddp_part"]["world_size"]
    if not checkpoint_files.is_manifest(checkpoint):
        raise ValueError(f"{checkpoint} is a whole checkpoint already (not a sharded "
                         "checkpoint's manifest)")
    directory, world_size, skipped = checkpoint_files.complete_save(checkpoint)
    for problem in skipped:
        print(f"mpiddp.checkpoint_convert: skipped an incomplete save: {problem}",
              file=sys.stderr)
    return directory, world_size


def convert(checkpoint: str, out: str, model_only: bool = False) -> dict:
    """Write the whole checkpoint (or, ``model_only``, the model's state dict) of the sharded
    ``checkpoint`` to ``out``, durably.

    Returns:
        What it read: ``{"directory", "ranks", "epoch", "step"}``.

    Raises:
        ValueError: ``checkpoint`` is not a sharded checkpoint, or its parts are incomplete.
        OSError: a file cannot be read or written.
    """
    directory, world_size = source(checkpoint)
    scratch = _Scratch(f"{out}.scratch{os.getpid()}")
    try:
        whole = checkpoint_files.WholeState(scratch)
        for rank in range(world_size):
            whole.add(checkpoint_files.open_part(directory, rank))   # one part at a time
        state = whole.model_state() if model_only else whole.checkpoint()
        write_durably(out, lambda f: torch.save(state, f))
    finally:
        os.unlink(scratch.path)         # (its mappings live on until the tensors go)
    first = whole.first
    return {"directory": directory, "ranks": world_size, "epoch": first["epoch"],
            "step": first["step"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpiddp.checkpoint_convert",
        description="Write a sharded mpiddp checkpoint as one whole file (torch.load-able).")
    parser.add_argument("checkpoint", help="the sharded checkpoint's path (its manifest), or "
                        "one save's directory (PATH.parts/save-N)")
    parser.add_argument("out", help="the whole file to write")
    parser.add_argument("--model-only", action="store_true",
                        help="write the model's state dict alone")
    args = parser.parse_args(argv)
    try:
        done = convert(args.checkpoint, args.out, args.model_only)
    except (OSError, ValueError) as exc:
        print(f"mpiddp.checkpoint_convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {'the model' if args.model_only else 'model and optimizer'} "
          f"of {done['directory']} ({done['ranks']} rank(s); epoch {done['epoch']}, step "
          f"{done['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
