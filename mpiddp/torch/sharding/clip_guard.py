"""``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``) fail loudly on the parameters
of a sharded optimizer, where each rank holds only its shard of the averaged gradient."""
from __future__ import annotations

import torch

from ..gradients.sync import OWNER_ATTR
from .layout import SHARD_ATTR
from .sync import ShardedSync

_guard_installed = False


def install_clip_guard() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``) raise on parameters
    of a sharded optimizer: each rank holds only its shard of the averaged gradient there, so
    the norm would be this rank's alone, silently wrong."""
    global _guard_installed
    if _guard_installed:
        return
    _guard_installed = True
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    for name, advice in (("clip_grad_norm_", "optimizer.clip_grad_norm_(max_norm)"),
                         ("clip_grad_value_", "torch.nn.utils.clip_grad_value_ on the "
                          "optimizer's param groups (its shards)")):
        original = getattr(clip_grad, name)
        guarded = _guarded(original, name, advice, shards_too=name == "clip_grad_norm_")
        setattr(clip_grad, name, guarded)
        setattr(utils, name, guarded)


def _guarded(original, name: str, advice: str, shards_too: bool):
    def guarded(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        for param in parameters:
            stage = _sharded_stage(param, shards_too)
            if stage:
                raise RuntimeError(
                    f"torch.nn.utils.{name} on parameters of a DistributedOptimizer("
                    f"zero_stage={stage}): each rank holds only its shard of the averaged "
                    f"gradients, so the result would be silently wrong. Use {advice} instead.")
        return original(parameters, *args, **kwargs)
    guarded.__wrapped__ = original
    guarded.__doc__ = original.__doc__
    guarded.__name__ = name
    return guarded


def _sharded_stage(param, shards_too: bool) -> int:
    owner = getattr(param, OWNER_ATTR, None)
    sync = owner() if owner is not None else None
    if isinstance(sync, ShardedSync):
        return sync.zero_stage
    if shards_too:
        owner = getattr(param, SHARD_ATTR, None)
        sync = owner() if owner is not None else None
        if isinstance(sync, ShardedSync):
            return sync.zero_stage
    return 0
