"""The Trainer's optimizer hyperparameters and learning-rate schedulers, which a ``training_step`` may change."""

from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["OptimizerSettings"]


class OptimizerSettings:
    """What the Trainer's optimizers' parameter groups hold besides their parameters (``lr``, ``momentum`` ...) and
    the states of its learning-rate schedulers, captured now; :meth:`restore` puts them back.

    A check reruns ``training_step``: one that steps a scheduler or sets a learning rate by hand would do so again.
    The optimizers' per-parameter state (momentum buffers) is left alone: only the optimizer step changes it, and
    the check runs before that step.

    Args:
        trainer: The Trainer.

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> trainer.strategy.optimizers = [optimizer]
        >>> settings = OptimizerSettings(trainer)
        >>> optimizer.param_groups[0]["lr"] = 0.05
        >>> settings.restore()
        >>> optimizer.param_groups[0]["lr"]
        0.1
    """

    def __init__(self, trainer: "pl.Trainer") -> None:
        # Each value with a copy of what it holds: a tensor (a `capturable` lr, betas) is written back into itself,
        # so that it stays the object a compiled optimizer step guards on.
        self._groups = [
            (group, {key: (value, _values(value)) for key, value in group.items() if key != "params"})
            for optimizer in trainer.optimizers
            for group in optimizer.param_groups
        ]
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._schedulers = [(scheduler, _values(scheduler.state_dict())) for scheduler in schedulers]

    def restore(self) -> None:
        """Put the captured settings back; can be called any number of times."""
        for group, saved in self._groups:
            for key in [key for key in group if key != "params" and key not in saved]:
                del group[key]  # set by the step
            for key, (value, held) in saved.items():
                group[key] = _put_back(value, held)
        for scheduler, state in self._schedulers:
            scheduler.load_state_dict(_values(state))


def _values(value: Any) -> Any:
    """What ``value`` holds as it is now: tensors cloned, dicts, lists and tuples copied item by item, anything else
    (a number, a string, a lambda's object, a module a scheduler holds) by reference, never deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _values(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(map(_values, value))
    return value


def _put_back(value: Any, held: Any) -> Any:
    """``value`` (a setting as captured) holding ``held`` again: a tensor, or the tensors of a tuple, written back in
    place; anything else given as copied."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.copy_(held)
        return value
    if type(value) is tuple and any(isinstance(item, torch.Tensor) for item in value):
        return tuple(map(_put_back, value, held))
    return _values(held)
