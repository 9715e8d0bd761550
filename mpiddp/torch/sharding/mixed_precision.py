"""Mixed precision at stage 3 (``DistributedOptimizer(zero_stage=3, mixed_precision=...)``):
FSDP2's ``MixedPrecisionPolicy``. The shards stay in the parameters' own dtype (float32: the
masters the optimizer steps); the full parameters each gather fills are ``param_dtype`` (the
gather sends a ``param_dtype`` copy of the chunk: half float32's bytes for bfloat16), so
forward and backward compute in it; the gradients travel in ``reduce_dtype`` and land as the
masters' gradients in their dtype. See docs/sharding.md and docs/dev/zero3.md."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..compression import Compression

__all__ = ["MixedPrecisionPolicy"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What ``DistributedOptimizer(zero_stage=3, mixed_precision=...)`` computes and reduces
    in (FSDP2's ``MixedPrecisionPolicy``, same names and defaults).

    Args:
        param_dtype: the dtype of the gathered parameters, so of forward and backward (e.g.
            ``torch.bfloat16``); the shards the optimizer steps keep the parameters' own
            dtype. None: the parameters' dtype (no cast).
        reduce_dtype: the dtype gradients are reduce-scattered in; the reduced shard is
            cast to the shards' dtype. None: ``param_dtype``.
        cast_forward_inputs: cast the floating-point tensors among the model's forward
            arguments to ``param_dtype`` (default True).

    Raises:
        ValueError: a dtype that is not a floating-point dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATING:
                raise ValueError(f"MixedPrecisionPolicy({field}={value!r}): a floating-point "
                                 "dtype (torch.bfloat16, torch.float16, torch.float32) or "
                                 "None")


def check_policy(policy, zero_stage: int, compression) -> Optional[MixedPrecisionPolicy]:
    """``DistributedOptimizer``'s checks of ``mixed_precision`` (None: none given)."""
    if policy is None:
        return None
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError("mixed_precision must be an mpiddp.MixedPrecisionPolicy, not "
                        f"{type(policy).__name__}")
    if zero_stage != 3:
        raise ValueError(
            "DistributedOptimizer(mixed_precision=...) needs zero_stage=3: it casts the "
            "parameters each gather fills, and stages 0-2 keep full parameters of their own. "
            "At stages 0-2 use torch.autocast for the compute and compression=Compression.bf16 "
            "(or .fp16) for the gradients' reduction")
    if compression is not Compression.none:
        raise ValueError("DistributedOptimizer(mixed_precision=...) takes the gradients' "
                         "dtype from its reduce_dtype: leave compression at Compression.none")
    return policy


def cast_inputs_hook(dtype: torch.dtype):
    """A forward pre-hook (with kwargs) casting the floating-point tensors among the
    arguments to ``dtype``."""
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                value.dtype != dtype:
            return value.to(dtype)
        return value

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)
    return hook
