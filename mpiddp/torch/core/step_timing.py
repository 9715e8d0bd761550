"""When an optimizer that can step during backward does: one rule for Adasum's local steps
(``adasum.py``) and the sharded optimizers' early steps (``..sharding.sync``).

Stepping a parameter (or a shard) during backward, as soon as what it needs has arrived,
overlaps the step and what follows it with the rest of backward. It is only right when
nothing between the end of backward and ``step()`` needs every gradient first or changes
them: AMP's ``GradScaler`` (it unscales them and may skip the step), clipping by the global
norm, a script calling ``optimizer.synchronize()`` to do either, or a learning rate set after
backward. The first ``step()`` decides, from what the script did before it:

* ``EARLY`` when nothing of the kind happened: from then on parameters are stepped during
  backward;
* ``AT_STEP`` otherwise: every step runs at ``step()``, as on the standard path.

Until the first ``step()`` every step runs at ``step()``. Once ``EARLY``, a gradient changed
after its parameter was stepped is refused (``check_untouched``): its change would be
silently lost.
"""
from __future__ import annotations

from typing import Optional

import torch

EARLY, AT_STEP = "early", "at_step"


class StepTiming:
    """The rule (see the module docstring) for one optimizer."""

    def __init__(self, owner: str):
        self.owner = owner                 # how errors name the optimizer
        self.mode: Optional[str] = None    # decided by the first step()
        self.touched = False               # this step: gradients synchronized by hand, changed
        self.stepped: dict = {}            # name -> (gradient, its version when stepped)

    @property
    def early(self) -> bool:
        return self.mode == EARLY

    def touch(self) -> None:
        """The script synchronized (or is about to change) the gradients by hand this step."""
        self.touched = True

    def decide(self, needs_whole: bool = False) -> str:
        """At ``step()``: the mode, decided now if this is the first step (``needs_whole``:
        the caller saw something that needs every gradient first, such as a GradScaler)."""
        if self.mode is None:
            self.mode = AT_STEP if (needs_whole or self.touched) else EARLY
        return self.mode

    def note_stepped(self, name: str, grad: Optional[torch.Tensor]) -> None:
        """``name`` was stepped early on ``grad``: remember its version."""
        if grad is not None:
            self.stepped[name] = (grad, grad._version)

    def check_untouched(self) -> None:
        """Raise if a gradient stepped early was changed since (clipped, unscaled): that
        change would be silently ignored."""
        for name, (grad, version) in self.stepped.items():
            if grad._version != version:
                raise RuntimeError(
                    f"{self.owner}: the gradient of '{name}' was changed after backward "
                    "(clipped or unscaled?), but it had already been stepped during backward "
                    "(the first step() showed nothing that needs the gradients first). Call "
                    "optimizer.synchronize() after backward from the first step on, before "
                    "changing gradients: every step then runs at step()")

    def end_step(self) -> None:
        self.touched = False
        self.stepped = {}
