"""Stage 3's first building block, in one process: buckets that own their parameters' memory
(``Bucket.own_storage``, ``release``, ``materialise``), and pins on the torch behaviour the
stage-3 design rests on (docs/dev/zero3.md), so that a torch upgrade that changes it fails
here, by name, rather than as wrong numbers or a crash in a training run."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpiddp.collectives.shard_grid import ShardGrid
from mpiddp.torch.sharding.layout import ShardLayout


def laid_out(model, rank=0, size=2, cap_bytes=1 << 30):
    layout = ShardLayout(ShardGrid.flat(rank, size), cap_bytes, lambda p: p.dtype)
    layout.add(list(model.parameters()))
    return layout


def model_and_copy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    plain.load_state_dict(model.state_dict())
    return model, plain


@pytest.mark.parametrize("rank", [0, 1])
def test_a_bucket_owns_the_parameters_and_this_ranks_chunk(rank):
    model, plain = model_and_copy()
    params = list(model.parameters())
    layout = laid_out(model, rank=rank)
    (bucket,) = layout.buckets
    layout.own_storage(layout.buckets)
    assert list(model.parameters()) == params                    # the same objects
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)
        assert mine.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    # The chunk is this rank's slice of the bucket (in the bucket's order), in memory of its
    # own; the shards view it.
    whole = torch.cat([bucket.params[i].detach().reshape(-1)
                       for i in range(len(bucket.params))])
    assert torch.equal(bucket.chunk, whole[bucket.lo:bucket.hi])
    assert bucket.chunk.untyped_storage().data_ptr() != bucket.flat.untyped_storage().data_ptr()
    for piece in bucket.pieces:
        assert piece.shard.untyped_storage().data_ptr() == \
            bucket.chunk.untyped_storage().data_ptr()
        assert torch.equal(piece.shard, piece.param.detach().reshape(-1)[piece.start:piece.stop])
        assert layout.shards[piece.param] == [piece.shard]
    # Stepping a shard changes the chunk, not the full parameters.
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        bucket.pieces[0].shard.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_release_frees_and_materialise_restores_without_bumping_versions():
    model, plain = model_and_copy()
    layout = laid_out(model)
    (bucket,) = layout.buckets
    layout.own_storage(layout.buckets)
    saved = bucket.flat.clone()
    versions = [p._version for p in model.parameters()]
    bucket.release()
    assert not bucket.gathered
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert [tuple(p.shape) for p in model.parameters()] == \
        [tuple(p.shape) for p in plain.parameters()]
    flat = bucket.materialise()
    assert bucket.gathered and flat.untyped_storage().nbytes() == saved.numel() * 4
    flat.copy_(saved)                                  # what a gather writes
    assert [p._version for p in model.parameters()] == versions
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    bucket.release()
    bucket.release()                                   # twice is harmless


def test_backward_after_a_release_and_refill_gives_the_plain_gradients():
    """Saved tensors view the released memory; refilled before backward they are read as if
    nothing happened, with no 'modified by an inplace operation' error."""
    model, plain = model_and_copy()
    layout = laid_out(model)
    (bucket,) = layout.buckets
    layout.own_storage(layout.buckets)
    x = torch.randn(4, 5)
    loss = model(x).square().sum()
    saved = bucket.flat.clone()
    bucket.release()
    bucket.materialise().copy_(saved)
    loss.backward()
    plain(x).square().sum().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


# ---- pins on torch (docs/dev/zero3.md) ----------------------------------------------------
class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul(2.0)


def test_pin_a_torch_function_mode_is_off_during_backward():
    """torch 2.13: ``Tensor.backward`` dispatches to the mode, which is popped while its
    handler runs, so a custom Function's backward (and an activation checkpoint's
    recomputation) is not seen. Stage 3 must re-push its guard around the engine
    (``_engine_run_backward``) or gather by other means in backward."""
    x = torch.randn(3, requires_grad=True)
    with _Recorder() as recorder:
        y = _Probe.apply(x).sum()
        recorder.names.clear()
        y.backward()
    assert "backward" in recorder.names
    assert "mul" not in recorder.names, recorder.names
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_pin_the_private_engine_entry_lets_a_pushed_mode_see_backward():
    """The way back in for stage 3's guard (docs/dev/zero3.md): the autograd engine run
    inside the mode, through torch's private ``_engine_run_backward`` with
    ``torch.autograd.backward``'s arguments, shows the mode every op of backward."""
    from torch.autograd.graph import _engine_run_backward
    x = torch.randn(3, requires_grad=True)
    y = _Probe.apply(x).sum()
    with _Recorder() as recorder:
        _engine_run_backward((y,), (torch.ones_like(y),), False, False, (),
                             allow_unreachable=True, accumulate_grad=True)
    assert "mul" in recorder.names, recorder.names
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_pin_linear_saves_a_view_of_its_weight():
    """The saved-tensor pack hook of stage 3 recognizes a parameter by the tensor or by its
    ``_base``: ``F.linear`` saves ``weight.t()``-like views, not the parameter."""
    weight = nn.Parameter(torch.randn(3, 4))
    packed = []

    def pack(tensor):
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        F.linear(torch.randn(2, 4, requires_grad=True), weight).sum().backward()
    assert any(t is weight or t._base is weight for t in packed)


def test_pin_storage_resize_keeps_views_and_versions():
    flat = torch.arange(6.0)
    view = flat[2:5]
    version = view._version
    flat.untyped_storage().resize_(0)
    assert view.untyped_storage().nbytes() == 0 and view.shape == (3,)
    flat.untyped_storage().resize_(6 * 4)
    assert view._version == version              # resizing is no write
    flat.copy_(torch.arange(6.0) + 10)
    assert torch.equal(view, torch.tensor([12.0, 13.0, 14.0]))
    assert view._version == version + 1          # a view shares its base's counter, ...
    param = nn.Parameter(torch.zeros(3))
    param.data = flat[2:5]
    before = param._version
    flat.add_(1.0)
    assert param._version == before        # .data= keeps the parameter's own counter
