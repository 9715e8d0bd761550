"""DistributedOptimizer: wrap the user's optimizer so that it steps on gradients averaged
across ranks.

``DistributedOptimizer(optimizer, named_parameters=model.named_parameters())`` returns an
optimizer that *is* the user's optimizer (same class, ``isinstance`` holds; it shares the
original's ``__dict__``, so ``param_groups``, ``state``, ``state_dict()``/``load_state_dict()``
and LR schedulers keep working) with four methods changed:

* ``step()`` completes the gradients' reductions as the schedule says (only needed when
  gradients did not come from ``backward()``, or after fewer than
  ``backward_passes_per_step`` passes) and then runs the wrapped optimizer's own step;
* ``zero_grad()`` first completes reductions still in flight, so it never races with them;
* ``add_param_group()`` reduces the new group's gradients too;
* ``synchronize()``, ``skip_synchronize()`` and ``set_backward_passes_per_step()`` are added.

The gradients themselves (hooks, buckets, reductions, writing averages back, and when that
happens) are ``GradientSync``'s job (``gradients/sync.py``); with ``overlap_forward`` the
update itself is deferred into the next forward (``gradients/forward_overlap.py``); this
module wraps and sets up.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from ... import runtime
from ...reduce_ops import ReduceOp
from .adasum import wrap_adasum
from ...runtime import ProcessSet
from ..compression import Compression
from ..gradients.forward_overlap import ForwardOverlap
from ..gradients.powersgd import PowerSGDSync, attach_state, check_powersgd
from ..compression.powersgd_settings import PowerSGDCompressor
from ..gradients.sync import OWNER_ATTR, GradientSync
from ..gradients.optimizer import (_DistributedOptimizer, _check_passes, _check_same_everywhere,
                      _complete_overlap)
from ..sharding import model_state
from ..sharding.clip_guard import install_clip_guard
from ..sharding.mixed_precision import MixedPrecisionPolicy, check_policy
from ..sharding.meta_init import MetaInit, check_meta_model, check_not_meta
from ..sharding.optimizer import ShardedOptimizer, check_shardable, shard_param_groups
from ..sharding.sync import ShardedSync

__all__ = ["DistributedOptimizer"]

BUCKET_CAP_MB = 4.0        # bucket_cap_mb's default
# ... with zero_stage 1 or 2: small buckets start the reduce-scatters early in backward, and
# the engine fuses those ready together into one ring pass (docs/benchmarks.md, "Sharded
# optimizers": 1 MB measured best at 2 and 8 nodes, both link rates)
ZERO_BUCKET_CAP_MB = 1.0
# ... with zero_stage 3: each bucket is also gathered at its use, alone (25 MB measured
# best: docs/dev/zero3.md)
ZERO3_BUCKET_CAP_MB = 25.0
_optimizer_index = itertools.count()   # names gradients opt<i>.grad.*: one per process


_classes: dict = {}


def _distributed_class(base: type, methods: type = _DistributedOptimizer) -> type:
    cls = _classes.get((base, methods))
    if cls is None:
        cls = type(base.__name__, (methods, base),
                   {"__module__": base.__module__,
                    "__doc__": f"{base.__name__} averaging gradients across ranks (mpiddp)."})
        _classes[(base, methods)] = cls
    return cls


def _names_for(optimizer, named_parameters) -> tuple[list, dict]:
    """(name, parameter) for every parameter of the optimizer, in param_groups order, and the
    name map (kept for parameters added later with add_param_group)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"group{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                 for i, p in enumerate(group["params"])]
        return named, {}
    if isinstance(named_parameters, dict):
        named_parameters = named_parameters.items()
    pairs = list(named_parameters)
    by_param: dict = {}
    seen_names: dict = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_parameters must yield (name, parameter) pairs; item {i} "
                            f"is {type(pair).__name__}")
        name, param = pair
        if name in seen_names and seen_names[name] is not param:
            raise ValueError(f"named_parameters has the name '{name}' more than once (for "
                             "different parameters); names must be unique. With several "
                             "models, prefix the names (e.g. 'gen.' + name).")
        seen_names[name] = param
        by_param.setdefault(param, name)    # a tied parameter keeps its first name
    unnamed = [p for p in params if p not in by_param]
    if unnamed:
        shapes = ", ".join(str(list(p.shape)) for p in unnamed[:5])
        raise ValueError(
            f"named_parameters was given, but {len(unnamed)} parameter(s) of the optimizer are "
            f"not in it (shapes {shapes}{', ...' if len(unnamed) > 5 else ''}). Pass the "
            "named_parameters() of the model(s) the optimizer trains.")
    return [(by_param[p], p) for p in params], by_param


def _adasum_optimizer(optimizer, named, compression, passes, factor, process_set,
                      overlap_forward, settings):
    """``DistributedOptimizer(op=Adasum)`` (``adasum.py``), after refusing what it
    cannot combine with."""
    if overlap_forward or (overlap_forward is None and settings.overlap_forward):
        raise ValueError(
            "DistributedOptimizer(op=Adasum) does not combine with forward overlap "
            "(overlap_forward, MPIDDP_OVERLAP_FORWARD): each rank's local step must run "
            "before the deltas are combined, not after the next forward. Use "
            "overlap_forward=False (Adasum's reductions overlap backward instead)")
    if factor != 1.0:
        raise ValueError("gradient_predivide_factor is only supported with op=Average, "
                         "not op=Adasum")
    return wrap_adasum(optimizer, named, compression, passes, process_set)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable] = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: ReduceOp | int = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0,
                         sparse_as_dense: bool = False,
                         bucket_cap_mb: float | None = None,
                         process_set: ProcessSet | None = None,
                         overlap_forward: bool | str | None = None,
                         zero_stage: int = 0,
                         model: torch.nn.Module | None = None,
                         param_init_fn: Callable[[torch.nn.Module], None] | None = None,
                         hybrid_shard: bool = False,
                         mixed_precision: MixedPrecisionPolicy | None = None
                         ) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged across all ranks.

    Args:
        optimizer: a ``torch.optim.Optimizer`` instance (any class). The result is an instance
            of the same class sharing its state; use the result from now on.
        named_parameters: ``model.named_parameters()`` (or (name, parameter) pairs covering
            every parameter of ``optimizer``). Names identify gradients across ranks and in
            stall reports and timelines. Without it, names are generated from positions.
        compression: ``Compression.none`` (default), ``Compression.fp16`` or
            ``Compression.bf16``: the dtype gradients are reduced in; or
            ``Compression.powersgd(rank=...)``: gradient matrices travel as low-rank factors
            with error feedback (docs/powersgd.md; not with Adasum or ``zero_stage``).
        backward_passes_per_step: backward passes accumulated locally before one reduction;
            call ``step()`` after that many passes (scale the loss by 1/passes to average).
        op: ``mpiddp.Average`` (default) or ``mpiddp.Sum``; or ``mpiddp.Adasum``: each rank
            steps on its own gradient and the parameter deltas are combined with Adasum
            (Horovod's delta optimizer; docs/adasum.md). Not with ``overlap_forward``,
            ``gradient_predivide_factor`` or LBFGS.
        gradient_predivide_factor: divide gradients by this factor before the sum and by
            ``size / factor`` after it (Average only); keeps float16 sums in range.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors. Default False: they are reduced sparse, by gathering every rank's rows
            (``sparse_allreduce_async``); every rank must then have such a gradient.
        bucket_cap_mb: gradients that become ready are submitted together once they add up
            to this many MiB (and at the last gradient of a step). Fewer, larger submissions
            cost fewer engine cycles; smaller ones start reducing earlier. 0 submits every
            gradient on its own. Default None: 4 MiB; with ``zero_stage`` 1 or 2, 1 MiB
            (the sharded buckets, whose reduce-scatters and all-gathers the engine fuses);
            with ``zero_stage=3``, 25 MiB (also the unit gathered at each use). See
            docs/dev/training-internals.md and docs/benchmarks.md for measurements.
        process_set: average the gradients among this ``ProcessSet``'s ranks only (each set
            trains its own replica); default None: every rank. Only its ranks may build it.
        overlap_forward: True: ``step()`` returns before the gradients are averaged and
            each parameter is updated just before the next forward (or anything else) uses
            it, so the reductions overlap the next forward; results are the same as
            without it. ``"auto"``: the first steps try both, the faster is kept (agreed
            by all ranks; logged at INFO). Default None: the ``MPIDDP_OVERLAP_FORWARD``
            setting (off unless set). Not with a closure-based optimizer (LBFGS). See
            docs/training.md.
        zero_stage: 0 (default): every rank keeps the whole optimizer state. 1: each rank
            keeps the state of its shard (about 1/size) of the parameters' elements only;
            gradients are reduce-scattered, each rank steps its shard and the parameters
            are all-gathered. 2: also releases each full-size gradient once it is packed
            for its reduction. The result's param groups hold this rank's shards. Only
            elementwise optimizers (``mpiddp.elementwise_optimizer``); not with Adasum,
            LBFGS or custom compressors. 3: the parameters are sharded too: each rank keeps
            its chunk of every parameter (frozen ones too), and the full parameters are
            gathered just before their use (forward, backward) and released after it;
            needs ``model``. See docs/sharding.md.
        hybrid_shard: with ``zero_stage`` 1-3, shard within each node and keep a copy per
            node (FSDP's ``HYBRID_SHARD``): each rank holds 1/ranks-per-node of the state,
            and only the gradients' reduction crosses the network, at the unsharded
            path's bytes. Needs the same number of ranks on every node. Default False.
        model: with ``zero_stage=3`` (and only then), the model whose parameters the
            optimizer holds. Construction broadcasts the parameters it shards from
            the first rank of ``process_set``; ``model.state_dict()`` then gives the full
            parameters and ``model.load_state_dict`` takes them. ``named_parameters``
            defaults to ``model.named_parameters()``. A model built on the meta device
            (``with torch.device("meta")``) is given memory a bucket at a time, on the
            current CUDA device (else the CPU), and initialised on the first rank: no rank
            holds the whole model (docs/sharding.md).
        mixed_precision: with ``zero_stage=3`` (and only then), an
            ``mpiddp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` (FSDP2's):
            the shards (the masters the optimizer steps, checkpoints and
            ``model.state_dict()``) keep the parameters' dtype; the gathered parameters,
            forward and backward are ``param_dtype`` (gathers move its bytes), gradients
            are reduced in ``reduce_dtype``. Default None: no casts. See docs/sharding.md.
        param_init_fn: with a model on the meta device, called on each module with
            tensors there, after they have memory, to initialise its own parameters and
            buffers (default: the module's ``reset_parameters()``).

    Construction is collective: every rank must build its DistributedOptimizers in the same
    order, for the same parameters. Different models on different ranks raise
    ``mpiddp.TensorMismatchError`` on every rank, naming the first difference.

    Returns:
        The distributed optimizer: an instance of ``type(optimizer)`` sharing its state, with
        ``step``, ``zero_grad`` and ``add_param_group`` changed and ``synchronize()``,
        ``skip_synchronize()``, ``set_backward_passes_per_step()`` and the read-only
        ``backward_passes_per_step`` added.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` instance (e.g. its
            class); ``named_parameters`` yields something other than ``(str, tensor)``
            pairs; ``compression`` lacks ``compress``/``decompress``.
        ValueError: ``optimizer`` is already a DistributedOptimizer; a parameter already
            belongs to another live DistributedOptimizer; ``backward_passes_per_step`` is
            not a positive integer; ``op`` is not Average, Sum or Adasum; Adasum with
            forward overlap, a predivide factor or LBFGS; ``Compression.powersgd`` with
            Adasum, ``zero_stage`` or a matrix it cannot compress (complex);
            ``gradient_predivide_factor`` is not positive, or not 1.0 with Sum;
            ``bucket_cap_mb`` is negative; ``named_parameters`` repeats a name for different
            parameters or misses parameters of ``optimizer``; ``overlap_forward`` with
            ``torch.optim.LBFGS`` (it steps with a closure); ``zero_stage=3`` without
            ``model`` (or ``model`` without it), or with parameters that are not the
            model's; ``mixed_precision`` at stages 0-2 or with ``compression``.
        TensorMismatchError: the ranks' trainable parameters (names, shapes, dtypes) or
            settings (``backward_passes_per_step``, ``op``, ``compression`` and
            ``Compression.powersgd``'s settings, ``gradient_predivide_factor``) differ;
            raised on every rank.
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped during
            construction.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer instance, not "
                        f"{type(optimizer).__name__}"
                        + (" (pass the optimizer instance, not its class)"
                           if isinstance(optimizer, type) else ""))
    if "_mpiddp" in optimizer.__dict__:
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap it only once")
    _check_passes(backward_passes_per_step)
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown op {op!r}: use mpiddp.Average or mpiddp.Sum") from None
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(f"DistributedOptimizer supports op=Average or op=Sum (or op=Adasum), "
                         f"not {op.name}")
    factor = float(gradient_predivide_factor)
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, not {factor}")
    if factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if hybrid_shard not in (True, False):
        raise ValueError(f"hybrid_shard must be True or False, not {hybrid_shard!r}")
    if hybrid_shard and not zero_stage:
        raise ValueError("DistributedOptimizer(hybrid_shard=True) shards within each node: "
                         "it needs zero_stage=1, 2 or 3")
    model_state.check_model(zero_stage, model, optimizer)
    check_policy(mixed_precision, zero_stage, compression)
    check_meta_model(model, zero_stage, param_init_fn)
    if model is not None and named_parameters is None:
        named_parameters = list(model.named_parameters())
    if zero_stage and op == ReduceOp.ADASUM:
        raise ValueError("DistributedOptimizer(op=Adasum) cannot shard (zero_stage): Adasum "
                         "combines each rank's whole parameter deltas. Use zero_stage=0.")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be Compression.none, .fp16, .bf16 or an object with "
                        "compress() and decompress()")

    named, name_map = _names_for(optimizer, named_parameters)
    # Bad arguments are reported before a missing init(), as Horovod does.
    settings = runtime.require("DistributedOptimizer()").settings
    powersgd = isinstance(compression, PowerSGDCompressor)
    if powersgd:        # its refusals, before the Adasum and sharded paths' own
        check_powersgd(compression, named, op, zero_stage)
    if op == ReduceOp.ADASUM:
        return _adasum_optimizer(optimizer, named, compression, backward_passes_per_step,
                                 factor, process_set, overlap_forward, settings)
    if overlap_forward is None:
        overlap_forward = settings.overlap_forward
    if overlap_forward not in (True, False, "auto"):
        raise ValueError(f"overlap_forward must be True, False or 'auto', not "
                         f"{overlap_forward!r}")
    if overlap_forward == "auto" and isinstance(optimizer, torch.optim.LBFGS):
        overlap_forward = False      # it could only ever choose the standard path
    if overlap_forward and isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("DistributedOptimizer(overlap_forward=True) cannot wrap LBFGS: it "
                         "steps with a closure that evaluates the model, which a deferred "
                         "update would leave stale. Use overlap_forward=False.")
    for name, param in named:
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None and owner() is not None:
            # A forward-overlap update still deferred lands before another optimizer takes
            # the parameter over; one the script dropped is released by it.
            _complete_overlap(owner())
            if owner() is not None:
                raise ValueError(
                    f"parameter '{name}' already belongs to another live DistributedOptimizer "
                    f"({owner().prefix}); a gradient must be reduced by one optimizer only")
    # A stage-3 model whose optimizer is gone gives its parameters back (collective).
    model_state.give_back([param for _, param in named]
                            + (list(model.parameters()) if model is not None else []))
    model_state.check_not_released(named)
    if bucket_cap_mb is None:
        bucket_cap_mb = ZERO3_BUCKET_CAP_MB if zero_stage == 3 else \
            ZERO_BUCKET_CAP_MB if zero_stage else BUCKET_CAP_MB
    if not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, not {bucket_cap_mb!r}")
    sharded = zero_stage and (process_set is None or process_set.included())
    if sharded:
        check_shardable(optimizer, named, compression, zero_stage)
    if not (sharded and zero_stage == 3):
        check_not_meta(named)
    make_sync, extra = (ShardedSync, {"zero_stage": zero_stage, "hybrid": hybrid_shard,
                                      "mixed_precision": mixed_precision}) \
        if sharded else (PowerSGDSync if powersgd else GradientSync, {})
    sync = make_sync(next(_optimizer_index), compression, backward_passes_per_step, op, factor,
                     sparse_as_dense, float(bucket_cap_mb), process_set, **extra)
    sync.extra_names = name_map
    if process_set is None or process_set.included():
        _check_same_everywhere(sync, named, "construction")     # collective
        if sharded and zero_stage == 3 and any(p.is_meta for p in model.parameters()):
            sync.gathers.meta_init = MetaInit(model, param_init_fn,
                                              initialises=runtime.set_rank(process_set) == 0)
        sync.add(named)
    # else: this rank is outside the optimizer's process set: it trains on its own, a plain
    # local optimizer (Horovod's behaviour), so every rank can run the same script.

    cls = _distributed_class(type(optimizer), ShardedOptimizer if sharded
                             else _DistributedOptimizer)
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__       # one optimizer, two views: state is shared
    patched = wrapped.__dict__.get("step")
    if patched is not None and hasattr(patched, "_wrapped_by_lr_sched"):
        # An LR scheduler built on the original replaced the instance's step; route it to
        # the distributed step (keeping the marker the scheduler checks).
        wrapped_ref = weakref.ref(wrapped)

        def step(*args, **kwargs):
            opt = wrapped_ref()
            opt._opt_called = True
            return cls.step(opt, *args, **kwargs)
        step._wrapped_by_lr_sched = True
        wrapped.__dict__["step"] = step
    wrapped.__dict__["_mpiddp"] = sync
    # Horovod's parameter -> name map, read by scripts and tests.
    wrapped.__dict__["_parameter_names"] = {param: name for name, param in named}
    if powersgd:
        attach_state(wrapped)       # state_dict() carries the PowerSGD memories
    if sharded:
        shard_param_groups(wrapped)
        install_clip_guard()
        if zero_stage == 3:
            model_state.attach_model(wrapped, model)
        if overlap_forward:
            sync.gathers.enable_overlap()
        return wrapped
    if overlap_forward and sync.params:
        # The wrapped class's own step, run parameter subset by subset in the next forward.
        wrapped_ref = weakref.ref(wrapped)
        sync.schedule = ForwardOverlap(
            sync, lambda: super(_DistributedOptimizer, wrapped_ref()).step(),
            auto=overlap_forward == "auto")
        sync.schedule.attach(wrapped)
    return wrapped

