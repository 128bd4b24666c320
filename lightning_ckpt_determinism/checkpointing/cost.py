"""The recompute cost of one op call, in whole byte-equivalents: a roofline model, or the FLOP count alone.

An op is bounded by its arithmetic or by its memory traffic; its roofline cost is the larger of the two, expressed in
the bytes the device moves in the same time: ``max(ceil(FLOPs / (flop_rate / bandwidth)), bytes moved)``, for the
two :class:`Rates` of a device. FLOPs are counted by ``torch.utils.flop_counter``'s formulas (matrix products,
convolutions, CUDA's fused attention); bytes moved are the dense bytes of the op's tensor arguments and outputs; a
view (``aten.t``, ``aten.view``) moves none and costs 0. An integer cost keeps sums exact, so that plans compare
without rounding.

``CheckpointingConfig.budget_cost`` chooses the rates: ``"roofline"`` takes the fixed :data:`ROOFLINE` rates
(:data:`FLOP_RATE` over :data:`BANDWIDTH`), the same on every rank, run and machine; ``"calibrated"`` the rates
measured on the device (:mod:`~lightning_ckpt_determinism.checkpointing.calibration`); ``"flops"`` none, and an op
costs its FLOP count alone (elementwise ops, norms and softmax cost 0).
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt_determinism._torch_compat import tree_leaves

__all__ = ["ROOFLINE", "Rates", "op_cost", "op_flops", "roofline_cost"]

FLOP_RATE = 100e12
"""The FLOP rate the fixed roofline assumes, in FLOP/s (a data-centre GPU's dense 16-bit rate, in round figures)."""

BANDWIDTH = 2e12
"""The memory bandwidth the fixed roofline assumes, in bytes/s."""


@dataclass(frozen=True)
class Rates:
    """A device's two rates in the roofline model.

    Attributes:
        flop_rate: Its arithmetic rate, in FLOP/s.
        bandwidth: Its memory bandwidth, in bytes/s.

    Example::

        >>> Rates(flop_rate=100e12, bandwidth=2e12).flops_per_byte
        50.0
    """

    flop_rate: float
    bandwidth: float

    @property
    def flops_per_byte(self) -> float:
        """How many FLOPs take as long as moving one byte."""
        return self.flop_rate / self.bandwidth


ROOFLINE = Rates(FLOP_RATE, BANDWIDTH)
"""The fixed rates of ``budget_cost="roofline"``: 100 TFLOP/s and 2 TB/s, 50 FLOPs per byte."""

_FLOP_FORMULAS = FlopCounterMode(display=False).flop_registry


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The FLOPs ``torch.utils.flop_counter`` counts for one call of ``func`` (0 for the ops it has no formula for).

    Args:
        func: The op overload.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        out: What it returned.

    Example::

        >>> a, b = torch.ones(2, 3), torch.ones(3, 4)
        >>> op_flops(torch.ops.aten.mm.default, (a, b), {}, a @ b)
        48
    """
    formula = _FLOP_FORMULAS.get(getattr(func, "overloadpacket", None))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def roofline_cost(flops: int, moved: int, rates: Rates) -> int:
    """``max(ceil(flops / rates.flops_per_byte), moved)``: the time of ``flops`` and of moving ``moved`` bytes,
    whichever is longer, in byte-equivalents.

    Args:
        flops: The op's FLOPs.
        moved: The bytes it reads and writes.
        rates: The device's rates.

    Example::

        >>> roofline_cost(524288, 49152, ROOFLINE), roofline_cost(524288, 49152, Rates(1e12, 1e12))
        (49152, 524288)
    """
    return max(math.ceil(flops / rates.flops_per_byte), moved)


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, rates: Rates | None = ROOFLINE) -> int:
    """The cost of one call of ``func``: its roofline cost at ``rates``, in byte-equivalents (0 for a view, which
    moves no data), or its FLOP count when ``rates`` is ``None``.

    Args:
        func: The op overload.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        out: What it returned.
        rates: The device's rates; ``None`` for the FLOP count alone.

    Example::

        >>> a, b = torch.ones(64, 64), torch.ones(64, 64)
        >>> op_cost(torch.ops.aten.mm.default, (a, b), {}, a @ b)  # 524288 FLOPs, 49152 bytes moved
        49152
        >>> op_cost(torch.ops.aten.relu.default, (a,), {}, a.relu())  # 16 KiB in, 16 KiB out
        32768
        >>> op_cost(torch.ops.aten.t.default, (a,), {}, a.t())
        0
        >>> op_cost(torch.ops.aten.relu.default, (a,), {}, a.relu(), rates=None)  # no FLOPs counted
        0
    """
    flops = op_flops(func, args, kwargs, out)
    if rates is None:
        return flops
    if getattr(func, "is_view", False):
        return 0
    moved = sum(
        leaf.numel() * leaf.element_size()
        for leaf in tree_leaves((args, kwargs, out))
        if isinstance(leaf, torch.Tensor)
    )
    return roofline_cost(flops, moved, rates)
