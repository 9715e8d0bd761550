"""Framework glue for PyTorch, in rooms by floor (docs/dev/architecture.md): ``core`` (what all
share), ``compression``, ``ops`` (the tensor-collective API), ``gradients`` (how and when
gradients are reduced), ``sharding`` (``zero_stage``), ``optimizer`` (``DistributedOptimizer``),
``features`` (elastic snapshots, ``SyncBatchNorm``, ``profile``)."""
import sys as _sys

from .features import elastic, sync_batch_norm
from .ops import functions

# The module paths Horovod's torch package has (horovod.torch.functions, .elastic,
# .sync_batch_norm) keep working here as mpiddp.torch.functions, ...: their modules moved into
# rooms. (mpiddp.torch.compression and mpiddp.torch.optimizer are where they were.)
for _module in (functions, elastic, sync_batch_norm):
    _sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
del _module
