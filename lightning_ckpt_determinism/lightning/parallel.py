"""What the monitor needs from a Lightning strategy: support, the gradient holders, reductions and gathers.

Every collective here goes through the strategy (``strategy.reduce``, ``reduce_boolean_decision``, its process
group), and is called on every rank alike.
"""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_ckpt_determinism._torch_compat import fsdp1_flat_parameters
from lightning_ckpt_determinism.checkpointing.modules import region_name
from lightning_ckpt_determinism.verify.live import AllReduce

__all__ = [
    "SUPPORTED_STRATEGIES",
    "agree",
    "all_reduce",
    "gather",
    "gradient_holders",
    "two_pass_gradients",
    "writes_into_bucket_views",
]

SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)
"""The strategies the monitor is tested under (and their subclasses)."""


def gradient_holders(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
    """The tensors whose ``.grad`` the step fills, by name: the module's trainable parameters, plus FSDP1's flat
    parameters when it keeps the original ones (``use_orig_params=True`` accumulates into the flat gradient)."""
    holders: list[tuple[str, torch.Tensor]] = [
        (region_name(name), param) for name, param in pl_module.named_parameters() if param.requires_grad
    ]
    if isinstance(trainer.strategy, FSDPStrategy) and trainer.strategy.model is not None:
        known = {id(param) for _, param in holders}
        for index, flat in enumerate(fsdp1_flat_parameters(trainer.strategy.model)):
            if id(flat) not in known and flat.requires_grad:
                holders.append((f"<FSDP flat parameter {index}>", flat))
    return holders


def writes_into_bucket_views(strategy: Any) -> bool:
    """Whether the next backward writes into the live gradients' storage (DDP's ``gradient_as_bucket_view``)."""
    return isinstance(strategy.model, DistributedDataParallel) and bool(strategy.model.gradient_as_bucket_view)


def two_pass_gradients(strategy: Any) -> Literal["autograd", "backward"]:
    """How the two-pass check takes gradients on the bare module under ``strategy``: ``torch.autograd.grad`` under
    DDP with ``find_unused_parameters=True``, whose reducer a ``backward()`` outside DDP's forward leaves expecting
    gradients the next step does not give (its backward then fails); ``backward()`` elsewhere, which FSDP's sharded
    parameters and reentrant checkpointing need.

    Example::

        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> two_pass_gradients(SingleDeviceStrategy("cpu"))
        'backward'
    """
    wrapped = getattr(strategy, "model", None)
    unused = isinstance(wrapped, DistributedDataParallel) and bool(wrapped.find_unused_parameters)
    return "autograd" if unused else "backward"


def all_reduce(strategy: Any) -> AllReduce:
    """``tensor, op -> reduced`` through the strategy (the identity on one device)."""

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return strategy.reduce(tensor, reduce_op=op)

    return reduce


def agree(strategy: Any, decision: bool) -> bool:
    """``decision`` on any rank makes it the decision of every rank."""
    return bool(strategy.reduce_boolean_decision(decision, all=False))


def gather(strategy: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one collective on several processes; ``[value]`` on one)."""
    world_size = getattr(strategy, "world_size", 1)
    if world_size <= 1 or not torch.distributed.is_initialized():
        return [value]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, value, group=getattr(strategy, "process_group", None))
    return gathered
