"""The recompute cost of one op call in a roofline model, in whole byte-equivalents, the same on every rank and run.

An op is bounded by its arithmetic or by its memory traffic; its cost is the larger of the two, expressed in the
bytes the device moves in the same time: ``max(ceil(FLOPs / FLOPS_PER_BYTE), bytes moved)``, where ``FLOPS_PER_BYTE``
is a fixed FLOP rate over a fixed memory bandwidth (:data:`FLOP_RATE` / :data:`BANDWIDTH`). FLOPs are counted by
``torch.utils.flop_counter``'s formulas (matrix products, convolutions, CUDA's fused attention); bytes moved are the
dense bytes of the op's tensor arguments and outputs; a view (``aten.t``, ``aten.view``) moves none and costs 0. An
integer cost keeps sums exact, so that plans compare
without rounding. The rates are fixed, not measured on the device: a device with another ratio of FLOP rate to
bandwidth weighs matmuls against elementwise ops otherwise.
"""

import math
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt_determinism._torch_compat import tree_leaves

__all__ = ["op_cost", "op_flops"]

FLOP_RATE = 100e12
"""The FLOP rate the cost model assumes, in FLOP/s (a data-centre GPU's dense 16-bit rate, in round figures)."""

BANDWIDTH = 2e12
"""The memory bandwidth the cost model assumes, in bytes/s."""

FLOPS_PER_BYTE = round(FLOP_RATE / BANDWIDTH)
"""How many FLOPs take as long as moving one byte in the cost model."""

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


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The roofline cost of one call of ``func``, in byte-equivalents: ``max(ceil(FLOPs / FLOPS_PER_BYTE), bytes
    moved)``; 0 for a view, which moves no data.

    Args:
        func: The op overload.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        out: What it returned.

    Example::

        >>> a, b = torch.ones(64, 64), torch.ones(64, 64)
        >>> op_cost(torch.ops.aten.mm.default, (a, b), {}, a @ b)  # 524288 FLOPs, 49152 bytes moved
        49152
        >>> op_cost(torch.ops.aten.relu.default, (a,), {}, a.relu())  # 16 KiB in, 16 KiB out
        32768
        >>> op_cost(torch.ops.aten.t.default, (a,), {}, a.t())
        0
    """
    if getattr(func, "is_view", False):
        return 0
    moved = sum(
        leaf.numel() * leaf.element_size()
        for leaf in tree_leaves((args, kwargs, out))
        if isinstance(leaf, torch.Tensor)
    )
    return max(math.ceil(op_flops(func, args, kwargs, out) / FLOPS_PER_BYTE), moved)
