"""Stage 3 for a model built on the meta device (``with torch.device("meta"): model = Net()``):
construction gives each parameter memory a bucket at a time, so no rank ever holds the whole
model (docs/sharding.md, "A model too large to build whole").

When a bucket is laid out (``ParamGathers.adopt``), every module that owns one of its
parameters and still has tensors on the meta device gets real memory for its own parameters
and buffers, and the set's first rank initialises it (``param_init_fn(module)``, by default
its ``reset_parameters()``); the bucket's broadcast from that rank then gives every rank the
values, and each keeps its chunk. Modules are initialised whole (their initialisation may
read any of their tensors), once, in the order the model registers them among those a bucket
needs. A parameter another module initialised before (a tied weight) keeps that module's
values. What no bucket holds (buffers, parameters stage 3 keeps whole) is broadcast from the
first rank at the end (``finish``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

META_INIT_METHOD = "reset_parameters"


def on_meta(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a parameter or buffer of its own on the meta device."""
    return any(t is not None and t.is_meta
               for t in list(module._parameters.values()) + list(module._buffers.values()))


def check_meta_model(model: Optional[torch.nn.Module], zero_stage: int,
                     param_init_fn: Optional[Callable]) -> None:
    """``DistributedOptimizer``'s checks for a model on the meta device, before any collective:
    stage 3 only, and every module with tensors there has an initialisation."""
    if param_init_fn is not None and zero_stage != 3:
        raise ValueError(f"DistributedOptimizer(param_init_fn=...) is for zero_stage=3 (a "
                         f"model built on the meta device), not zero_stage={zero_stage}")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError("param_init_fn must be a function taking a module")
    if model is None or zero_stage != 3:
        return
    if param_init_fn is None:
        lacking = [f"{name or '<model>'} ({type(module).__name__})"
                   for name, module in model.named_modules()
                   if on_meta(module) and not callable(getattr(module, META_INIT_METHOD, None))]
        if lacking:
            raise ValueError(
                f"DistributedOptimizer(zero_stage=3): modules {lacking[:3]} have parameters or "
                "buffers on the meta device and no reset_parameters() to initialise them; "
                "pass param_init_fn=<a function that initialises one module's own tensors>")


def check_not_meta(named: list) -> None:
    """Stages 0-2 train the parameters where they are: none may be on the meta device."""
    meta = [name for name, param in named if param.is_meta]
    if meta:
        raise ValueError(f"parameters {meta[:3]} are on the meta device: only "
                         "DistributedOptimizer(zero_stage=3, model=model) builds a model from "
                         "there (each rank materialising its shards); or materialise the "
                         "model first (model.to_empty(device=...) and initialise it)")


def init_device() -> torch.device:
    """Where a meta model's tensors get memory: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def give_memory(param: torch.Tensor, device: torch.device) -> None:
    """``param`` (on the meta device) gets uninitialised memory on ``device``, keeping its
    identity, class and attributes (``.data =`` cannot cross from meta to a device: the
    tensors are swapped, then the Python object's class and attributes put back). Hooks
    registered on it before are lost: ``ShardedSync.add`` lays a meta model out first."""
    cls, attributes = type(param), param.__dict__
    torch.utils.swap_tensors(param, torch.nn.Parameter(
        torch.empty_like(param, device=device), requires_grad=param.requires_grad))
    if type(param) is not cls:
        param.__class__ = cls
    param.__dict__ = attributes


class MetaInit:
    """Gives a meta model's modules memory and values as their buckets are laid out (module
    docstring). ``initialises``: this rank runs the initialisations (the set's first rank;
    the others receive the values)."""

    def __init__(self, model: torch.nn.Module, param_init_fn: Optional[Callable],
                 initialises: bool):
        self.device = init_device()
        self.init_fn = param_init_fn or (lambda module: getattr(module, META_INIT_METHOD)())
        self.initialises = initialises
        self.modules = list(model.modules())
        self.order = {id(module): index for index, module in enumerate(self.modules)}
        self.owners: dict = {}            # id(parameter) -> the modules holding it, in order
        for module in self.modules:
            for param in module._parameters.values():
                if param is not None:
                    self.owners.setdefault(id(param), []).append(module)
        self.done: set = set()            # id(module) initialised
        self.materialised: list = []      # tensors given memory here

    def materialise(self, params: list, sharded: Callable, internal) -> None:
        """Give ``params`` (one bucket's) memory and, on the first rank, values: the modules
        owning any of them on the meta device are initialised whole, in registration order.
        ``sharded(param)``: whether a bucket already holds the parameter's values (a tied
        weight: the initialisation writes elsewhere); ``internal``: the guard's pass."""
        needed = {id(module): module for param in params if param.is_meta
                  for module in self.owners.get(id(param), [])}
        for key in sorted(needed, key=self.order.__getitem__):
            if key not in self.done:
                self._initialise(needed[key], sharded, internal)

    def finish(self, model: torch.nn.Module, sharded: Callable, internal) -> list:
        """Initialise what is still on the meta device (modules whose tensors no bucket
        holds); returns (name, tensor) of everything materialised that stays whole (buffers,
        unsharded parameters), for the caller to broadcast from the first rank."""
        for module in self.modules:
            if id(module) not in self.done and on_meta(module):
                self._initialise(module, sharded, internal)
        materialised = {id(t) for t in self.materialised}
        whole = [(name, t) for name, t in model.named_parameters()
                 if id(t) in materialised and not sharded(t)]
        return whole + [(name, t) for name, t in model.named_buffers() if id(t) in materialised]

    def _initialise(self, module: torch.nn.Module, sharded: Callable, internal) -> None:
        """Memory for ``module``'s own tensors on the meta device; on the first rank its
        initialisation, which leaves alone the parameters an earlier module initialised (kept
        and put back) or a bucket already holds (a stand-in takes the writes)."""
        self.done.add(id(module))
        # A tied parameter takes its first module's initialisation, as when the model is
        # built whole (the later module's own weight is replaced by the tie): that one first.
        for param in module._parameters.values():
            if param is not None and param.is_meta:
                for owner in self.owners[id(param)]:
                    if owner is module:
                        break
                    if id(owner) not in self.done:
                        self._initialise(owner, sharded, internal)
        kept, parked = [], []
        with internal(), torch.no_grad():
            for param in module._parameters.values():
                if param is None:
                    continue
                if param.is_meta:
                    give_memory(param, self.device)
                    self.materialised.append(param)
                elif self.initialises and sharded(param):
                    parked.append((param, param.data))
                    param.data = torch.empty_like(param)
                elif self.initialises:
                    kept.append((param, param.detach().clone()))
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=self.device)
                    self.materialised.append(module._buffers[name])
            if self.initialises:
                self.init_fn(module)
                for param, value in kept:
                    param.copy_(value)
                for param, data in parked:
                    param.data = data
