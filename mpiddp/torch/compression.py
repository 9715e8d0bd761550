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

import torch


class Compressor(ABC):
    """Interface of a gradient compressor (used as a class: its methods are static)."""

    @staticmethod
    @abstractmethod
    def compress(tensor: torch.Tensor):
        """Return ``(compressed tensor, context)``; the context goes to ``decompress``."""

    @staticmethod
    @abstractmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """Return the tensor in its original form, given the reduced compressed tensor."""


class NoneCompressor(Compressor):
    """No compression: the gradient is reduced as it is (in place)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Reduce floating-point tensors as float16 and cast the result back."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Reduce floating-point tensors as bfloat16 and cast the result back."""

    wire_dtype = torch.bfloat16


class Compression:
    """The built-in compressors: ``Compression.none``, ``.fp16`` and ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
