"""The monitor's reductions and gathers over ranks, through a Lightning strategy.

Every collective here goes through the strategy (``strategy.reduce``, ``reduce_boolean_decision``, its process
group), and is called on every rank alike.
"""

from typing import Any

import torch

from lightning_ckpt_determinism.verify.live_step import AllReduce

__all__ = ["agree", "all_reduce", "gather", "same_on_every_rank"]


def all_reduce(strategy: Any) -> AllReduce:
    """``tensor, op -> reduced`` through the strategy (the identity on one device)."""

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return strategy.reduce(tensor, reduce_op=op)

    return reduce


def agree(strategy: Any, decision: bool) -> bool:
    """``decision`` on any rank makes it the decision of every rank."""
    return bool(strategy.reduce_boolean_decision(decision, all=False))


def same_on_every_rank(strategy: Any, value: int) -> bool:
    """Whether every rank passed the same ``value`` (one collective on several processes).

    Example::

        >>> class OneDevice:  # a strategy on one device: `reduce` gives its tensor back
        ...     root_device = torch.device("cpu")
        ...     def reduce(self, tensor, reduce_op):
        ...         return tensor
        >>> same_on_every_rank(OneDevice(), 3)
        True
    """
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=strategy.root_device)
    largest, negated_smallest = all_reduce(strategy)(extremes, "max").tolist()
    return bool(largest == -negated_smallest)


def gather(strategy: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one collective on several processes; ``[value]`` on one)."""
    world_size = getattr(strategy, "world_size", 1)
    if world_size <= 1 or not torch.distributed.is_initialized():
        return [value]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, value, group=getattr(strategy, "process_group", None))
    return gathered
