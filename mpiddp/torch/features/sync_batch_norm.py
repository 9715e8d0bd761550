"""Batch normalization with the batch statistics of every rank (Horovod's ``SyncBatchNorm``).

In training, each rank's per-channel sums, sums of squares and element counts are added up with
one differentiable all-reduce, so the mean and variance are those of the global batch and the
gradient flows back through them to every rank's input; the output equals what
``BatchNorm`` gives on the concatenation of the ranks' batches. In evaluation (or without
running statistics) it is plain batch normalization.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ...reduce_ops import ReduceOp
from ...runtime import ProcessSet
from ..ops.collectives import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics cover every rank's batch.

    A collective in training mode: every rank (of ``process_set``) must run it for the same
    layers in the same order, with the same number of channels.

    Args:
        num_features: channels (``C`` of an ``(N, C, ...)`` input).
        eps: added to the variance for numerical stability. Default 1e-5.
        momentum: running-statistics update factor; None: cumulative average. Default 0.1.
        affine: learn a per-channel scale and shift. Default True.
        track_running_stats: keep running mean and variance (used in eval mode).
            Default True.
        process_set: synchronize over this ``ProcessSet``'s ranks only; default None: every
            rank.

    Raises:
        ValueError: (at forward) an input with fewer than 2 dimensions.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Optional[ProcessSet] = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an (N, C, ...) input, got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the global batch statistics (training) or the running
        ones (evaluation).

        Args:
            input: an ``(N, C, ...)`` tensor; ``N`` may differ across ranks.

        Returns:
            The normalized tensor, the shape of ``input``.

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions.
        """
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        # Statistics in float32 at least (half-precision sums of squares overflow).
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           x.new_tensor([x.numel() / max(channels, 1)])])
        total = allreduce(local, op=ReduceOp.SUM, process_set=self.process_set)
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(count.detach()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor,
                              count: float) -> None:
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = var * (count / max(count - 1.0, 1.0))
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                    alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                   alpha=factor)
