"""``DistributedOptimizer`` (``wrap.py``), which builds every kind: the standard and forward
overlap paths and PowerSGD (``..gradients``), the sharded optimizers (``..sharding``) and the
Adasum delta optimizer (``adasum.py``)."""
from ..gradients.optimizer import _DistributedOptimizer  # noqa: F401
from .wrap import DistributedOptimizer  # noqa: F401

__all__ = ["DistributedOptimizer"]
