"""Where the sentinel's host time goes inside training steps: each of its entry points, timed where it runs.

The step-level ratios of ``benchmarks.sentinel`` carry a few percent of noise on a shared CPU, more than the
bookkeeping a change saves. This benchmark reads the sentinel's own host time directly: it trains the benchmark GPT
with the sentinel on and times, with the wall clock around each call, every place the sentinel's code runs in a step:

- ``forward enter`` / ``forward exit``: its context around each region call's forward (the call's plan, the
  parameters' versions; at the exit, the digests of tensors held to the forward's end and the forward's weighing);
- ``pack``: each saved tensor it handles at the forward (its metadata, and its row and column sums for a digested one);
- ``recompute enter`` / ``recompute exit``: its context around each recomputation (the parameters' versions and the
  buffers' digests, before and after);
- ``compare``: each recomputed tensor torch compares with the forward's (the same sums);
- ``next step``, ``end step``, ``counts``, ``read``: the step's own work, as the monitor does it (the windows moved on,
  the step closed and its sums weighed, its mismatch counts, its report).

Their sum is the sentinel's host time a step (the clocks and their wrappers add under 1 µs a call); what it leaves out
is the sentinel's effect on the model's own ops (caches, the allocator), which only the step-level ratio sees. The
plain step is timed too, for scale. Comparing two commits' breakdowns, or a change's before and after, shows where a
change saves.

``python -m benchmarks.sentinel_host --dims 128 --steps 30`` prints one table per width.
"""

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, get_args
from unittest import mock

import torch

from benchmarks.common import (
    ModelSize,
    Regions,
    Variant,
    build_model,
    make_batch,
    make_optimizer,
    torch_threads,
    train_step,
)
from benchmarks.sentinel import THREADS
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationSentinel
from lightning_ckpt_determinism.verify.sentinel import SentinelMode
from lightning_ckpt_determinism.verify.sentinel.calls import KeptTensor, RegionCall

POINTS = (
    "forward enter",
    "pack",
    "forward exit",
    "recompute enter",
    "compare",
    "recompute exit",
    "next step",
    "end step",
    "counts",
    "read",
)
"""The places the sentinel's code runs, in the order a step reaches them."""


def host_time(
    size: ModelSize, device: torch.device, tier: SentinelMode, steps: int, warmup: int = 3
) -> dict[str, float]:
    """The sentinel's host time a training step at each of :data:`POINTS`, in microseconds.

    Args:
        size: The benchmark GPT's shape (its blocks are the checkpointed regions).
        device: Where to train.
        tier: The sentinel's tier.
        steps: Training steps timed (after ``warmup`` untimed ones, in which the regions learn their profiles).
        warmup: Untimed steps first.

    Returns:
        Microseconds a step at each point, their ``"total"``, and ``"step ms"``: a plain step's milliseconds (the
        same model without the sentinel, timed after the watched steps).

    Example::

        >>> size = ModelSize(layers=2, dim=16, heads=2, seq_len=8, batch_size=2, vocab_size=32)
        >>> found = host_time(size, torch.device("cpu"), "light", steps=1, warmup=1)
        >>> found["total"] == sum(found[point] for point in POINTS)
        True
    """
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, model, optimizer, inputs, targets)
    regions = Regions(model)
    sentinel = RecomputationSentinel(model, mode=tier)
    spent: dict[str, float] = defaultdict(float)

    def timed(point: str, run: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return run()
        finally:
            spent[point] += time.perf_counter() - started

    def watched() -> None:
        with regions.observed_by(sentinel):
            timed("next step", sentinel.next_step)
            step()
            record = timed("end step", sentinel.end_step)
            clean = timed("counts", lambda: not bool(record.mismatch_counts(device).any()))
            timed("read", lambda: sentinel.read(record, clean=clean))

    with torch_threads(THREADS), _timed_hooks(timed):
        for _ in range(warmup):
            watched()
        spent.clear()
        for _ in range(steps):
            watched()
    found = {point: spent[point] / steps * 1e6 for point in POINTS}
    found["total"] = sum(found.values())
    with torch_threads(THREADS):
        step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        found["step ms"] = (time.perf_counter() - started) / steps * 1e3
    return found


@contextmanager
def _timed_hooks(timed: Callable[[str, Callable[[], Any]], Any]) -> Iterator[None]:
    """The sentinel's hooks wrapped so that ``timed`` clocks each: its two contexts' entries and exits apart."""

    def context(point: str, make: Callable[..., Any]) -> Callable[..., Any]:
        def entered(*args: Any, **kwargs: Any) -> Any:
            return _TimedContext(make(*args, **kwargs), point, timed)

        return entered

    def function(point: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def called(*args: Any, **kwargs: Any) -> Any:
            return timed(point, lambda: run(*args, **kwargs))

        return called

    with ExitStack() as stack:
        for owner, name, point, wrap in (
            (RecomputationSentinel, "region_forward", "forward", context),
            (RecomputationSentinel, "region_recompute", "recompute", context),
            (RegionCall, "save", "pack", function),
            (KeptTensor, "__ne__", "compare", function),
        ):
            stack.enter_context(mock.patch.object(owner, name, wrap(point, getattr(owner, name))))
        yield


class _TimedContext:
    """A context manager whose entry and exit are each clocked: ``<point> enter`` and ``<point> exit``."""

    def __init__(self, inner: Any, point: str, timed: Callable[[str, Callable[[], Any]], Any]) -> None:
        self.inner, self.point, self.timed = inner, point, timed

    def __enter__(self) -> Any:
        return self.timed(f"{self.point} enter", self.inner.__enter__)

    def __exit__(self, *raised: Any) -> Any:
        return self.timed(f"{self.point} exit", lambda: self.inner.__exit__(*raised))


def table(rows: dict[int, dict[str, float]], tier: str) -> str:
    """A Markdown table of :func:`host_time` by width: microseconds a step at each point.

    Example::

        >>> print(table({128: {**dict.fromkeys(POINTS, 1.0), "total": 10.0, "step ms": 80.0}}, "light").splitlines()[2])
        | 128 | 80.0 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | **10** |
    """
    head = f"| width | step ms | {' | '.join(POINTS)} | `{tier}`, total µs |"
    rule = "|" + "---|" * (len(POINTS) + 3)
    body = [
        f"| {dim} | {row['step ms']:.1f} | "
        + " | ".join(f"{row[point]:.0f}" for point in POINTS)
        + f" | **{row['total']:.0f}** |"
        for dim, row in rows.items()
    ]
    return "\n".join([head, rule, *body])


def main(argv: list[str] | None = None) -> int:
    """Print the sentinel's host time a step at each of its entry points, for models of several widths.

    Example::

        python -m benchmarks.sentinel_host --dims 128 --steps 30 --tier light
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sentinel_host", description=main.__doc__)
    parser.add_argument("--dims", default="128", help="model widths, comma-separated (sequence = width / 2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps timed")
    parser.add_argument("--tier", default="light", choices=get_args(SentinelMode))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    rows = {
        dim: host_time(
            ModelSize(layers=4, dim=dim, heads=4, seq_len=dim // 2, batch_size=8, vocab_size=256),
            torch.device(args.device),
            args.tier,
            args.steps,
        )
        for dim in (int(text) for text in args.dims.split(","))
    }
    print(table(rows, args.tier))
    return 0


if __name__ == "__main__":
    sys.exit(main())
