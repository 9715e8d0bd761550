"""Stage 3: the full parameters exist only while they are used (docs/dev/zero3.md).

Each bucket owns its parameters' memory (``Bucket.own_storage``): the shards the optimizer
steps live in the bucket's ``chunk``; the full parameters are views of its ``flat`` buffer,
which is freed (``release``) and refilled by an all-gather of every rank's chunk when they
are next used:

* **forward, and any other use**: a ``TorchFunctionMode`` (``ParamGuard``) sees every torch
  call on the training thread; a call on a parameter of a released bucket (or on a view of
  one) gathers that bucket first. At most ``GATHERED_IN_FORWARD`` buckets stay gathered: the
  least recently used other ones are released. The first forward's order of buckets is
  recorded: using one starts the gather of the next (in backward, of the one before), so it
  travels while this one computes;
* **backward**: tensors autograd saves that are parameters (or views of them) are packed with
  their bucket (``saved_tensors_hooks``); unpacking one gathers its bucket again if it was
  released. A bucket is released once its gradients are all final (nothing in this backward
  needs it any more) and once its shards are stepped (its values are stale).

Gathers are collectives in the order of use, which is the same on every rank when every rank
runs the same forward and backward.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import weakref
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from ... import runtime
from ..requests import ring_allgather_entry, submit_together
from .layout import Bucket, ShardLayout
from .state import _copy_piece

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

# On a sharded parameter: the ParamGathers that holds its values (strongly: the chunks live as
# long as any parameter of theirs, whether or not the optimizer does).
GATHERS_ATTR = "_mpiddp_gathers"


# The stage-3 optimizers alive; on each thread that trains one, one guard and one pair of
# saved-tensor hooks serve them all (pushed once, at the bottom of the thread's stacks, never
# popped: inert while no stage-3 optimizer lives).
_LIVE: "weakref.WeakSet[ParamGathers]" = weakref.WeakSet()
_THREAD = threading.local()


class _Saved:
    """A parameter (or a view of one) autograd saved for backward, with its bucket and the
    ``ParamGathers`` that gathers it (kept alive by the graph)."""

    __slots__ = ("tensor", "bucket", "owner")

    def __init__(self, tensor: torch.Tensor, bucket: Bucket, owner):
        self.tensor, self.bucket, self.owner = tensor, bucket, owner


class ParamGathers:
    """Stage 3's ``Gathers``: the same protocol for ``ShardedSync`` and ``ShardedOptimizer``
    (stepped buckets are released instead of gathered; nothing is deferred), plus the
    gathers on use (module docstring)."""

    def __init__(self, sync):
        # The optimizer's sync, weakly: the model owns this object (each sharded parameter
        # holds it, GATHERS_ATTR), so it gathers and releases for the model after the
        # optimizer is gone; what it needs of the optimizer is copied here.
        self._sync = weakref.ref(sync)
        self.layout: ShardLayout = sync.layout
        self.process_set, self.prefix = sync.process_set, sync.prefix
        self.bucket_cap = sync.bucket_cap
        self.detached = False                 # unshard() gave the parameters back
        self.model_hooks: list = []
        self.deferred = False                 # (forward overlap is implied: see below)
        self.busy = False
        self.params: dict[int, tuple] = {}    # id(parameter) -> (parameter, its bucket)
        self.storages: dict[int, Bucket] = {}  # a bucket's flat storage (_cdata) -> bucket
        self.gathered: "collections.OrderedDict[int, Bucket]" = collections.OrderedDict()
        self.lock = threading.RLock()
        self.gathers_done = 0                 # (tests and benchmarks: gathers so far)
        self.arriving: dict = {}              # id(bucket) -> handle of its gather in flight
        self.sequence: list[Bucket] = []      # buckets in the first forward's order
        self.recording = True                 # ... until the first backward
        # Frozen parameters' buckets (shard_frozen), and those gathered by this backward with
        # the autograd node that did it (released once a later node runs, or at its end).
        self.frozen_layout: Optional[ShardLayout] = None
        self.backward_frozen: dict = {}       # id(bucket) -> (bucket, node)
        self.end_queued = False
        # A prefetch nothing used (an evaluation's, a branch not taken) may still be on the
        # wire when the optimizer goes: its bucket's memory must outlive it.
        weakref.finalize(self, _wait_for_gathers, self.arriving, self.params)
        # consolidate_state_dict's copies of the full parameters on its ``to`` rank, for
        # model.state_dict() there, until the next step; and that rank (None: every rank)
        self.consolidated: Optional[dict] = None
        self.consolidated_to: Optional[int] = -1      # (-1: not consolidated)
        self.model = lambda: None                    # (weak) the model given to the optimizer

    # ---- laying out -------------------------------------------------------------------
    def adopt(self, buckets: list, layout: Optional[ShardLayout] = None) -> None:
        """``buckets`` were just laid out (in ``layout``, default the optimizer's): they own
        their memory from now on, released until first used. A parameter that was in a
        frozen bucket (unfrozen now) is gathered first and moves to its new bucket."""
        layout = layout or self.layout
        from ..functions import broadcast_parameters
        first = (self.process_set or runtime.global_process_set).ranks[0]
        moving = []
        for param in (p for bucket in buckets for p in bucket.params):
            if id(param) in self.params and all(b is not self.params[id(param)][1]
                                                for b in moving):
                moving.append(self.params[id(param)][1])
        with self.lock, self.internal(), torch.no_grad():
            for bucket in moving:
                if id(bucket) in self.arriving or not bucket.gathered:
                    self._gather(bucket)
            # Their own memory again, out of the frozen bucket's (which the broadcast below,
            # writing through NumPy, would make unresizable for good).
            for param in (p for bucket in buckets for p in bucket.params):
                if id(param) in self.params:
                    param.data = param.detach().clone()
        kind = "frozen" if layout is self.frozen_layout else "start"
        for bucket in buckets:
            # Every rank starts from the first rank's values (each keeps a chunk of them: a
            # broadcast_parameters(model.state_dict()) after construction reaches copies
            # only). A bucket at a time: the whole model at once would take the engine's
            # fusion buffers on top of the model, the peak of a stage-3 run.
            broadcast_parameters([(f"{bucket.index}.{i}", param)
                                  for i, param in enumerate(bucket.params)], root_rank=first,
                                 prefix=f"{self.prefix}.stage3_{kind}",
                                 process_set=self.process_set)
            with self.internal():       # (a moving parameter's ``.data =`` is ours)
                layout.own_storage([bucket])
            self.storages[bucket.flat.untyped_storage()._cdata] = bucket
            for param in bucket.params:
                self.params[id(param)] = (param, bucket)
                # The parameter keeps what holds its values (the chunks): the model, or a
                # parameter alone, outlives the optimizer safely.
                setattr(param, GATHERS_ATTR, self)
            bucket.release()
        for bucket in moving:
            self.release(bucket)
        self.guard_this_thread()

    def shard_frozen(self, model: torch.nn.Module) -> None:
        """Collective: the model's frozen floating-point parameters (contiguous, not the
        optimizer's trainable ones) go into buckets of their own, gathered on use as the
        others and never reduced."""
        frozen, seen = [], set()
        for param in model.parameters():
            if id(param) in seen or id(param) in self.params or param.requires_grad or \
                    not param.is_floating_point() or not param.is_contiguous():
                continue
            seen.add(id(param))
            frozen.append(param)
        if not frozen:
            return
        self.frozen_layout = ShardLayout(runtime.set_rank(self.process_set),
                                         runtime.set_size(self.process_set),
                                         self.bucket_cap, lambda param: param.dtype)
        self.frozen_layout.add(frozen)
        for bucket in self.frozen_layout.buckets:
            bucket.frozen = True
        self.adopt(self.frozen_layout.buckets, self.frozen_layout)

    def all_buckets(self) -> list:
        """The optimizer's buckets, then the frozen ones."""
        return self.layout.buckets + (self.frozen_layout.buckets if self.frozen_layout else [])

    def owns(self, param, bucket: Bucket) -> bool:
        """Whether ``param``'s values live in ``bucket`` (an unfrozen parameter has left its
        frozen bucket)."""
        found = self.params.get(id(param))
        return found is not None and found[1] is bucket

    def guard_this_thread(self) -> None:
        """The guard and the saved-tensor hooks, on this thread (each thread has its own
        mode stack and hooks): the builder's thread, then every thread that runs the
        model's forward (its root module's forward pre-hook) before that forward."""
        _LIVE.add(self)
        guard_thread()

    # ---- gathering and releasing --------------------------------------------------------
    def bucket_of(self, tensor: torch.Tensor) -> Optional[Bucket]:
        """The bucket whose memory ``tensor`` is (a parameter) or shares (a view, ``.data``,
        ``.detach()``: by its storage), else None."""
        found = self.params.get(id(tensor))
        if found is not None:
            return found[1]
        try:
            return self.storages.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, AttributeError):   # (sparse, not a tensor)
            return None

    def use(self, buckets: list, keep: int = GATHERED_IN_FORWARD) -> None:
        """``buckets`` are about to be used: gather those released (stepping first the ones
        whose reduce-scatter is still out under the early schedule), start gathering the
        bucket expected next (``prefetch``) and, with ``keep``, release the least recently
        used others beyond ``keep``."""
        sync = self._sync()
        in_backward = torch._C._current_autograd_node() is not None
        with self.lock, self.internal():
            wanted = {id(b) for b in buckets}
            unstepped = [r.bucket for r in sync.in_flight if id(r.bucket) in wanted] \
                if sync is not None else []       # (None: the optimizer is gone)
            if unstepped:
                sync.advance(until=unstepped[-1], wait=True)
            for bucket in buckets:
                if id(bucket) in self.arriving or not bucket.gathered:
                    self._gather(bucket)
                self.gathered[id(bucket)] = bucket
                self.gathered.move_to_end(id(bucket))
                if self.recording and not in_backward and \
                        all(b is not bucket for b in self.sequence):
                    self.sequence.append(bucket)
            if in_backward:
                self.recording = False
                self._frozen_in_backward(buckets)
            else:
                # (A forward: the last backward is over, even one that raised before its end
                # callback ran.)
                self.end_queued = False
            self._prefetch(buckets[-1], backwards=in_backward)
            if keep:
                for key in list(self.gathered):
                    if len(self.gathered) <= max(keep, len(wanted)) + len(self.arriving):
                        break
                    if key not in wanted and key not in self.arriving:
                        self.release(self.gathered[key])

    def _frozen_in_backward(self, buckets: list) -> None:
        """In backward: release the frozen buckets an earlier autograd node gathered (that
        node has run: nothing holds their memory), note the ones this node uses, and release
        the rest at the end of the backward."""
        node = torch._C._current_autograd_node()
        if node is None:        # (a saved tensor read outside backward: grad_fn._saved_...)
            return
        wanted = {id(b) for b in buckets}
        for key, (bucket, by) in list(self.backward_frozen.items()):
            if by is not node and key not in wanted and key not in self.arriving:
                self.release(bucket)
                del self.backward_frozen[key]
        for bucket in buckets:
            if bucket.frozen:
                self.backward_frozen[id(bucket)] = (bucket, node)
        if not self.end_queued:
            self.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.end_queued = False
        self.backward_frozen.clear()
        with self.lock, self.internal():
            for bucket in list(self.gathered.values()):
                if bucket.frozen:
                    self.release(bucket)

    def _prefetch(self, bucket: Bucket, backwards: bool) -> None:
        """Start gathering the bucket the first forward used after ``bucket`` (in backward:
        before it), unless it is gathered, arriving or not yet stepped."""
        at = next((i for i, b in enumerate(self.sequence) if b is bucket), None)
        if at is None:
            return
        at += -1 if backwards else 1
        if not 0 <= at < len(self.sequence):
            return
        sync = self._sync()
        following = self.sequence[at]
        if following.gathered or id(following) in self.arriving:
            return
        # (Not one whose gradients are complete this step: its chunk is about to be stepped.)
        if not following.frozen and sync is not None and (
                following.index in sync.complete or following.index in sync.filling
                or any(r.bucket is following for r in sync.in_flight)):
            return
        self._start(following)
        self.gathered[id(following)] = following

    def _start(self, bucket: Bucket) -> None:
        self._check_can_gather(bucket)
        output = bucket.materialise()
        kind = "frozen" if bucket.frozen else "gather"
        try:
            entry = ring_allgather_entry(bucket.chunk, output,
                                         f"{self.prefix}.{kind}{bucket.index}", resizable=True)
            (handle,) = submit_together([entry], self.process_set)
        except BaseException:
            bucket.release()        # (not left "gathered" with undefined values)
            raise
        self.arriving[id(bucket)] = handle
        self.gathers_done += 1

    def _wait(self, bucket: Bucket) -> None:
        handle = self.arriving.pop(id(bucket))
        try:
            handle.wait()
        except BaseException:
            self.release(bucket)
            raise

    def _gather(self, bucket: Bucket) -> None:
        if id(bucket) not in self.arriving:
            self._start(bucket)
        self._wait(bucket)

    def _check_can_gather(self, bucket: Bucket) -> None:
        """A gather needs the engine, and parameters still viewing the bucket's memory."""
        if not runtime.is_initialized():
            raise RuntimeError(
                f"parameters {self.names(bucket.params)} of a DistributedOptimizer(zero_stage=3) "
                "model cannot be gathered: mpiddp.shutdown() was called while the model lived, "
                "and each rank holds only its shard of them. Use the model (forward, "
                "model.state_dict(), mpiddp.Checkpoint) before shutdown()")
        flat = bucket.flat.untyped_storage()._cdata
        moved = [param for param in bucket.params if self.owns(param, bucket)
                 and param.untyped_storage()._cdata != flat]
        if moved:
            self.refuse_new_memory(moved)

    def refuse_new_memory(self, params: list) -> None:
        raise RuntimeError(
            f"parameters {self.names(params)} were given other memory (model.to(), .cuda(), "
            ".half(), param.data = ...) while a DistributedOptimizer(zero_stage=3) shards "
            "them: their values live in its buckets. Move or convert the model before building "
            "the optimizer")

    def names(self, params: list) -> list:
        """The model's names of ``params`` (at most 3; shapes where the model is gone)."""
        model = self.model()
        found = {id(p): name for name, p in model.named_parameters()} if model is not None \
            else {}
        return [found.get(id(p), f"<{list(p.shape)}>") for p in params[:3]]

    def unshard(self) -> None:
        """Collective: every parameter this object shards gets its full values in memory of
        its own, and this object lets go of the model (its hooks, the guard's attention):
        a new ``DistributedOptimizer`` takes the parameters over. The whole model is in
        memory once, as when it was built."""
        with self.lock, self.internal(), torch.no_grad():
            for bucket in self.all_buckets():
                if id(bucket) in self.arriving or not bucket.gathered:
                    self._gather(bucket)
                for param in bucket.params:
                    if self.owns(param, bucket):
                        param.data = param.detach().clone()
                        if getattr(param, GATHERS_ATTR, None) is self:
                            delattr(param, GATHERS_ATTR)
                self.release(bucket)
        self.params.clear()
        self.storages.clear()
        self.detached = True
        _LIVE.discard(self)
        _remove_hooks(self.model_hooks)
        self.forget_consolidated()

    def release(self, bucket: Bucket) -> None:
        """Free ``bucket``'s full parameters (a gather into them still arriving is waited
        for first: the engine writes there, and reads the chunk a step may change)."""
        if id(bucket) in self.arriving:
            self._wait(bucket)
        bucket.release()
        self.gathered.pop(id(bucket), None)

    @contextlib.contextmanager
    def internal(self):
        """Our own torch calls on parameters pass the guard."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    # ---- the model's full form (attach_model) ----------------------------------------------
    def full_values(self, to: Optional[int] = None) -> Optional[dict]:
        """Collective: gather every bucket in turn; on rank ``to`` of the optimizer's process
        set (every rank: None) return copies of the full parameters (id -> tensor) in host
        memory (the model does not fit the device: the reason for stage 3)."""
        keep = to is None or to == runtime.set_rank(self.process_set)
        self.complete()
        values = {}
        with self.lock, self.internal():
            for bucket in self.all_buckets():
                if id(bucket) in self.arriving:
                    self._wait(bucket)
                was_gathered = bucket.gathered
                if not was_gathered:
                    self._gather(bucket)
                if keep:
                    for param in bucket.params:
                        if self.owns(param, bucket):     # (on the host: see the docstring)
                            values[id(param)] = param.detach().to("cpu", copy=True)
                if not was_gathered:
                    bucket.release()
        return values if keep else None

    def consolidate(self, to: Optional[int]) -> None:
        """Collective (``consolidate_state_dict(to)``): keep copies of the full parameters
        on rank ``to`` (every rank: None) for ``model.state_dict()``, until the next step."""
        self.consolidated = self.full_values(to)
        self.consolidated_to = to

    def forget_consolidated(self) -> None:
        self.consolidated, self.consolidated_to = None, -1

    # ---- the Gathers protocol of ShardedSync / ShardedOptimizer ---------------------------
    def priority(self, bucket: Bucket) -> int:
        return 0

    def add(self, bucket: Bucket) -> None:
        """Early schedule: ``bucket`` was just stepped (its gradients were all final, so
        backward needs it no more): its full parameters are stale."""
        self.release(bucket)
        self.forget_consolidated()

    def bucket_complete(self, bucket: Bucket) -> None:
        """Every gradient of ``bucket`` is final: this backward needs it no more."""
        self.release(bucket)

    def start(self, buckets: list) -> None:
        """After ``step()``: the stepped buckets' full parameters are stale."""
        for bucket in buckets:
            self.release(bucket)
        self.forget_consolidated()

    def complete(self, until: Optional[Bucket] = None) -> None:
        """Step what the early schedule left (the gathers themselves happen on use)."""
        sync = self._sync()
        if until is None and sync is not None:
            with self.lock, self.internal():
                sync.advance(wait=True)

    def has_work(self) -> bool:
        return False

    def poll(self) -> None:
        pass

    def pending(self) -> list:
        return []

    def watch(self, buckets) -> None:
        pass

    def unwatch(self, bucket: Bucket) -> None:
        pass

    def enable_overlap(self) -> None:
        """Stage 3 gathers every parameter at its first use anyway: forward overlap is what
        it does, nothing to enable."""


def _wait_for_gathers(arriving: dict, params: dict) -> None:
    """(A dead ``ParamGathers``' finalizer: ``params`` keeps the buckets alive until here.)"""
    for handle in list(arriving.values()):
        try:
            handle.wait()
        except Exception:        # (the engine stopped: it writes nothing more)
            pass
    arriving.clear()


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
                    if func == _SET_DATA and \
                            gathers.bucket_of(args[1]) is not gathers.bucket_of(args[0]):
                        # (model.to() to where the parameter is sets it to itself)
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


def _buckets_in(gathers: ParamGathers, values) -> list:
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


# ---- the model's state dict (docs/dev/zero3.md "Model and optimizer state") -----------------
def give_back(params) -> None:
    """Collective, before a new ``DistributedOptimizer`` takes ``params``: a stage-3 model
    whose optimizer is gone gives them (and its other parameters) memory of their own
    (``ParamGathers.unshard``), so that the new optimizer starts from their values."""
    owners = []
    for param in params:
        gathers = getattr(param, GATHERS_ATTR, None)
        if gathers is not None and not gathers.detached and \
                all(owner is not gathers for owner in owners):
            owners.append(gathers)
    for gathers in owners:
        gathers.unshard()


def check_not_released(named: list) -> None:
    """A parameter whose memory a stage-3 optimizer released, and which that optimizer no
    longer gathers (it is gone), cannot be read: refuse it by name."""
    released = [name for name, param in named if param.layout == torch.strided and
                param.untyped_storage().nbytes() <
                (param.storage_offset() + param.numel()) * param.element_size()]
    if released:
        raise ValueError(
            f"DistributedOptimizer: parameters {released[:3]} have no memory (their storage "
            "was resized to 0 outside mpiddp)")


def check_model(zero_stage: int, model, optimizer) -> None:
    """``DistributedOptimizer``'s ``model`` argument: needed at stage 3 (holding every
    parameter of the optimizer), refused elsewhere. Before any collective."""
    if zero_stage == 3 and model is None:
        raise ValueError("DistributedOptimizer(zero_stage=3) needs the model: pass model=model "
                         "(its parameters are sharded, and model.state_dict() gathers them)")
    if model is not None and zero_stage != 3:
        raise ValueError(f"DistributedOptimizer(model=...) is for zero_stage=3 only, not "
                         f"zero_stage={zero_stage}; leave model out")
    if model is None:
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    own = {id(p) for p in model.parameters()}
    strays = [(g, i, list(p.shape)) for g, group in enumerate(optimizer.param_groups)
              for i, p in enumerate(group["params"]) if id(p) not in own]
    if strays:
        where = ", ".join(f"group {g} #{i} {shape}" for g, i, shape in strays[:3])
        raise ValueError(f"DistributedOptimizer(zero_stage=3, model=...): {len(strays)} "
                         f"parameter(s) of the optimizer are not the model's ({where})")


def attach_model(optimizer, model: torch.nn.Module) -> None:
    """Stage 3: ``model.state_dict()`` gives the full parameters (the copies
    ``optimizer.consolidate_state_dict(to)`` made on rank ``to``, until the next step;
    otherwise gathered there and then, a collective on every rank), and
    ``model.load_state_dict(full)`` takes them (every sharded parameter's key present; the
    whole model is materialised while it loads). Only the root module's calls do this. A
    thread that runs the model's forward gets the guard first."""
    gathers = optimizer._mpiddp.gathers
    ref = weakref.ref(gathers)
    gathers.model = weakref.ref(model)
    gathers.shard_frozen(model)
    handles = [
        model.register_forward_pre_hook(_guard_thread),
        model.register_forward_hook(functools.partial(_after_forward, ref)),
        model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: _quiet(ref, True)),
        model.register_state_dict_post_hook(functools.partial(_full_state, ref)),
        model.register_load_state_dict_pre_hook(functools.partial(_before_load, ref)),
        model.register_load_state_dict_post_hook(functools.partial(_after_load, ref))]
    # (The model's parameters keep ``gathers`` alive: it serves the model after the
    # optimizer is gone, until a new DistributedOptimizer takes the model: unshard.)
    gathers.model_hooks = handles
    weakref.finalize(gathers, _remove_hooks, handles)


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def model_of(optimizer) -> Optional[torch.nn.Module]:
    """The model a ``DistributedOptimizer(zero_stage=3)`` was given (else None)."""
    sync = optimizer.__dict__.get("_mpiddp")
    gathers = getattr(sync, "gathers", None)
    return gathers.model() if isinstance(gathers, ParamGathers) else None


def _guard_thread(module, args) -> None:
    if not getattr(_THREAD, "guarded", False) and not torch.compiler.is_compiling():
        guard_thread()          # (compiled code: refused by the guard at its first run)


def _after_forward(ref, module, args, output) -> None:
    """A forward without autograd (evaluation) keeps nothing gathered."""
    gathers = ref()
    if gathers is not None and not torch.is_grad_enabled() and \
            not torch.compiler.is_compiling():
        with gathers.lock, gathers.internal():
            for bucket in list(gathers.gathered.values()):
                gathers.release(bucket)


def _quiet(ref, quiet: bool) -> None:
    """The guard passes (state_dict's detach() and load's copy_() are ours to handle)."""
    gathers = ref()
    if gathers is not None:
        gathers.busy = quiet


def _sharded_keys(gathers: ParamGathers, module, prefix: str) -> list:
    return [(prefix + name, param) for name, param in
            module.named_parameters(remove_duplicate=False) if id(param) in gathers.params]


def _full_state(ref, module, state_dict, prefix, local_metadata) -> None:
    gathers = ref()
    if gathers is None:
        return
    _quiet(ref, False)
    to = gathers.consolidated_to
    if gathers.consolidated is None and to is not None and to >= 0:
        rank = runtime.set_rank(gathers.process_set)
        raise RuntimeError(
            f"model.state_dict() on rank {rank} with DistributedOptimizer(zero_stage=3): the "
            f"full parameters were consolidated onto rank {to} only (consolidate_state_dict"
            f"(to={to})); call it there, or consolidate with to=None, or after the next step "
            "(then it gathers on every rank)")
    values = gathers.consolidated if gathers.consolidated is not None \
        else gathers.full_values()
    for key, param in _sharded_keys(gathers, module, prefix):
        if key in state_dict:
            state_dict[key] = values[id(param)]


def _before_load(ref, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs) -> None:
    gathers = ref()
    if gathers is None:
        return
    absent = [key for key, _ in _sharded_keys(gathers, module, prefix) if key not in state_dict]
    if absent:
        raise ValueError(f"zero_stage=3 loads every sharded parameter: {absent[:3]} missing "
                         "from the state dict")
    with gathers.lock, gathers.internal():
        for bucket in gathers.all_buckets():
            # (Gathered, not just given memory: an entry load_state_dict skips, or a load
            # that fails, leaves the current values.)
            if id(bucket) in gathers.arriving or not bucket.gathered:
                gathers._gather(bucket)
    _quiet(ref, True)


def _after_load(ref, module, incompatible_keys) -> None:
    gathers = ref()
    if gathers is None:
        return
    _quiet(ref, False)
    with torch.no_grad():
        for bucket in gathers.all_buckets():
            bucket.chunk.copy_(bucket.flat[bucket.lo:bucket.hi])
            gathers.release(bucket)
    gathers.forget_consolidated()


def _kept_whole(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """What stage 3 keeps whole on every rank: the model's buffers and the parameters not
    sharded (frozen ones), by name."""
    whole = {name: param for name, param in model.named_parameters()
             if id(param) not in gathers.params}
    whole.update(model.named_buffers())
    return whole


def kept_whole(optimizer, model: torch.nn.Module) -> dict:
    """What a ``DistributedOptimizer(zero_stage=3)`` leaves whole in ``model`` (buffers,
    parameters not sharded), by name: what a broadcast from one rank still reaches."""
    return _kept_whole(optimizer.__dict__["_mpiddp"].gathers, model)


def whole_model_state(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """Copies of ``_kept_whole`` (for ``sharded_state_dict``)."""
    return {name: tensor.detach().clone()
            for name, tensor in _kept_whole(gathers, model).items()}


def _frozen_pieces_here(gathers: ParamGathers, model: torch.nn.Module) -> list:
    """(name, piece) for this rank's pieces of the frozen parameters still in their frozen
    buckets."""
    if gathers.frozen_layout is None:
        return []
    names = {id(param): name for name, param in model.named_parameters()}
    return [(names[id(piece.param)], piece) for bucket in gathers.frozen_layout.buckets
            for piece in bucket.pieces if gathers.owns(piece.param, bucket)]


def frozen_pieces(gathers: ParamGathers, model: torch.nn.Module) -> dict:
    """This rank's pieces of the sharded frozen parameters, by name: (start, stop, copy)."""
    return {name: (piece.start, piece.stop, piece.shard.detach().clone())
            for name, piece in _frozen_pieces_here(gathers, model)}


def check_sharded_model(gathers: ParamGathers, model: torch.nn.Module, parts: list) -> None:
    """The parts hold what ``load_sharded_model`` takes (ValueError naming what is missing)."""
    whole = parts[0]["whole"]
    own = _kept_whole(gathers, model)
    missing = sorted(set(own) - set(whole))
    wrong = sorted(name for name in set(own) & set(whole)
                   if tuple(whole[name].shape) != tuple(own[name].shape))
    missing += sorted({name for name, _ in _frozen_pieces_here(gathers, model)
                       if not any(name in part.get("frozen", {}) for part in parts)})
    if missing or wrong:
        raise ValueError(f"load_sharded_state_dict: the save lacks {missing[:3]} or has other "
                         f"shapes for {wrong[:3]}: a state of another model")


def load_sharded_model(gathers: ParamGathers, model: torch.nn.Module, parts: list) -> None:
    """``load_sharded_state_dict`` at stage 3 wrote this rank's chunks of the trainable
    parameters: the full parameters gathered before are stale. The frozen ones' pieces come
    from every part, what is kept whole from the first."""
    whole = parts[0]["whole"]
    with torch.no_grad(), gathers.lock, gathers.internal():
        for bucket in gathers.all_buckets():
            gathers.release(bucket)
        for name, tensor in _kept_whole(gathers, model).items():
            tensor.copy_(whole[name])
        for name, piece in _frozen_pieces_here(gathers, model):
            _load_piece(piece, name, parts)
    gathers.forget_consolidated()


def _load_piece(piece, name: str, parts: list) -> None:
    """Copy elements ``piece.start:piece.stop`` of frozen parameter ``name`` from the parts
    that hold them (any rank count saved them)."""
    covered, elements = 0, {}
    for part in parts:
        found = part.get("frozen", {}).get(name)
        if found is None:
            continue
        start, stop, values = found
        lo, hi = max(start, piece.start), min(stop, piece.stop)
        if lo < hi:
            _copy_piece(elements, {"value": values}, start, stop, lo, hi, piece.start,
                        piece.stop - piece.start)
            covered += hi - lo
    if covered != piece.stop - piece.start:
        raise ValueError(f"load_sharded_state_dict: the parts do not cover the frozen "
                         f"parameter '{name}' elements {piece.start}-{piece.stop}")
    piece.shard.copy_(elements["value"])
