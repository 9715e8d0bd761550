"""``DistributedOptimizer(zero_stage=1|2)``: the layout of shards (``layout.py``), the
reduce-scatters and the early steps (``sync.py``), the parameter gathers (``gathers.py``), the
optimizer's methods (``optimizer.py``) and its state (``state.py``), the guard on torch's
clipping (``clip_guard.py``) and the registry of live sharded optimizers (``registry.py``).
docs/dev/sharding.md."""
