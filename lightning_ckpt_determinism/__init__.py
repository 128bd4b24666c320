"""Activation checkpointing for PyTorch Lightning that proves recomputation reproduces the forward pass.

The configuration, the checkpointing layer and the checks import without Lightning; the strategies and the monitor
(:mod:`lightning_ckpt_determinism.lightning`) are imported the first time one of them is used.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ckpt_determinism.checkpointing import (
    CheckpointingPlan,
    apply_activation_checkpointing,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
    plan_activation_checkpointing,
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

# Type checkers read the Lightning layer from its modules (`__getattr__` imports it at run time), the strategies and
# the monitor as their `__all__` gives them, so that a new strategy needs no line here but its name below.
if TYPE_CHECKING:
    from lightning_ckpt_determinism.lightning.cli import CheckpointingCLI as CheckpointingCLI
    from lightning_ckpt_determinism.lightning.monitor import *  # noqa: F403
    from lightning_ckpt_determinism.lightning.strategies import *  # noqa: F403

__version__ = "0.1.0"

__all__ = [
    "CAUSE_HINTS",
    "Cause",
    "CheckpointingConfig",
    "CheckpointingConfigError",
    "CheckpointingPlan",
    "LightningCkptDeterminismWarning",
    "RecomputationDivergenceError",
    "RecomputationReport",
    "RecomputationSentinel",
    "RegionReport",
    "SentinelRegion",
    "SentinelReport",
    "__version__",
    "apply_activation_checkpointing",
    "check_recomputation",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "gradient_divergence",
    "plan_activation_checkpointing",
    "recomputation_sentinel",
    "remove_activation_checkpointing",
]
# The Lightning layer's public API (`lightning_ckpt_determinism.lightning.__all__`, which a test compares), imported
# on first use.
_LIGHTNING_LAYER = (
    "ActivationCheckpointingMixin",
    "CheckpointingCLI",
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "ModelParallelCheckpointingStrategy",
    "RecomputationMonitor",
    "SingleDeviceCheckpointingStrategy",
)
__all__ += _LIGHTNING_LAYER


def __getattr__(name: str) -> Any:
    """The Lightning layer's public names, imported on first use (PEP 562)."""
    if name not in _LIGHTNING_LAYER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("lightning_ckpt_determinism.lightning"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_LAYER})
