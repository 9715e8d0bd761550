"""The optimizer family: ``DistributedOptimizer`` (``wrap.py``) and the methods it puts in front
of the user's optimizer class (``methods.py``); the Adasum delta optimizer (``adasum.py``); when
an optimizer that can step early does so (``step_timing.py``). The sharded optimizers
(``zero_stage``) are in ``..sharding``."""
from .wrap import DistributedOptimizer  # noqa: F401
from .methods import _DistributedOptimizer  # noqa: F401

__all__ = ["DistributedOptimizer"]
