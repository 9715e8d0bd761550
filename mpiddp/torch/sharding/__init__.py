"""``DistributedOptimizer(zero_stage=1|2|3)``: the layout of shards (``layout.py``), the
reduce-scatters and the early steps (``sync.py``), stages 1-2's parameter gathers
(``gathers.py``), stage 3's guard, gathers and model (``param_guard.py``, ``param_gathers.py``,
``model_state.py``), the optimizer's methods (``optimizer.py``) and its state (``state.py``),
the guard on torch's clipping (``clip_guard.py``). docs/dev/sharding.md, docs/dev/zero3.md."""
