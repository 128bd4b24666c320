"""Activation checkpointing for PyTorch Lightning that proves recomputation reproduces the forward pass.

The configuration, the checkpointing layer and the checks import without Lightning; the strategies and the monitor
(:mod:`lightning_ckpt_determinism.lightning`) are imported the first time one of them is used.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ckpt_determinism.checkpointing import (
    apply_activation_checkpointing,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
    remove_activation_checkpointing,
)
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
)
from lightning_ckpt_determinism.verify import (
    CAUSE_HINTS,
    Cause,
    RecomputationReport,
    RecomputationSentinel,
    RegionReport,
    SentinelRegion,
    SentinelReport,
    check_recomputation,
    gradient_divergence,
    recomputation_sentinel,
)

if TYPE_CHECKING:
    from lightning_ckpt_determinism.lightning import (
        ActivationCheckpointingMixin,
        CheckpointingCLI,
        DDPCheckpointingStrategy,
        FSDPCheckpointingStrategy,
        ModelParallelCheckpointingStrategy,
        RecomputationMonitor,
        SingleDeviceCheckpointingStrategy,
    )

__version__ = "0.1.0"

_LIGHTNING_LAYER = {
    "ActivationCheckpointingMixin": "lightning_ckpt_determinism.lightning.strategies",
    "CheckpointingCLI": "lightning_ckpt_determinism.lightning.cli",
    "DDPCheckpointingStrategy": "lightning_ckpt_determinism.lightning.strategies",
    "FSDPCheckpointingStrategy": "lightning_ckpt_determinism.lightning.strategies",
    "ModelParallelCheckpointingStrategy": "lightning_ckpt_determinism.lightning.strategies",
    "RecomputationMonitor": "lightning_ckpt_determinism.lightning.monitor",
    "SingleDeviceCheckpointingStrategy": "lightning_ckpt_determinism.lightning.strategies",
}

__all__ = [
    "CAUSE_HINTS",
    "ActivationCheckpointingMixin",
    "Cause",
    "CheckpointingCLI",
    "CheckpointingConfig",
    "CheckpointingConfigError",
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "LightningCkptDeterminismWarning",
    "ModelParallelCheckpointingStrategy",
    "RecomputationDivergenceError",
    "RecomputationMonitor",
    "RecomputationReport",
    "RecomputationSentinel",
    "RegionReport",
    "SentinelRegion",
    "SentinelReport",
    "SingleDeviceCheckpointingStrategy",
    "__version__",
    "apply_activation_checkpointing",
    "check_recomputation",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "gradient_divergence",
    "recomputation_sentinel",
    "remove_activation_checkpointing",
]


def __getattr__(name: str) -> Any:
    """The Lightning layer's public names, imported on first use (PEP 562)."""
    module = _LIGHTNING_LAYER.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_LAYER})
