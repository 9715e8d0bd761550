"""Differentiable collectives: ``allreduce``, ``grouped_allreduce``, ``allgather``,
``broadcast``, ``alltoall`` and ``reducescatter`` take part in autograd when their input
requires a gradient (the in-place and ``_async`` forms do not, as in Horovod).

The backward passes follow Horovod's conventions, which treat the ranks' losses as one loss
averaged over the ranks (so a model's gradient does not grow with the rank count):

* allreduce: the gradient is all-reduced with the forward's op and scale factors;
* allgather: the gradient is averaged over the ranks, then this rank's rows are kept;
* broadcast: the gradient is averaged over the ranks and kept on the root (zero elsewhere);
* alltoall: the gradient travels back the way the data came;
* reducescatter: the gradient is gathered (times ``size()`` for Sum, and times the scale
  factors).

Each backward pass is itself a collective: every rank must run backward through the same
collectives in the same order, as every rank ran them forward.
"""
from __future__ import annotations

import torch

from ... import runtime
from ...reduce_ops import ReduceOp
from .async_ops import (allgather_async, allreduce_async, alltoall_async, broadcast_async,
                        grouped_allgather_async, grouped_allreduce_async,
                        grouped_reducescatter_async, reducescatter_async)
from .handles import synchronize

__all__: list[str] = []      # used through mpiddp.allreduce & co.


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        _keep_scaling(ctx, op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale,
                                           process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        return (synchronize(allreduce_async(grad.contiguous(), op=ctx.op,
                                            prescale_factor=ctx.prescale,
                                            postscale_factor=ctx.postscale,
                                            process_set=ctx.process_set)),
                None, None, None, None, None)


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        _keep_scaling(ctx, op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.prescale,
            postscale_factor=ctx.postscale, process_set=ctx.process_set))
        return (None, None, None, None, None, *reduced)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name=name, process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        averaged = synchronize(allreduce_async(grad.contiguous(), op=ReduceOp.AVERAGE,
                                               process_set=ps))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                           process_set=ps))
        offset = int(rows[:_rank_in(ps)].sum())
        return averaged.narrow(0, offset, ctx.rows), None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name=name,
                                                         process_set=process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads],
                                                       op=ReduceOp.AVERAGE, process_set=ps))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                           process_set=ps))      # one row of counts per rank
        offsets = rows[:_rank_in(ps)].sum(0)
        return (None, None, *(g.narrow(0, int(offset), n)
                              for g, offset, n in zip(averaged, offsets, ctx.rows)))


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, name, process_set):
        ctx.root, ctx.process_set = root, process_set
        return synchronize(broadcast_async(tensor, root, name=name, process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        averaged = synchronize(allreduce_async(grad.contiguous(), op=ReduceOp.AVERAGE,
                                               process_set=ctx.process_set))
        if runtime.rank() != ctx.root:          # roots are global ranks, as in Horovod
            averaged.zero_()
        return averaged, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        if splits is None:
            splits = _even_splits(tensor, process_set)
        output, received = synchronize(alltoall_async(tensor, splits=splits, name=name,
                                                      process_set=process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = synchronize(alltoall_async(grad.contiguous(), splits=ctx.received,
                                             process_set=ctx.process_set))
        return back, None, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        _keep_scaling(ctx, op, prescale, postscale, process_set)
        return synchronize(reducescatter_async(tensor, name=name, op=op,
                                               prescale_factor=prescale,
                                               postscale_factor=postscale,
                                               process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        scaled, = _scaled_for_gather(ctx, [grad])
        return (synchronize(allgather_async(scaled, process_set=ctx.process_set)),
                None, None, None, None, None)


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        _keep_scaling(ctx, op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set)))

    @staticmethod
    def backward(ctx, *grads):
        gathered = synchronize(grouped_allgather_async(_scaled_for_gather(ctx, grads),
                                                       process_set=ctx.process_set))
        return (None, None, None, None, None, *gathered)


def _keep_scaling(ctx, op, prescale, postscale, process_set) -> None:
    """What a reduction's backward needs of its forward: the op, the scale factors, the set."""
    ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
    ctx.process_set = process_set


def _scaled_for_gather(ctx, grads) -> list:
    """A reduce-scatter's output gradients, scaled as its inputs' gradients must be before
    they are gathered back: by the forward's factors, and by the set's size for Sum."""
    factor = ctx.prescale * ctx.postscale
    if ctx.op == ReduceOp.SUM:
        factor *= runtime.set_size(ctx.process_set)
    return [(g * factor if factor != 1.0 else g).contiguous() for g in grads]


def _rank_in(process_set) -> int:
    return runtime.set_rank(process_set)


def _even_splits(tensor: torch.Tensor, process_set) -> list[int]:
    size = runtime.set_size(process_set)
    rows = tensor.shape[0] if tensor.dim() else 0
    return [rows // size] * size if rows % size == 0 else None
