"""Everything that imports Lightning: the checkpointing strategies and the monitor, with what they need."""

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
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "ModelParallelCheckpointingStrategy",
    "RecomputationMonitor",
    "SingleDeviceCheckpointingStrategy",
]
