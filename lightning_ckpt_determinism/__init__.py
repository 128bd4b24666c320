"""Activation checkpointing for PyTorch Lightning that proves recomputation reproduces the forward pass."""

from lightning_ckpt_determinism.attribution import CAUSE_HINTS, RegionReport
from lightning_ckpt_determinism.callback import RecomputationMonitor
from lightning_ckpt_determinism.check import RecomputationReport, check_recomputation, gradient_divergence
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
)
from lightning_ckpt_determinism.strategy import (
    ActivationCheckpointingMixin,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    SingleDeviceCheckpointingStrategy,
)
from lightning_ckpt_determinism.wrapping import (
    apply_activation_checkpointing,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
    remove_activation_checkpointing,
)

__version__ = "0.1.0"

__all__ = [
    "CAUSE_HINTS",
    "ActivationCheckpointingMixin",
    "CheckpointingConfig",
    "CheckpointingConfigError",
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "LightningCkptDeterminismWarning",
    "ModelParallelCheckpointingStrategy",
    "RecomputationDivergenceError",
    "RecomputationMonitor",
    "RecomputationReport",
    "RegionReport",
    "SingleDeviceCheckpointingStrategy",
    "__version__",
    "apply_activation_checkpointing",
    "check_recomputation",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "gradient_divergence",
    "remove_activation_checkpointing",
]
