"""Sharded checkpoints on disk (docs/checkpointing.md, "Sharded checkpoints"): one file per rank
for each save, and a manifest, written last, at the checkpoint's path.

    run.pt                              the manifest (JSON): the newest complete save and the
                                        one before it
    run.pt.parts/save-7/rank-0.pt ...   each rank's part of save 7
    run.pt.parts/save-6/...             kept until the next save is complete (the fallback)

A save is complete once the manifest names it: every part is on disk before the manifest is
written, and the manifest replaces the old one atomically, so a crash during a save leaves the
previous checkpoint as it was. A part holds its rank's pieces of the state, each a range of a
tensor's elements (the model's tensors by name, the optimizer's state by parameter index), so
any rank count reads them back. Nothing here needs MPI: the offline converter uses it too.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Callable

import torch

from .durable import write_durably

FORMAT = "mpiddp-sharded-checkpoint"
VERSION = 1
SAVE_DIRECTORY = re.compile(r"^save-(\d+)$")


def parts_root(path: str) -> str:
    """The directory that holds the saves of the checkpoint at ``path``."""
    return f"{path}.parts"


def save_directory(path: str, number: int) -> str:
    return os.path.join(parts_root(path), f"save-{number}")


def part_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.pt")


def is_manifest(path: str) -> bool:
    """Whether the file at ``path`` is a sharded checkpoint's manifest (JSON), not a whole
    checkpoint (``torch.save``'s zip archive, or an older pickle)."""
    with open(path, "rb") as f:
        return f.read(1) == b"{"


def read_manifest(path: str) -> dict:
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version", 0) > VERSION:
        raise ValueError(f"{path} is not a sharded checkpoint's manifest that this mpiddp "
                         f"reads (format {manifest.get('format')!r}, version "
                         f"{manifest.get('version')!r})")
    return manifest


def saves(path: str, manifest: dict) -> list[tuple[str, int]]:
    """(directory, world size) of the saves ``manifest`` names, newest first. Directories are
    kept relative to the manifest's own, so the two move together."""
    base = os.path.dirname(os.path.abspath(path))
    return [(os.path.join(base, save["directory"]), save["world_size"])
            for save in manifest["saves"]]


def next_save(path: str) -> int:
    """A save number not used before: a crashed save's leftovers are never written into."""
    root = parts_root(path)
    names = os.listdir(root) if os.path.isdir(root) else []
    return max([0] + [int(m.group(1)) for m in map(SAVE_DIRECTORY.match, names) if m]) + 1


def write_part(directory: str, rank: int, part: dict) -> None:
    """Write one rank's part durably (on disk when this returns)."""
    os.makedirs(directory, exist_ok=True)
    write_durably(part_file(directory, rank), lambda f: torch.save(part, f))


def write_manifest(path: str, directory: str, world_size: int, position: dict) -> None:
    """Make the save in ``directory`` (every part on disk) the checkpoint at ``path``, keeping
    the previous complete save as the fallback; then remove the saves named by neither."""
    previous = []
    if os.path.exists(path) and is_manifest(path):
        try:
            previous = read_manifest(path)["saves"][:1]
        except (OSError, ValueError):
            previous = []       # (unreadable: nothing to fall back on)
    base = os.path.dirname(os.path.abspath(path))
    entry = {"directory": os.path.relpath(directory, base), "world_size": world_size}
    manifest = {"format": FORMAT, "version": VERSION, **position,
                "saves": [entry] + [save for save in previous if save != entry]}
    write_durably(path, (json.dumps(manifest, indent=1) + "\n").encode())
    prune(path, manifest)


def prune(path: str, manifest: dict) -> None:
    """Remove the save directories of ``path`` that ``manifest`` does not name: older saves and
    crashed ones (best effort: a leftover costs disk space only)."""
    root = parts_root(path)
    keep = {os.path.abspath(directory) for directory, _ in saves(path, manifest)}
    for name in (os.listdir(root) if os.path.isdir(root) else []):
        full = os.path.abspath(os.path.join(root, name))
        if SAVE_DIRECTORY.match(name) and full not in keep:
            shutil.rmtree(full, ignore_errors=True)


def remove_parts(path: str) -> None:
    """A whole checkpoint replaced the manifest: its saves are no one's."""
    if os.path.isdir(parts_root(path)):
        shutil.rmtree(parts_root(path), ignore_errors=True)


def open_part(directory: str, rank: int) -> dict:
    """Rank ``rank``'s part, memory-mapped: its tensors are read from disk only where used.

    Raises:
        OSError, RuntimeError: the file is missing or not a torch file.
        ValueError: it is not rank ``rank``'s part of a sharded checkpoint.
    """
    file = part_file(directory, rank)
    part = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
    head = part.get("mpiddp_part") if isinstance(part, dict) else None
    if head is None or head["rank"] != rank or head["version"] > VERSION:
        raise ValueError(f"{file} is not rank {rank}'s part of a sharded checkpoint")
    return part


def complete_save(path: str) -> tuple[str, int, list]:
    """The newest save the manifest at ``path`` names whose every part opens:
    (directory, world size, what was wrong with the newer ones).

    Raises:
        ValueError: none does (each save's problem named).
    """
    problems = []
    for directory, world_size in saves(path, read_manifest(path)):
        try:
            for rank in range(world_size):
                if open_part(directory, rank)["mpiddp_part"]["world_size"] != world_size:
                    raise ValueError(f"rank {rank}'s part is of another save")
            return directory, world_size, problems
        except Exception as exc:        # (any unreadable part: try the save before)
            problems.append(f"{directory}: {exc}")
    raise ValueError(f"the sharded checkpoint {path} names no complete save: "
                     + "; ".join(problems))


def copy_overlap(dest: torch.Tensor, dest_start: int, entries) -> int:
    """Copy into ``dest`` (a flat tensor: a tensor's elements from ``dest_start`` on) what the
    ``entries`` ((start, stop, flat values): ranges of the same tensor's elements) hold of it.

    Returns:
        The elements copied.
    """
    covered, dest_stop = 0, dest_start + dest.numel()
    for start, stop, values in entries:
        lo, hi = max(start, dest_start), min(stop, dest_stop)
        if lo < hi:
            dest[lo - dest_start:hi - dest_start].copy_(values[lo - start:hi - start])
            covered += hi - lo
    return covered


def _elementwise(value, start: int, stop: int) -> bool:
    """A piece's state value that holds one element per parameter element (as
    ``sharding.state._copy_piece`` tells them): the others (``step``) are per parameter."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == stop - start


class WholeState:
    """The whole model and optimizer state, put together from a save's parts fed one at a
    time (rank 0's first), into tensors that ``allocate(numel, dtype)`` makes: the result's
    memory, plus one part's pieces in flight (the parts are memory-mapped)."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                 model: bool = True):
        self.allocate = allocate or (lambda numel, dtype: torch.empty(numel, dtype=dtype))
        self.with_model = model
        self.first: dict | None = None
        self.world_size = 0
        self.rng: dict = {}
        self.model: dict = {}           # name -> flat tensor
        self.state: dict = {}           # parameter index -> {key: flat tensor or value}
        self.shapes: dict = {}          # parameter index -> shape
        self.covered: dict = {}         # (name,) or (index, key) -> elements copied

    def add(self, part: dict) -> None:
        head = part["mpiddp_part"]
        if self.first is None:
            if head["rank"] != 0:
                raise ValueError("WholeState: feed rank 0's part first")
            self.first, self.world_size = part, head["world_size"]
        self.rng[head["rank"]] = part.get("rng")
        if head.get("replica"):
            return                  # (hybrid: another node's copy of the same pieces)
        if self.with_model:
            for name, entries in part["model"].items():
                shape, dtype = self.first["tensors"][name]
                if name not in self.model:
                    self.model[name] = self.allocate(math.prod(shape), dtype)
                self.covered[(name,)] = self.covered.get((name,), 0) + \
                    copy_overlap(self.model[name], 0, entries)
        optimizer = part["optimizer"]
        for index, start, stop, shape in optimizer["zero_sharded"]["pieces"]:
            values = optimizer["state"].get(index)
            if not values:
                continue
            self.shapes[index] = tuple(shape)
            whole = self.state.setdefault(index, {})
            for key, value in values.items():
                if _elementwise(value, start, stop):
                    if key not in whole:
                        whole[key] = self.allocate(math.prod(shape), value.dtype)
                    whole[key][start:stop].copy_(value)
                    self.covered[(index, key)] = self.covered.get((index, key), 0) + \
                        stop - start
                elif key not in whole:
                    whole[key] = value.clone() if torch.is_tensor(value) else value

    def _check(self) -> None:
        if self.first is None or len(self.rng) != self.world_size:
            raise ValueError(f"WholeState: got the parts of ranks {sorted(self.rng)} of "
                             f"{self.world_size}")
        for what, count in self.covered.items():
            numel = math.prod(self.first["tensors"][what[0]][0]) if len(what) == 1 \
                else math.prod(self.shapes[what[0]])
            if count != numel:
                raise ValueError(f"the parts hold {count} of the {numel} elements of "
                                 f"{'tensor' if len(what) == 1 else 'optimizer state'} "
                                 f"{what}")

    def optimizer(self) -> dict:
        """The optimizer's whole state: its wrapped class's own ``state_dict()`` format."""
        self._check()
        state = {index: {key: value.view(self.shapes[index]) if (index, key) in self.covered
                         else value for key, value in values.items()}
                 for index, values in self.state.items()}
        return {"state": state, "param_groups": self.first["optimizer"]["param_groups"]}

    def model_state(self) -> dict:
        """The model's ``state_dict()`` (tied parameters: one tensor under each key)."""
        self._check()
        missing = sorted(set(self.first["tensors"]) - set(self.model))
        if missing:
            raise ValueError(f"the parts hold nothing of the model's {missing[:3]}")
        tensors = self.first["tensors"]
        return {key: self.model[name].view(tensors[name][0])
                for key, name in self.first["model_keys"].items()}

    def checkpoint(self) -> dict:
        """What ``mpiddp.Checkpoint`` writes as one whole file."""
        first = self.first
        return {"epoch": first["epoch"], "step": first["step"], "ranks": self.world_size,
                "extra": first["extra"],
                "rng": [self.rng[r] for r in range(self.world_size)] if first["step"]
                else None,
                "model": self.model_state(), "optimizer": self.optimizer()}
