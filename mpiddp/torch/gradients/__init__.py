"""How and when gradients are reduced: ``GradientSync`` (hooks, buckets, reductions, writing
averages back; ``sync.py``) and its schedules: forward overlap (``forward_overlap.py``), its
automatic trial (``overlap_trial.py``) and piece size (``cycle_budget.py``)."""
