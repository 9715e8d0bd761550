"""What one rank's part of a sharded checkpoint holds of the model, and loading every part back
into a model at any stage and rank count (``mpiddp.Checkpoint(..., sharded=True)``; the
format: ``mpiddp/checkpoint_files.py``).

The model's tensors go by name, as ``model.state_dict()`` names them (a tied parameter under
its first name), each as ranges of its elements: ``{name: [(start, stop, flat values)]}``.
A rank writes the elements of its shards of the parameters the optimizer lays out (stage 3:
the frozen ones too); the first rank writes the rest (buffers, parameters kept whole) whole.
"""
from __future__ import annotations

import contextlib

import torch

from ..core.sharded_registry import zero_stage_of
from .model_state import _frozen_pieces_here
from .state import _indices
from ...checkpoint_files import copy_overlap


def state_tensors(model: torch.nn.Module) -> tuple[dict, dict]:
    """The model's state-dict entries, found without gathering anything (stage 3):
    (key -> name, name -> tensor), where a tensor's name is its first key."""
    keys, tensors, first = {}, {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        entries = [(n, t) for n, t in module._parameters.items() if t is not None] + \
            [(n, t) for n, t in module._buffers.items()
             if t is not None and n not in module._non_persistent_buffers_set]
        for short, tensor in entries:
            name = first.setdefault(id(tensor), prefix + short)
            keys[prefix + short] = name
            tensors.setdefault(name, tensor)
    return keys, tensors


def _buckets(sync) -> list:
    """The optimizer's buckets (stage 3: the frozen ones too)."""
    return sync.gathers.all_buckets() if sync.zero_stage == 3 else sync.layout.buckets


def model_part(model: torch.nn.Module, optimizer, sharded: dict, first: bool) -> dict:
    """This rank's part of the model: ``{name: [(start, stop, flat copy)]}``.

    Args:
        sharded: this rank's ``optimizer.sharded_state_dict()``; at stage 3 its copies of
            the model's pieces are taken out of it (they go by name here) and used.
        first: the first rank, which also writes whole what no bucket holds.
    """
    keys, tensors = state_tensors(model)
    name_of = {id(tensor): name for name, tensor in tensors.items()}
    sync = optimizer.__dict__.get("_mpiddp") if zero_stage_of(optimizer) else None
    part: dict = {}
    held = set() if sync is None else \
        {id(param) for bucket in _buckets(sync) for param in bucket.params}
    replica = sync is not None and sync.layout.grid.replica
    if sync is not None and not replica:
        _, params = _indices(sync)
        if "parameters" in sharded:         # stage 3: its copies, by parameter index
            values = sharded["parameters"]
            for index, start, stop, _ in sharded["zero_sharded"]["pieces"]:
                name = name_of.get(id(params[index]))
                if name is not None and index in values:
                    part.setdefault(name, []).append((start, stop, values[index]))
            for name, piece in sharded["frozen"].items():
                if name in tensors:
                    part.setdefault(name, []).append(piece)
        else:                               # stages 1 and 2: the shards view the parameters
            for piece in sync.layout.pieces():
                name = name_of.get(id(piece.param))
                if name is not None:
                    part.setdefault(name, []).append(
                        (piece.start, piece.stop, piece.shard.detach().to("cpu", copy=True)))
    for key in ("parameters", "frozen", "whole"):
        sharded.pop(key, None)
    if first:
        for name, tensor in tensors.items():
            if id(tensor) not in held:
                part[name] = [(0, tensor.numel(),
                               tensor.detach().to("cpu", copy=True).reshape(-1))]
    return part


def describe(model: torch.nn.Module) -> dict:
    """What the first rank's part says of the model: its keys and its tensors' shapes."""
    keys, tensors = state_tensors(model)
    return {"model_keys": keys,
            "tensors": {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}}


def load_model(model: torch.nn.Module, optimizer, parts: list) -> None:
    """Copy every tensor of ``model`` from the parts of one save (any stage, any rank count;
    rank 0's first, other nodes' copies of a hybrid save left out): at stage 3 only this
    rank's chunks, otherwise the whole tensors.

    Raises:
        ValueError: the save is of another model (other keys or shapes), before anything
            changes; or the parts do not hold every element.
    """
    keys, tensors = state_tensors(model)
    saved_keys, saved_tensors = parts[0]["model_keys"], parts[0]["tensors"]
    missing, unexpected = sorted(set(keys) - set(saved_keys)), \
        sorted(set(saved_keys) - set(keys))
    wrong = sorted(key for key in set(keys) & set(saved_keys)
                   if tuple(tensors[keys[key]].shape) != tuple(saved_tensors[saved_keys[key]][0]))
    if missing or unexpected or wrong:
        raise ValueError(f"the sharded checkpoint is of another model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {wrong[:3]}")
    saved_name = {keys[key]: saved_keys[key] for key in keys}
    sync = optimizer.__dict__.get("_mpiddp") if zero_stage_of(optimizer) == 3 else None
    targets = _targets(model, tensors, sync)
    by_name: dict = {}
    for i, target in enumerate(targets):
        by_name.setdefault(saved_name[target[0]], []).append(i)
    covered = [0] * len(targets)
    with _loading(sync):
        for part in parts:
            for name, entries in part["model"].items():
                for i in by_name.get(name, ()):
                    covered[i] += copy_overlap(targets[i][1], targets[i][2], entries)
        for (name, dest, start, tensor), count in zip(targets, covered):
            if count != dest.numel():
                raise ValueError(f"the sharded checkpoint does not hold every element of "
                                 f"'{name}' ({start} to {start + dest.numel()})")
            if tensor is not None:          # (not contiguous: filled through a copy)
                tensor.copy_(dest.view(tensor.shape))


def _targets(model, tensors: dict, sync) -> list:
    """(name, flat destination, first element, tensor to copy it into or None) of every
    range of elements this rank holds."""
    targets = []
    held = set()
    if sync is not None:                    # stage 3: this rank's chunks
        name_of = {id(tensor): name for name, tensor in tensors.items()}
        for piece in sync.layout.pieces():
            if id(piece.param) in name_of:
                targets.append((name_of[id(piece.param)], piece.shard, piece.start, None))
        for name, piece in _frozen_pieces_here(sync.gathers, model):
            targets.append((name, piece.shard, piece.start, None))
        held = {id(param) for bucket in _buckets(sync) for param in bucket.params}
    for name, tensor in tensors.items():
        if id(tensor) in held:
            continue
        if tensor.is_contiguous():
            targets.append((name, tensor.detach().view(-1), 0, None))
        else:
            targets.append((name, torch.empty(tensor.numel(), dtype=tensor.dtype), 0,
                            tensor.detach()))
    return targets


@contextlib.contextmanager
def _loading(sync):
    """Stage 3: the gathered buckets are released first (their full parameters would be
    stale), and the guard lets our copies pass; otherwise just no autograd."""
    if sync is None:
        with torch.no_grad():
            yield
        return
    gathers = sync.gathers
    with torch.no_grad(), gathers.lock, gathers.internal():
        for bucket in gathers.all_buckets():
            gathers.release(bucket)
        yield
    gathers.forget_consolidated()

