"""The Trainer's optimizer hyperparameters and learning-rate schedulers, which a ``training_step`` may change."""

import copy
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
        self._groups = [
            (group, {key: _copied(value) for key, value in group.items() if key != "params"})
            for optimizer in trainer.optimizers
            for group in optimizer.param_groups
        ]
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._schedulers = [(scheduler, copy.deepcopy(scheduler.state_dict())) for scheduler in schedulers]

    def restore(self) -> None:
        """Put the captured settings back; can be called any number of times."""
        for group, saved in self._groups:
            for key in [key for key in group if key != "params" and key not in saved]:
                del group[key]  # set by the step
            for key, value in saved.items():
                current = group.get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                    with torch.no_grad():
                        current.copy_(value)  # a tensor learning rate (`capturable`) stays the same object
                else:
                    group[key] = _copied(value)
        for scheduler, state in self._schedulers:
            scheduler.load_state_dict(copy.deepcopy(state))


def _copied(value: Any) -> Any:
    """A hyperparameter as it is now: a tensor's values, a container's contents."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.copy(value)
