"""An optimizer's own step on some of its parameters only: what forward overlap's deferred
update, Adasum's local steps and the sharded optimizers' early steps all run."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def hyperparameters(param_groups: list) -> list[dict]:
    """Every param group's settings (all but ``params``), as they are now."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in param_groups]


def same_hyperparameters(a: list[dict], b: list[dict]) -> bool:
    """Whether two ``hyperparameters()`` records hold the same values (tensor-valued ones,
    such as a capturable optimizer's learning rate, compared by value)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for key, value in x.items():
            other = y[key]
            if torch.is_tensor(value) or torch.is_tensor(other):
                if not (torch.is_tensor(value) and torch.is_tensor(other)
                        and torch.equal(value, other)):
                    return False
            elif value != other:
                return False
    return True


def step_subset(param_groups: list, step: Callable[[], Any], params,
                options: Optional[list[dict]] = None) -> Any:
    """Run ``step`` (the wrapped optimizer class's own step) on ``params`` only: each group's
    parameter list is cut to them meanwhile and, when ``options`` (a ``hyperparameters()``
    record) is given, the groups take those settings instead of their current ones. The
    groups are restored afterwards, whatever happens."""
    chosen = {id(param) for param in params}
    saved = [dict(group) for group in param_groups]
    try:
        for index, group in enumerate(param_groups):
            subset = [param for param in group["params"] if id(param) in chosen]
            if options is not None:
                group.clear()
                group.update(options[index])
            group["params"] = subset
        with torch.no_grad():
            return step()
    finally:
        for group, before in zip(param_groups, saved):
            group.clear()
            group.update(before)
