"""What every room of the torch layer shares: CUDA stream ordering (``streams``), tensor <->
buffer views (``views``), generated names (``naming``), the wrapped class's own step on a
subset of parameters (``subset_step``), the rule for optimizers that step during backward
(``step_timing``) and the registry of live sharded optimizers (``sharded_registry``). Imports
nothing of the torch layer."""
