"""Applying activation checkpointing: selecting modules, the region wrapper and its recompute contexts.

This layer imports neither Lightning nor any check: it runs on plain PyTorch, eagerly or under ``torch.compile``.
"""

from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan, plan_activation_checkpointing
from lightning_ckpt_determinism.checkpointing.selection import apply_activation_checkpointing, select_modules
from lightning_ckpt_determinism.checkpointing.wrapper import (
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
    remove_activation_checkpointing,
)

__all__ = [
    "CheckpointingPlan",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "plan_activation_checkpointing",
    "remove_activation_checkpointing",
    "select_modules",
]
