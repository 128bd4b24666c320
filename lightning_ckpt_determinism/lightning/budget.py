"""A ``memory_budget`` under a strategy: the first training batch measures, the second one on runs the plan.

Every candidate the strategy checkpointed is measured while the first training batch runs
(:class:`~lightning_ckpt_determinism.checkpointing.measure.ActivationMeter`). When the second batch starts, each
rank's figures are reduced by their maximum through the strategy, so that every rank (DDP, FSDP, tensor parallelism)
plans from the same figures and applies the same plan, before any forward of that batch: the candidates the plan
leaves plain are made plain. Rank zero logs the plan in one line.
"""

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ckpt_determinism.checkpointing.budget import CheckpointingPlan, plan_from_figures
from lightning_ckpt_determinism.checkpointing.measure import ActivationMeter, RegionFigures
from lightning_ckpt_determinism.checkpointing.wrapper import remove_activation_checkpointing
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning
from lightning_ckpt_determinism.lightning.parallel import all_reduce

__all__ = ["BudgetedCheckpointing"]


class BudgetedCheckpointing:
    """Measures a strategy's checkpointed regions in the first training batch and applies the plan at the second.

    Args:
        config: The strategy's config, with its ``memory_budget``.

    Example::

        >>> budgeted = BudgetedCheckpointing(CheckpointingConfig(classes=["Block"], memory_budget="1GiB"))
        >>> budgeted.plan is None
        True
    """

    def __init__(self, config: CheckpointingConfig) -> None:
        self.config = config
        self.plan: CheckpointingPlan | None = None
        self._meter: ActivationMeter | None = None
        self._measuring = contextlib.ExitStack()

    def batch_started(self, strategy: Any, root: nn.Module, regions: Mapping[str, nn.Module]) -> list[str]:
        """Start measuring at the first training batch; plan and apply at the second (on every rank alike).

        Args:
            strategy: The strategy, through which the figures are reduced over ranks.
            root: The LightningModule; its parameters and buffers are not activations.
            regions: The regions the strategy checkpointed, by name.

        Returns:
            The regions the plan made plain at this batch (none at other batches).
        """
        if self.plan is not None or not regions:
            return []
        if self._meter is None:
            config = self.config
            self._meter = ActivationMeter(
                root, regions, config.save_ops, keep_data_dependent=config.keep_data_dependent
            )
            self._measuring.enter_context(self._meter.measuring())
            return []
        self._measuring.close()
        self.plan = plan = self._planned(_reduced(strategy, self._meter.figures()))
        plain = [name for name in regions if name not in plan.checkpointed]
        for name in plain:
            remove_activation_checkpointing(regions[name])
        rank_zero_info(f"lightning_ckpt_determinism: {plan.summary()}.")
        return plain

    def stop(self) -> None:
        """Stop measuring (a fit that ended within its first batch); the plan stays readable."""
        self._measuring.close()

    def _planned(self, figures: list[RegionFigures]) -> CheckpointingPlan:
        # Every rank plans alike; the warning of an unmeetable budget is shown once, on rank zero.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            plan = plan_from_figures(figures, self.config)
        for warning in caught:
            rank_zero_warn(str(warning.message), category=warning.category)
        return plan


def _reduced(strategy: Any, figures: list[RegionFigures]) -> list[RegionFigures]:
    """Each figure's maximum over ranks (one collective on several processes)."""
    local = torch.tensor(
        [[entry.plain_bytes, entry.checkpointed_bytes, entry.flops, entry.calls] for entry in figures],
        dtype=torch.int64,
        device=strategy.root_device,
    )
    reduced = all_reduce(strategy)(local, "max").tolist()
    return [
        RegionFigures(entry.name, int(plain), int(kept), int(flops), int(calls))
        for entry, (plain, kept, flops, calls) in zip(figures, reduced, strict=True)
    ]
