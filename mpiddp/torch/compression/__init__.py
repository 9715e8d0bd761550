"""Gradient compression: reduce gradients in a narrower dtype and restore the original after.

``Compression.none`` reduces gradients as they are; ``Compression.fp16`` and
``Compression.bf16`` cast floating-point gradients to float16 / bfloat16 before the
all-reduce (half the bytes on the wire) and cast the result back to the gradient's dtype.
Non-floating-point tensors pass through unchanged.

float16 has a narrow range (largest value 65504): with many ranks, sums of large gradients can
overflow. ``DistributedOptimizer(gradient_predivide_factor=...)`` divides before the sum and
multiplies after it to keep the partial sums in range. bfloat16 has float32's range but only
8 bits of mantissa.

A custom compressor is any object with the two static methods below (Horovod's interface):
``compress(tensor) -> (compressed, ctx)`` and ``decompress(compressed, ctx) -> tensor``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from .powersgd_settings import PowerSGDCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
           "PowerSGDCompressor"]
# WireCasts: framework glue (DistributedOptimizer), not public API.


class Compressor(ABC):
    """Interface of a gradient compressor (used as a class: its methods are static).

    Subclass it, or pass any object with the same two methods, as
    ``DistributedOptimizer(compression=...)``. The compressed tensor is all-reduced in place,
    so it must have a dtype mpiddp reduces and the same shape on every rank.
    """

    @staticmethod
    @abstractmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Prepare a gradient for the all-reduce.

        Args:
            tensor: the gradient (dense).

        Returns:
            ``(compressed tensor, context)``; the context goes to ``decompress``. The
            compressed tensor may be ``tensor`` itself, in which case the gradient is
            reduced in place.
        """

    @staticmethod
    @abstractmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Restore a reduced tensor to the gradient's form.

        Args:
            tensor: the compressed tensor, after the all-reduce.
            ctx: what ``compress`` returned with it.

        Returns:
            The reduced gradient, in the gradient's original form.
        """


class NoneCompressor(Compressor):
    """No compression: the gradient is reduced as it is (in place)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Return the gradient unchanged.

        Args:
            tensor: the gradient.

        Returns:
            ``(tensor, None)``.
        """
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        """Return the reduced gradient unchanged.

        Args:
            tensor: the reduced gradient.
            ctx: None (from ``compress``).

        Returns:
            ``tensor``.
        """
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        """Cast a floating-point gradient of another dtype to the wire dtype (a new
        tensor); other tensors pass through unchanged.

        Args:
            tensor: the gradient.

        Returns:
            ``(cast tensor, original dtype)``, or ``(tensor, None)`` when nothing was cast.
        """
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        """Cast the reduced tensor back to the gradient's dtype.

        Args:
            tensor: the reduced tensor.
            ctx: the original dtype from ``compress``, or None (nothing to undo).

        Returns:
            The tensor in the original dtype (``tensor`` itself when ``ctx`` is None).
        """
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Reduce floating-point tensors as float16 and cast the result back."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Reduce floating-point tensors as bfloat16 and cast the result back."""

    wire_dtype = torch.bfloat16


class Compression:
    """The built-in compressors, for ``DistributedOptimizer(compression=...)``.

    Attributes:
        none: ``NoneCompressor``: gradients are reduced as they are (the default).
        fp16: ``FP16Compressor``: floating-point gradients are reduced as float16 (half the
            bytes of float32; range up to 65504, see ``gradient_predivide_factor``).
        bf16: ``BF16Compressor``: floating-point gradients are reduced as bfloat16
            (float32's range, 8 bits of mantissa).

    ``Compression.powersgd(rank=...)`` (a function: it takes settings) sends each gradient
    matrix as two low-rank factors with error feedback (``DistributedOptimizer`` only).
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def powersgd(rank: int = 1, start_step: int = 1000, min_compression_rate: float = 2,
                 warm_start: bool = True, error_feedback: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0) -> PowerSGDCompressor:
        """PowerSGD: each gradient matrix travels as two rank-``rank`` factors, with error
        feedback (docs/powersgd.md). For ``DistributedOptimizer`` only; the names follow
        torch's ``PowerSGDState``.

        Args:
            rank: the approximation's rank (torch's ``matrix_approximation_rank``), >= 1.
            start_step: steps of plain averaging before PowerSGD starts (torch's
                ``start_powerSGD_iter``); 0 compresses from the first step.
            min_compression_rate: a matrix n x m is compressed only where
                ``(n + m) * rank * min_compression_rate < n * m``; others (and 1-D tensors)
                are averaged uncompressed.
            warm_start: start each step's power iteration from the last step's Q.
            error_feedback: add what the last step's approximation missed to the gradient.
            orthogonalization_epsilon: added to each column's norm in the
                orthogonalization (e.g. 1e-8); 0 divides by the norm itself.
            seed: seeds the initial Q (the same on every rank).

        Returns:
            The settings, for ``DistributedOptimizer(compression=...)``.

        Raises:
            ValueError: a setting of the wrong type or out of range (e.g. ``rank=0``).
        """
        return PowerSGDCompressor(rank, start_step, min_compression_rate, warm_start,
                                  error_feedback, orthogonalization_epsilon, seed)


class WireCasts:
    """For the built-in casts (``Compression.fp16``/``.bf16``): each gradient cast into a wire
    tensor of its own, reused from step to step (a fresh cast per step would allocate and
    page-fault its memory every time). Other compressors keep their own ``compress``."""

    def __init__(self, compression):
        builtin = compression in (Compression.fp16, Compression.bf16)
        self.wire_dtype = compression.wire_dtype if builtin else None
        self.buffers: dict = {}     # key (the parameter) -> its wire tensor

    def casts(self, dtype: torch.dtype) -> bool:
        """Whether gradients of ``dtype`` travel cast to ``wire_dtype``."""
        return self.wire_dtype is not None and dtype.is_floating_point \
            and dtype != self.wire_dtype

    def cast(self, key, grad: torch.Tensor):
        """``grad`` cast into ``key``'s wire tensor, or None where no reused cast applies
        (other compressors, and gradients that are not cast)."""
        if not self.casts(grad.dtype):
            return None
        wire = self.buffers.get(key)
        if wire is None or wire.shape != grad.shape or wire.device != grad.device:
            wire = self.buffers[key] = torch.empty(grad.shape, dtype=self.wire_dtype,
                                                   device=grad.device)
        wire.copy_(grad)
        return wire
