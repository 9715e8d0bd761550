"""``Compression.powersgd(...)``: the settings of PowerSGD gradient compression (Vogels,
Karimireddy and Jaggi, NeurIPS 2019), checked when they are made.

The object is what ``DistributedOptimizer(compression=...)`` takes; the optimizer then reduces
its gradients with ``gradients/powersgd.py``. Each setting has the meaning of the
``PowerSGDState`` setting of torch's DDP hook it is named after (docs/powersgd.md).
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["PowerSGDCompressor"]


def _check_int(name: str, value, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ValueError(f"Compression.powersgd: {name} must be an integer >= {lowest}, "
                         f"not {value!r}")
    return int(value)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Compression.powersgd: {name} must be True or False, not {value!r}")
    return value


def _check_real(name: str, value, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (value > 0 if positive else value >= 0) or value != value \
            or value == float("inf"):
        raise ValueError(f"Compression.powersgd: {name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, not {value!r}")
    return float(value)


class PowerSGDCompressor:
    """PowerSGD low-rank compression with error feedback, for
    ``DistributedOptimizer(compression=Compression.powersgd(...))`` (docs/powersgd.md).

    Made by ``Compression.powersgd``; its attributes are the settings (read-only by
    convention). Each gradient matrix M (n x m; a tensor of more dimensions is viewed as
    ``shape[0]`` x the rest) travels as two thin factors, P = M Q (n x r) and Q = M^T P
    (m x r), one all-reduce each; the rest of the gradients are all-reduced as they are.
    Only ``DistributedOptimizer`` can use it: alone its ``compress``/``decompress`` do nothing.
    """

    def __init__(self, rank: int = 1, start_step: int = 1000, min_compression_rate: float = 2,
                 warm_start: bool = True, error_feedback: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0):
        self.rank = _check_int("rank", rank, 1)
        self.start_step = _check_int("start_step", start_step, 0)
        self.min_compression_rate = _check_real("min_compression_rate", min_compression_rate,
                                                positive=True)
        self.warm_start = _check_bool("warm_start", warm_start)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self.orthogonalization_epsilon = _check_real(
            "orthogonalization_epsilon", orthogonalization_epsilon, positive=False)
        self.seed = _check_int("seed", seed, 0)

    def settings(self) -> tuple:
        """The settings as one comparable value (every rank must use the same).

        Returns:
            ``((name, value), ...)`` for each setting, in a fixed order.
        """
        return tuple((name, getattr(self, name)) for name in (
            "rank", "start_step", "min_compression_rate", "warm_start", "error_feedback",
            "orthogonalization_epsilon", "seed"))

    def matrix_rank(self, shape: torch.Size) -> int:
        """The rank a gradient of ``shape`` is compressed to; 0 when it travels uncompressed:
        fewer than 2 dimensions, or a compressed size ``(n + m) r`` that is not at least
        ``min_compression_rate`` times smaller than ``n m`` (r = min(n, m, rank)), as torch
        decides.

        Args:
            shape: the parameter's shape.

        Returns:
            r, or 0.
        """
        if len(shape) < 2:
            return 0
        n = int(shape[0])
        m = 1
        for size in shape[1:]:
            m *= int(size)
        r = min(n, m, self.rank)
        return r if (n + m) * r * self.min_compression_rate < n * m else 0

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The uncompressed path's (identity) compression: ``DistributedOptimizer`` sends
        the factors of the compressed tensors itself.

        Args:
            tensor: a gradient that travels uncompressed.

        Returns:
            ``(tensor, None)``.
        """
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The identity (see ``compress``).

        Args:
            tensor: the reduced gradient.
            ctx: None.

        Returns:
            ``tensor``.
        """
        return tensor

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={value!r}" for name, value in self.settings())
        return f"Compression.powersgd({inner})"
