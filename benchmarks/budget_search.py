"""How long the module-granularity memory budget takes to choose, for candidates that each measure differently (experts
given different numbers of tokens): the seconds :func:`~lightning_ckpt_determinism.checkpointing.budget_plan.
choose_checkpointed` takes at half of what they keep, now and, with ``--ref``, at an earlier commit in the same process
(see :mod:`benchmarks.previous`), on the same figures.

``python -m benchmarks.budget_search --counts 16,20,24,40 --ref 7e57fcb`` prints one row per count; the earlier
package is left out of a count once it took over ``--limit`` seconds at a smaller one.
"""

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import lightning_ckpt_determinism
from benchmarks.previous import load_previous
from lightning_ckpt_determinism.checkpointing import measure


def distinct_figures(count: int, figures: Any = measure.RegionFigures, seed: int = 0) -> list[Any]:
    """``count`` candidates with figures of their own and about the same recompute cost per byte saved.

    Args:
        count: How many.
        figures: The ``RegionFigures`` class of the package that plans them.
        seed: The draw.
    """
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for index in range(count):
        plain = 200 + int(torch.randint(0, 100, (1,), generator=generator))
        cost = (plain - 10) * 50 + int(torch.randint(-20, 20, (1,), generator=generator))
        drawn.append(figures(f"experts.{index}", plain, 10, cost, 1, cost))
    return drawn


def seconds_to_choose(package: ModuleType, count: int) -> tuple[float, int]:
    """The seconds ``package`` takes to choose among :func:`distinct_figures` at half their plain bytes, and how many
    candidates it checkpoints."""
    plan = importlib.import_module(f"{package.__name__}.checkpointing.budget_plan")
    figures = distinct_figures(
        count, importlib.import_module(f"{package.__name__}.checkpointing.measure").RegionFigures
    )
    budget = sum(entry.plain_bytes for entry in figures) // 2
    started = time.perf_counter()
    chosen = plan.choose_checkpointed(figures, budget, [entry.cost for entry in figures])
    return time.perf_counter() - started, len(chosen or ())


def main(argv: Sequence[str] | None = None) -> int:
    """Print the seconds to choose at each count, now and at ``--ref``.

    Example::

        python -m benchmarks.budget_search --counts 16,20,24,40 --ref 7e57fcb
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget_search", description=main.__doc__)
    parser.add_argument("--counts", default="16,20,24,40", help="how many candidates, comma-separated")
    parser.add_argument("--ref", default=None, help="an earlier commit to time beside the working tree")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds after which a package stops being timed")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        packages = {"now": lightning_ckpt_determinism}
        if args.ref is not None:
            packages[args.ref] = load_previous(args.ref, Path(folder))
        slow: set[str] = set()
        print("package  candidates  seconds  checkpointed")
        for count in (int(text) for text in args.counts.split(",")):
            for label, package in packages.items():
                if label in slow:
                    print(f"{label:<8} {count:<10}  over {args.limit:g} s at fewer")
                    continue
                seconds, chosen = seconds_to_choose(package, count)
                slow.update({label} if seconds > args.limit else set())
                print(f"{label:<8} {count:<10}  {seconds:7.3f}  {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
