"""Stage 3: the full parameters exist only while they are used (docs/dev/zero3.md).

Each bucket owns its parameters' memory (``Bucket.own_storage``): the shards the optimizer
steps live in the bucket's ``chunk``; the full parameters are views of its ``flat`` buffer,
which is freed (``release``) and refilled by an all-gather of every rank's chunk when they
are next used (``ParamGathers.use``, called by the guard, ``param_guard.py``). The first
forward's order of buckets is recorded: using one starts the gather of the next (in
backward, of the one before), so it travels while this one computes. A bucket is released
once its gradients are all final (nothing in this backward needs it any more) and once its
shards are stepped (its values are stale).

Gathers are collectives in the order of use, which is the same on every rank when every rank
runs the same forward and backward. The model owns this object (``GATHERS_ATTR`` on each
sharded parameter): it serves the model after the optimizer is gone.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Optional

import torch

from ... import runtime
from ..ops.requests import ring_allgather_entry, submit_together
from .layout import Bucket, ShardLayout
from .param_guard import _LIVE, GATHERED_IN_FORWARD, guard_thread

# On a sharded parameter: the ParamGathers that holds its values (strongly: the chunks live as
# long as any parameter of theirs, whether or not the optimizer does).
GATHERS_ATTR = "_mpiddp_gathers"

NOT_PICKLED = ("a model whose parameters DistributedOptimizer(zero_stage=3) shards cannot be "
               "pickled whole (torch.save(model)): each rank holds only its shards. Save "
               "model.state_dict() (the full parameters, gathered), or use mpiddp.Checkpoint")

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
        self.meta_init = None                 # a model on the meta device (meta_init.py)
        self.model_hooks: list = []
        self.deferred = False                 # (forward overlap is implied: see below)
        self.busy = False
        self.params: dict[int, tuple] = {}    # id(parameter) -> (parameter, its bucket)
        self.storages: dict[int, Bucket] = {}  # a bucket's flat storage (_cdata) -> bucket
        self.gathered: "collections.OrderedDict[int, Bucket]" = collections.OrderedDict()
        self.lock = threading.RLock()
        self.gathers_done = 0                 # (tests and benchmarks: gathers so far)
        self.arriving: dict = {}              # id(bucket) -> handle of its gather in flight
        # Mixed precision (mixed_precision.py): the full parameters' dtype (None: theirs), and
        # the param_dtype copies of the chunks that gathers in flight send.
        self.param_dtype = sync.param_dtype
        self.sending: dict = {}               # id(bucket) -> the chunk's cast copy
        self.loading: dict = {}               # id(parameter) -> a loading state dict's value
        self.sequence: list[Bucket] = []      # buckets in the first forward's order
        self.recording = True                 # ... until the first backward
        # Frozen parameters' buckets (shard_frozen), and those gathered by this backward with
        # the autograd node that did it (released once a later node runs, or at its end).
        self.frozen_layout: Optional[ShardLayout] = None
        self.backward_frozen: dict = {}       # id(bucket) -> (bucket, node)
        self.end_queued = False
        # A prefetch nothing used (an evaluation's, a branch not taken) may still be on the
        # wire when the optimizer goes: its bucket's memory must outlive it.
        weakref.finalize(self, _wait_for_gathers, self.arriving, self.params, self.sending)
        # consolidate_state_dict's copies of the full parameters on its ``to`` rank, for
        # model.state_dict() there, until the next step; and that rank (None: every rank)
        self.consolidated: Optional[dict] = None
        self.consolidated_to: Optional[int] = -1      # (-1: not consolidated)
        self.model = lambda: None                    # (weak) the model given to the optimizer

    def __reduce__(self):
        raise TypeError(NOT_PICKLED)

    # ---- laying out -------------------------------------------------------------------
    def adopt(self, buckets: list, layout: Optional[ShardLayout] = None) -> None:
        """``buckets`` were just laid out (in ``layout``, default the optimizer's): they own
        their memory from now on, released until first used. A parameter that was in a
        frozen bucket (unfrozen now) is gathered first and moves to its new bucket."""
        layout = layout or self.layout
        from ..ops.functions import broadcast_parameters
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
            if self.meta_init is not None and bucket.device.type == "meta":
                self.meta_init.materialise(bucket.params, self.holds, self.internal)
                bucket.device = self.meta_init.device
            # Every rank starts from the first rank's values (each keeps a chunk of them: a
            # broadcast_parameters(model.state_dict()) after construction reaches copies
            # only). A bucket at a time: the whole model at once would take the engine's
            # fusion buffers on top of the model, the peak of a stage-3 run.
            broadcast_parameters([(f"{bucket.index}.{i}", param)
                                  for i, param in enumerate(bucket.params)], root_rank=first,
                                 prefix=f"{self.prefix}.stage3_{kind}",
                                 process_set=self.process_set)
            if self.param_dtype is not None and bucket.dtype.is_floating_point:
                bucket.param_dtype = self.param_dtype
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
        self.frozen_layout = ShardLayout(self.layout.grid, self.bucket_cap,
                                         lambda param: param.dtype)
        self.frozen_layout.add(frozen)
        for bucket in self.frozen_layout.buckets:
            bucket.frozen = True
        self.adopt(self.frozen_layout.buckets, self.frozen_layout)

    def holds(self, param) -> bool:
        """Whether a bucket holds ``param``'s values."""
        return id(param) in self.params

    def finish_meta(self, model: torch.nn.Module) -> None:
        """Collective, after every bucket is laid out: a meta model's tensors no bucket took
        (buffers, parameters kept whole) get memory and the first rank's values."""
        if self.meta_init is None:
            return
        from ..ops.functions import broadcast_parameters
        whole = self.meta_init.finish(model, self.holds, self.internal)
        self.meta_init = None
        first = (self.process_set or runtime.global_process_set).ranks[0]
        broadcast_parameters(whole, root_rank=first, prefix=f"{self.prefix}.stage3_meta",
                             process_set=self.process_set)

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
        except (RuntimeError, NotImplementedError):     # no storage: sparse, nested layouts
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
            chunk = bucket.chunk
            if bucket.mixed:        # (kept until the gather is done: the engine reads it)
                chunk = self.sending[id(bucket)] = chunk.to(bucket.param_dtype)
            entry = ring_allgather_entry(chunk, output,
                                         f"{self.prefix}.{kind}{bucket.index}",
                                         bucket.ring_order, resizable=True)
            (handle,) = submit_together([entry], self.process_set)
        except BaseException:
            bucket.release()        # (not left "gathered" with undefined values)
            self.sending.pop(id(bucket), None)
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
        finally:
            self.sending.pop(id(bucket), None)

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
                masters = self.masters(bucket) if bucket.mixed else None
                for param in bucket.params:
                    if self.owns(param, bucket):
                        param.data = param.detach().clone() if masters is None else \
                            self._master_of(param, bucket, masters).clone()
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
                masters = self.masters(bucket) if bucket.mixed else None
                if keep:
                    for param in bucket.params:
                        if self.owns(param, bucket):     # (on the host: see the docstring)
                            value = param.detach() if masters is None else \
                                self._master_of(param, bucket, masters)
                            values[id(param)] = value.to("cpu", copy=True)
                if not was_gathered:
                    bucket.release()
        return values if keep else None

    def masters(self, bucket: Bucket) -> torch.Tensor:
        """Collective, with mixed precision: every rank's chunk of ``bucket`` in the masters'
        dtype (the full precision values; the gathered parameters are ``param_dtype``
        copies), a flat buffer of the bucket's size."""
        full = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        entry = ring_allgather_entry(bucket.chunk, full, f"{self.prefix}.masters{bucket.index}"
                                     + ("f" if bucket.frozen else ""), bucket.ring_order)
        (handle,) = submit_together([entry], self.process_set)
        handle.wait()
        return full

    @staticmethod
    def _master_of(param, bucket: Bucket, masters: torch.Tensor) -> torch.Tensor:
        offset = bucket.offsets[param]
        return masters[offset:offset + param.numel()].view(param.shape)

    def consolidate(self, to: Optional[int]) -> None:
        """Collective (``consolidate_state_dict(to)``): keep copies of the full parameters
        on rank ``to`` (every rank: None) for ``model.state_dict()``, until the next step."""
        self.consolidated = self.full_values(to)
        self.consolidated_to = to

    def forget_consolidated(self) -> None:
        self.consolidated, self.consolidated_to = None, -1

    # ---- the Gathers protocol of ShardedSync / ShardedOptimizer ---------------------------
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


def _wait_for_gathers(arriving: dict, params: dict, sending: dict) -> None:
    """(A dead ``ParamGathers``' finalizer: ``params`` keeps the buckets alive until here.)"""
    for handle in list(arriving.values()):
        try:
            handle.wait()
        except Exception:        # (the engine stopped: it writes nothing more)
            pass
    arriving.clear()
    sending.clear()


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
