"""Everything that imports Lightning: the checkpointing strategies, the monitor and the CLI, with what they need."""

from lightning_ckpt_determinism.lightning.cli import CheckpointingCLI
from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor
from lightning_ckpt_determinism.lightning.strategies import (
    ActivationCheckpointingMixin,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    SingleDeviceCheckpointingStrategy,
)

__all__ = [
    "ActivationCheckpointingMixin",
    "CheckpointingCLI",
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "ModelParallelCheckpointingStrategy",
    "RecomputationMonitor",
    "SingleDeviceCheckpointingStrategy",
]
