"""Which checkpointed regions a check's reference pass runs plainly, without running the device out of memory.

A region run plainly holds the activations checkpointing would have recomputed: what it saves for backward, which the
sentinel measures at its first forward. ``reference_regions=k`` runs ``k`` of them plainly per check, rotating so that
every region is covered every ``ceil(n / k)`` checks. ``"auto"`` runs plainly, on CUDA, the largest number of regions
whose saved bytes fit the device's free memory with a margin, and every region elsewhere (the CPU's memory is the
host's, and torch reports no free figure for it).
"""

from collections.abc import Sequence
from typing import TypeVar

import torch

__all__ = ["MEMORY_MARGIN", "free_memory", "plain_regions", "regions_that_fit", "regions_that_fit_now"]

_Region = TypeVar("_Region")

MEMORY_MARGIN = 0.25
"""The share of the free memory the reference's plain regions leave unused (allocator fragmentation, the gradients
set aside, the reference's own gradients)."""


def regions_that_fit(saved_bytes: Sequence[int], free_bytes: int, margin: float = MEMORY_MARGIN) -> int:
    """The largest ``k`` such that any ``k`` of the regions, run plainly together, fit ``free_bytes`` with ``margin``
    (the ``k`` largest are counted, since the reference rotates through all of them); at least one.

    Args:
        saved_bytes: What each region saves for backward, in bytes.
        free_bytes: The device's free memory now.
        margin: The share of ``free_bytes`` left unused.

    Example::

        >>> regions_that_fit([100, 300, 200], free_bytes=700)  # 525 usable: the two largest take 500
        2
    """
    usable = free_bytes * (1.0 - margin)
    taken = 0
    fitting = 0
    for size in sorted(saved_bytes, reverse=True):
        taken += size
        if taken > usable:
            break
        fitting += 1
    return max(1, fitting)


def free_memory(device: torch.device) -> int | None:
    """The free memory of a CUDA device, in bytes; ``None`` for any other device.

    Example::

        >>> free_memory(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def plain_regions(
    regions: Sequence[_Region],
    count: int | None,
    checks: int,
) -> list[_Region] | None:
    """The ``count`` regions the reference runs plainly at the ``checks``-th check, rotating; ``None`` for all.

    Args:
        regions: The checkpointed regions, in module order.
        count: How many to run plainly; ``None`` for all.
        checks: How many checks ran before this one.

    Example::

        >>> plain_regions(["a", "b", "c"], 2, checks=1)
        ['c', 'a']
    """
    if count is None or count >= len(regions):
        return None
    start = checks * count % len(regions)
    return [regions[(start + offset) % len(regions)] for offset in range(count)]


def regions_that_fit_now(saved_bytes: Sequence[int], free_bytes: int | None) -> int | None:
    """How many regions ``reference_regions="auto"`` runs plainly on this rank: as many as fit ``free_bytes``
    (:func:`regions_that_fit`); ``None`` (all of them) where the free memory is unknown or nothing was measured.

    Args:
        saved_bytes: What each region saves for backward, as the sentinel measured it (empty when unmeasured).
        free_bytes: The device's free memory (:func:`free_memory`); ``None`` where unknown.

    Example::

        >>> regions_that_fit_now([100, 300, 200], free_bytes=700), regions_that_fit_now([100], free_bytes=None)
        (2, None)
    """
    return None if free_bytes is None or not saved_bytes else regions_that_fit(saved_bytes, free_bytes)
