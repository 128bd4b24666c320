"""The two rates of the roofline cost model measured on the device: ``budget_cost="calibrated"``.

:func:`measure_rates` times a square matrix product (the FLOP rate: ``2 n³`` FLOPs over its time) and a copy of a large
tensor (the memory bandwidth: the bytes read plus the bytes written over its time) on the device, in the dtype the model
computes in, each the best of a few repeats after a warm-up run, so that a cold cache or a passing interruption does not
count. On a GPU it runs a 4096² product and a 256 MiB copy (tens of milliseconds at most, from the sizes; not timed
yet), on a CPU 512² and 32 MiB (0.03 to 0.2 s on a shared 2-core machine). The rates are measured once per device and
dtype in a process, and the process keeps them (:func:`measure_rates` is cached; ``measure_rates.cache_clear()``
measures again).

Timings are noise: two runs, or two ranks, measure different rates (three runs on a shared 2-core CPU measured 17 to 196
GFLOP/s), and so may plan differently. Under a strategy the ranks' rates are reduced to their minimum before planning,
so that every rank plans alike; a run with ``budget_cost="roofline"`` (fixed rates) plans the same on every run and
machine.

Example::

    >>> rates = measure_rates(torch.device("cpu"))
    >>> rates.flop_rate > 0 and rates.bandwidth > 0
    True
"""

import functools
import time
from collections.abc import Callable

import torch

from lightning_ckpt_determinism.checkpointing.cost import ROOFLINE, Rates
from lightning_ckpt_determinism.config import CheckpointingConfig

__all__ = ["measure_rates", "rates_for"]

_REPEATS = 5
"""How many timed runs each measurement takes the best of."""

# (matrix side, bytes copied) per device type: large enough to reach a GPU's rates, small enough for a CPU.
_SIZES = {"cuda": (4096, 256 * 2**20)}
_OTHER_SIZES = (512, 32 * 2**20)


@functools.cache
def measure_rates(device: torch.device, dtype: torch.dtype = torch.float32) -> Rates:
    """The FLOP rate and memory bandwidth of ``device`` in ``dtype``, measured once per process (see the module).

    Args:
        device: The device the model computes on.
        dtype: The dtype it computes matrix products in.

    Returns:
        The measured rates, positive and finite.

    Example::

        >>> measure_rates(torch.device("cpu")).bandwidth > 0
        True
    """
    side, copied = _SIZES.get(device.type, _OTHER_SIZES)
    # Drawn from a generator of its own: the process's random streams (a dropout's masks) stay where they were.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(side, side, device=device, generator=generator).to(dtype)
    b = torch.randn(side, side, device=device, generator=generator).to(dtype)
    matmul = _best_time(device, lambda: torch.mm(a, b))
    source = torch.empty(copied, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = _best_time(device, lambda: target.copy_(source))
    return Rates(flop_rate=2 * side**3 / matmul, bandwidth=2 * copied / copy)


def rates_for(config: CheckpointingConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> Rates | None:
    """The rates ``config.budget_cost`` names: the fixed roofline's, those measured on ``device``, or ``None`` for the
    FLOP count.

    Args:
        config: The config.
        device: Where the model computes (read for ``"calibrated"`` only).
        dtype: The dtype it computes matrix products in (likewise).

    Example::

        >>> config = CheckpointingConfig(classes=["Block"], memory_budget=0.5)
        >>> rates_for(config, torch.device("cpu")) == ROOFLINE
        True
    """
    if config.budget_cost == "flops":
        return None
    if config.budget_cost == "calibrated":
        return measure_rates(device, dtype)
    return ROOFLINE


def _best_time(device: torch.device, run: Callable[[], object]) -> float:
    """The least of ``_REPEATS`` timings of ``run`` on ``device`` in seconds, after one untimed warm-up run."""
    run()
    best = float("inf")
    for _ in range(_REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    # A timer coarser than the run would give 0.
    return max(best, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        getattr(torch, device.type).synchronize()
