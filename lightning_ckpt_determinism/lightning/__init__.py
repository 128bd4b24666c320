"""Everything that imports Lightning: the checkpointing strategies, the monitor and the CLI, with what they need.

The strategies and the monitor are given as their modules' ``__all__`` says; the package root gives them lazily.
Importing this layer registers the strategies' names in Lightning's strategy registry
(:mod:`~lightning_ckpt_determinism.lightning.registry`).
"""

from lightning_ckpt_determinism.lightning import monitor, strategies
from lightning_ckpt_determinism.lightning.cli import CheckpointingCLI
from lightning_ckpt_determinism.lightning.monitor import *  # noqa: F403
from lightning_ckpt_determinism.lightning.registry import register_strategies
from lightning_ckpt_determinism.lightning.strategies import *  # noqa: F403

register_strategies()

# Extended as mypy reads it, so that a strategy added to its module's `__all__` is exported without another line.
__all__ = ["CheckpointingCLI"]
__all__ += monitor.__all__
__all__ += strategies.__all__
