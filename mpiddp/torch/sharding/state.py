"""The sharded optimizer's state in its three forms (see ``ShardedOptimizer``): the helpers
that cut a whole state into this rank's shards and put pieces of saved states together."""
from __future__ import annotations

import math

import torch

# Per-parameter scalar state that a zero-dimensional parameter's elementwise state cannot be
# told apart from by its shape.
_SCALAR_KEYS = {"step", "eta", "mu", "mu_product"}


def _indices(sync) -> tuple[dict, list]:
    params = [p for group in sync.full_groups for p in group]
    return {p: i for i, p in enumerate(params)}, params


def _groups(optimizer, sync) -> list:
    groups, start = [], 0
    for group, full in zip(optimizer.param_groups, sync.full_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(full)))})
        start += len(full)
    return groups


def _copy_piece(values: dict, piece_values: dict, start: int, stop: int, lo: int, hi: int,
                base: int, length: int) -> list:
    """Copy elements ``lo:hi`` of a parameter from the state of a piece holding its elements
    ``start:stop`` into ``values``, whose elementwise tensors hold its elements from ``base``
    on (``length`` of them: made at the first piece). Per-parameter values (``step``) are
    taken from the first piece. Returns the keys of the elementwise tensors made."""
    made = []
    for key, value in piece_values.items():
        # Elementwise: a slice of the whole tensor's (one element per parameter element).
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == stop - start:
            if key not in values:
                values[key] = torch.empty(length, dtype=value.dtype)
                made.append(key)
            values[key][lo - base:hi - base] = value[lo - start:hi - start]
        else:
            values.setdefault(key, value)
    return made


def _as_param_state(values: dict, shard) -> dict:
    """As torch's ``load_state_dict`` does: floating state in the parameter's dtype (not
    ``step``), everything on its device."""
    result = {}
    for key, value in values.items():
        if torch.is_tensor(value):
            if key != "step" and value.is_floating_point():
                value = value.to(dtype=shard.dtype, device=shard.device)
            elif key != "step":
                value = value.to(device=shard.device)
            value = value.clone()
        result[key] = value
    return result


def _set_hyperparameters(optimizer, groups: list) -> None:
    _check_group_sizes(optimizer, groups)
    for group, saved in zip(optimizer.param_groups, groups):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = value


def _check_group_sizes(optimizer, groups: list) -> None:
    sync = optimizer._mpiddp
    sizes = [len(full) for full in sync.full_groups]
    theirs = [len(group["params"]) for group in groups]
    if sizes != theirs:
        raise ValueError(f"the state dict belongs to another model: its param groups hold "
                         f"{theirs} parameters, this optimizer's {sizes}")


def _params_of(optimizer, state_dict: dict, shape_of=lambda value: value.shape
               if torch.is_tensor(value) else None) -> dict:
    """Check that a whole state fits this optimizer (group sizes, every state tensor the
    shape of its parameter, or a scalar) and map its parameter indices to the parameters.
    ``shape_of`` reads a value's shape (None: not a tensor)."""
    sync = optimizer._mpiddp
    _check_group_sizes(optimizer, state_dict["param_groups"])
    _, params = _indices(sync)
    order = [i for group in state_dict["param_groups"] for i in group["params"]]
    param_of = {saved: params[mine] for mine, saved in enumerate(order)}
    names = optimizer.__dict__.get("_parameter_names", {})
    for saved_index, values in state_dict["state"].items():
        if saved_index not in param_of:
            raise ValueError(f"load_state_dict: the state names parameter {saved_index!r}, "
                             f"which no param group holds: a state dict of another model")
        param = param_of[saved_index]
        for key, value in values.items():
            shape = shape_of(value)
            if shape is not None and len(shape) > 0 and tuple(shape) != tuple(param.shape):
                raise ValueError(
                    f"load_state_dict: state '{key}' of parameter "
                    f"'{names.get(param, order.index(saved_index))}' has shape {list(shape)}"
                    f", the parameter {list(param.shape)}: a state dict of another model")
    return param_of


def _shard_states(sync, param, values: dict) -> dict:
    """This rank's shards' states, cut from ``param``'s whole state ``values``."""
    result = {}
    bucket = sync.layout.bucket_of.get(param)
    for piece in (bucket.pieces if bucket is not None else []):
        if piece.param is not param:
            continue
        sliced = {}
        for key, value in values.items():
            elementwise = torch.is_tensor(value) and value.shape == param.shape and \
                not (param.dim() == 0 and key in _SCALAR_KEYS)
            sliced[key] = value.reshape(-1)[piece.start:piece.stop] if elementwise \
                else value
        result[piece.shard] = _as_param_state(sliced, piece.shard)
    return result


def _load_full(optimizer, state_dict: dict) -> None:
    """Every rank keeps its shards' slices of a whole state (see ``load_state_dict``)."""
    sync = optimizer._mpiddp
    param_of = _params_of(optimizer, state_dict)
    new_state: dict = {}
    for saved_index, values in state_dict["state"].items():
        new_state.update(_shard_states(sync, param_of[saved_index], values))
    _set_hyperparameters(optimizer, state_dict["param_groups"])
    optimizer.state.clear()
    optimizer.state.update(new_state)


# Tensors of a whole state in flight at once in ``broadcast_whole_state``: what each rank
# holds beyond its shards while the state is handed out.
BROADCAST_CHUNK_BYTES = 64 << 20


def broadcast_whole_state(optimizer, state_dict: dict | None, root_rank: int, name: str,
                          process_set=None) -> None:
    """Collective: ``root_rank``'s whole state (a plain torch optimizer's ``state_dict()``
    format, e.g. from a checkpoint file) reaches every rank, which keeps its shards' slices,
    as if each had called ``load_state_dict`` with it. The tensors travel as broadcasts of at
    most about ``BROADCAST_CHUNK_BYTES`` at a time, so no rank but the root holds the whole
    state. A state of another model raises ``ValueError`` on every rank alike, before any
    tensor moves. ``state_dict`` is ignored on the other ranks."""
    from ..ops.async_ops import broadcast_async_
    from ..ops.functions import _fill, _skeleton, _TensorSlot, broadcast_object
    from ..ops.handles import synchronize
    from ... import runtime

    sync = optimizer._mpiddp
    is_root = runtime.rank() == root_rank
    tensors: list = []
    skeleton = None
    if is_root:
        skeleton = {"state": {k: _skeleton(v, tensors) for k, v in state_dict["state"].items()},
                    "param_groups": state_dict["param_groups"],
                    "sharded": "zero_sharded" in state_dict}
    skeleton = broadcast_object(skeleton, root_rank, name=f"{name}.skeleton",
                                process_set=process_set)
    if skeleton["sharded"]:             # raised on every rank alike, as what follows
        raise ValueError("the optimizer state is one rank's part of a sharded state (from "
                         "sharded_state_dict()): load every rank's part with "
                         "load_sharded_state_dict([...])")
    param_of = _params_of(optimizer, skeleton, lambda value: value.shape
                          if isinstance(value, _TensorSlot) else None)
    # The optimizer's own load (what it completes first, the hyperparameters), of no state
    # yet: the shards' states follow, a chunk at a time.
    optimizer.load_state_dict({"state": {}, "param_groups": skeleton["param_groups"]})

    def receive(chunk: list) -> None:
        got = {}
        for _, param_slots in chunk:
            for _, slot in param_slots:
                got[slot.index] = tensors[slot.index] if is_root else \
                    torch.empty(slot.shape, dtype=slot.dtype)
        handles = [broadcast_async_(got[index], root_rank, name=f"{name}.t{index}",
                                    process_set=process_set) for index in sorted(got)]
        for handle in handles:
            synchronize(handle)
        for saved_index, _ in chunk:
            values = _fill(skeleton["state"][saved_index], [], lambda slot: got[slot.index])
            new_state.update(_shard_states(sync, param_of[saved_index], values))

    new_state: dict = {}
    chunk, chunk_bytes = [], 0
    for saved_index, values in skeleton["state"].items():
        param_slots: list = []
        _fill(values, param_slots, lambda slot: slot)      # (index, slot) of each tensor
        chunk.append((saved_index, param_slots))
        chunk_bytes += sum(math.prod(slot.shape) * slot.dtype.itemsize
                           for _, slot in param_slots)
        if chunk_bytes >= BROADCAST_CHUNK_BYTES:
            receive(chunk)
            chunk, chunk_bytes = [], 0
    if chunk:
        receive(chunk)
    optimizer.state.update(new_state)
