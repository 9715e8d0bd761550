"""How and when gradients are reduced: ``GradientSync`` (hooks, buckets, reductions, writing
averages back; ``sync.py``), the optimizer class whose ``step`` waits for it (``optimizer.py``)
and its schedules: forward overlap (``forward_overlap.py``), its automatic trial
(``overlap_trial.py``) and piece size (``cycle_budget.py``); PowerSGD (``powersgd.py``)."""
