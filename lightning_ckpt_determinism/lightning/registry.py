"""The package's strategies under names in Lightning's strategy registry, as Lightning's ecosystem packages register
theirs: ``Trainer(strategy="ddp_checkpointing")`` and YAML ``strategy: ddp_checkpointing``.

A registered name checkpoints with ``classes: auto`` (the model's transformer layers, see
:func:`~lightning_ckpt_determinism.checkpointing.auto.auto_layers`); give the strategy object, or its
``class_path`` with ``checkpointing`` in YAML, to choose other modules. The names are registered when the Lightning
layer is imported (the package root imports it on the first use of a Lightning name, such as
``RecomputationMonitor``), never by importing the package root alone.
"""

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.lightning.strategies import (
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    SingleDeviceCheckpointingStrategy,
)

__all__ = ["REGISTERED", "register_strategies", "registered_name"]

REGISTERED: dict[str, type[Strategy]] = {
    "single_device_checkpointing": SingleDeviceCheckpointingStrategy,
    "ddp_checkpointing": DDPCheckpointingStrategy,
    "fsdp_checkpointing": FSDPCheckpointingStrategy,
    "model_parallel_checkpointing": ModelParallelCheckpointingStrategy,
}
"""Each registered name and its strategy."""

# The stock strategy each of the package's strategies is built on, by the names Lightning registers for it.
_STOCK = {"single_device": "single_device_checkpointing", "ddp": "ddp_checkpointing", "fsdp": "fsdp_checkpointing"}


def register_strategies() -> None:
    """Register :data:`REGISTERED` in Lightning's ``StrategyRegistry``, each with ``classes: auto`` (again is a no-op).

    Example::

        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> register_strategies()
        >>> StrategyRegistry.get("ddp_checkpointing").checkpointing.classes
        'auto'
    """
    for name, strategy in REGISTERED.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name,
                strategy,
                description=f"{strategy.__name__} with `classes: auto` (lightning_ckpt_determinism)",
                checkpointing=CheckpointingConfig(classes="auto"),
            )


def registered_name(stock: str) -> str | None:
    """The package's registered name for Lightning's stock strategy ``stock`` (a name or class name), if any.

    Args:
        stock: A strategy name (``"ddp"``, ``"ddp_spawn"``) or class name (``"DDPStrategy"``).

    Example::

        >>> registered_name("DDPStrategy"), registered_name("ddp_spawn"), registered_name("deepspeed")
        ('ddp_checkpointing', 'ddp_checkpointing', None)
    """
    key = stock.lower().removesuffix("strategy").removeprefix("lightning.pytorch.strategies.")
    if key in ("modelparallel", "model_parallel"):
        return "model_parallel_checkpointing"
    if key in ("singledevice", "single_device"):
        return "single_device_checkpointing"
    return next((name for base, name in _STOCK.items() if key.startswith(base)), None)
