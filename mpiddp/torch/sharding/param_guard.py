"""Stage 3's guard: every torch call on a thread that trains a stage-3 model sees whether it
uses a released parameter, and autograd's saved parameters are gathered again for backward
(docs/dev/zero3.md):

* **forward, and any other use**: a ``TorchFunctionMode`` (``ParamGuard``) sees every torch
  call on the thread; a call on a parameter of a released bucket (or on a tensor sharing its
  memory) has that bucket gathered first (``ParamGathers.use``). At most
  ``GATHERED_IN_FORWARD`` buckets stay gathered;
* **backward**: tensors autograd saves that are parameters (or share their memory) are packed
  with their bucket (``saved_tensors_hooks``); unpacking one gathers its bucket again if it
  was released.

One guard and one pair of hooks per thread serve every live ``ParamGathers`` (``_LIVE``); the
guard does not import them (they register themselves).
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

# Buckets kept gathered by the forward's uses (the one in use and the one before it: the
# last ones are what backward needs first).
GATHERED_IN_FORWARD = 2

# Torch calls that read only a tensor's metadata: no gather (listing the shapes of a model's
# parameters must not gather them, nor make one rank gather what another does not).
_METADATA = {
    getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout",
        "grad_fn", "itemsize", "is_cuda", "is_sparse", "_base", "_version")
    if hasattr(torch.Tensor, name)
} | {getattr(torch.Tensor, name) for name in (
    "size", "numel", "dim", "stride", "element_size", "__len__", "__hash__", "is_floating_point",
    "is_complex", "nelement", "data_ptr", "untyped_storage", "is_contiguous",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_")
    if hasattr(torch.Tensor, name)}

# loss.backward() and torch.autograd.backward: run by the guard (ParamGuard._backward).
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}

# ``param.data = other``: the parameter would leave its bucket's memory (ParamGuard refuses).
_SET_DATA = torch.Tensor.data.__set__


# The stage-3 optimizers alive; on each thread that trains one, one guard and one pair of
# saved-tensor hooks serve them all (pushed once, at the bottom of the thread's stacks, never
# popped: inert while no stage-3 optimizer lives).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()    # of ParamGathers
_THREAD = threading.local()


class _Saved:
    """A parameter (or a view of one) autograd saved for backward, with its bucket and the
    ``ParamGathers`` that gathers it (kept alive by the graph)."""

    __slots__ = ("tensor", "bucket", "owner")

    def __init__(self, tensor: torch.Tensor, bucket, owner):
        self.tensor, self.bucket, self.owner = tensor, bucket, owner


class ParamGuard(TorchFunctionMode):
    """Gathers a released bucket before a torch call uses one of its parameters (module
    docstring)."""

    def __init__(self):
        super().__init__()
        self.refuse_compiled_code = _refusal()     # (made here: not while Dynamo traces)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        live = list(_LIVE)
        if not live:
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():       # Dynamo traces this method: refuse at run time
            self.refuse_compiled_code()
            return func(*args, **kwargs)
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        if func not in _METADATA:
            for gathers in live:
                if gathers.busy:
                    continue
                buckets = _buckets_in(gathers, args)
                if kwargs:
                    buckets += _buckets_in(gathers, kwargs.values())
                if buckets:
                    if func == _SET_DATA and isinstance(args[1], torch.Tensor) and \
                            gathers.bucket_of(args[1]) is not gathers.bucket_of(args[0]):
                        # (model.to() to where the parameter is sets it to itself; a value
                        # that is no tensor torch refuses itself)
                        gathers.refuse_new_memory([args[0]])
                    # Inside backward (a custom Function's backward, an activation
                    # checkpoint's recomputation) nothing is released: tensors autograd
                    # holds there may view any gathered bucket; those buckets go when their
                    # gradients are final.
                    in_backward = torch._C._current_autograd_node() is not None
                    gathers.use(buckets, keep=0 if in_backward else GATHERED_IN_FORWARD)
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        """``loss.backward()`` / ``torch.autograd.backward`` with this guard on during the
        backward pass. torch removes a mode from the stack while the mode handles a call, and
        backward is such a call, so a recomputation (activation checkpointing) or a custom
        Function's backward would otherwise use released parameters unseen. So the autograd
        engine is run here, inside the guard, with the arguments torch's ``backward``
        would give it (docs/dev/zero3.md; tests/test_zero3_layout.py pins the private entry)."""
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        tensors = bound.get("self", bound.get("tensors"))
        grads = bound.get("gradient", bound.get("grad_tensors"))
        inputs = bound.get("inputs")
        if bound.get("grad_variables") is not None or not (
                isinstance(inputs, (torch.Tensor, list, tuple)) or inputs is None):
            return func(*args, **kwargs)      # forms this does not rebuild: as torch does
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = () if inputs is None else \
            (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        grads = torch.autograd._tensor_or_tensors_to_tuple(grads, len(tensors))
        grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
        # (torch's private entry, imported here: a torch without it fails stage 3's backward
        # and its pinning test, not every ``import mpiddp``)
        from torch.autograd.graph import _engine_run_backward
        create_graph = bool(bound.get("create_graph", False))
        retain_graph = bound.get("retain_graph")
        with self:
            _engine_run_backward(tensors, grads,
                                 create_graph if retain_graph is None else retain_graph,
                                 create_graph, inputs, allow_unreachable=True,
                                 accumulate_grad=True)


def guard_thread() -> None:
    """Push the guard and the saved-tensor hooks on this thread, once, *below* whatever
    modes and hooks are open (``with torch.device(...)``, an activation checkpoint's hooks):
    those pop themselves on exit, and would pop ours instead if ours were on top."""
    if getattr(_THREAD, "guarded", False):
        return
    _THREAD.guarded = True
    above = [torch._C._pop_torch_function_stack()
             for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(ParamGuard())
    for mode in reversed(above):
        torch._C._push_on_torch_function_stack(mode)
    hooks = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
    for pack, unpack in reversed(hooks):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


@functools.cache
def _refusal():
    """A function Dynamo does not trace (a graph break: it runs when the compiled code first
    meets the guard, before the compiled region) that refuses compiled code. Made at first
    need: ``torch.compiler.disable`` imports torch._dynamo, seconds of CPU."""
    def refuse() -> None:
        raise RuntimeError(
            "DistributedOptimizer(zero_stage=3) cannot run torch.compile'd code: a compiled "
            "graph reads every parameter inside itself, where none can be gathered just "
            "before its use. Run the model uncompiled, or use zero_stage=2")
    return torch.compiler.disable(refuse)


def _buckets_in(gathers, values) -> list:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            bucket = gathers.bucket_of(value)
            if bucket is not None and all(b is not bucket for b in found):
                found.append(bucket)
        elif isinstance(value, (list, tuple)):
            found += [b for b in _buckets_in(gathers, value)
                      if all(f is not b for f in found)]
    return found


def _pack(tensor: torch.Tensor):
    for gathers in list(_LIVE):
        bucket = gathers.bucket_of(tensor)
        if bucket is not None:
            return _Saved(tensor, bucket, gathers)
    return tensor


def _unpack(saved):
    if isinstance(saved, _Saved):
        bucket, owner = saved.bucket, saved.owner
        if owner.detached and not bucket.gathered:
            raise RuntimeError(
                "backward of a graph built before its stage-3 model was handed to a new "
                "DistributedOptimizer: the parameters it saved are gone. Run backward before "
                "building the new optimizer")
        if not owner.detached and (not bucket.gathered or id(bucket) in owner.arriving):
            owner.use([bucket], keep=0)      # (arriving: a prefetch, still on the wire)
        elif not owner.detached and bucket.frozen:
            with owner.lock:
                owner._frozen_in_backward([bucket])
        return saved.tensor
    return saved
