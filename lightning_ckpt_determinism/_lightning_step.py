"""Rerun a LightningModule's training step for a check: its loss, without logging anything."""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["SkippedStep", "logging_suppressed", "training_step_loss"]


class SkippedStep(Exception):
    """The training step returned ``None``: Lightning skips the batch, so the check does too."""


def training_step_loss(pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> torch.Tensor:
    """The loss of the LightningModule's own ``training_step``: its tensor, or ``["loss"]`` of its dict."""
    output = pl_module.training_step(batch, batch_idx)
    if output is None:
        raise SkippedStep
    return output["loss"] if isinstance(output, Mapping) else output


@contextlib.contextmanager
def logging_suppressed(pl_module: "pl.LightningModule") -> Iterator[None]:
    """Make ``self.log`` and ``self.log_dict`` do nothing, so the check adds nothing to the training metrics."""
    names = ("log", "log_dict")
    own = {name: pl_module.__dict__[name] for name in names if name in pl_module.__dict__}
    for name in names:
        setattr(pl_module, name, _ignore)
    try:
        yield
    finally:
        for name in names:
            if name in own:
                setattr(pl_module, name, own[name])
            else:
                delattr(pl_module, name)


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
