"""What one saved tensor costs: its pack at the forward and its comparison after the recomputation, per path.

torch's non-reentrant checkpoint calls a Python metadata extractor on every tensor a region saves, and again on each
recomputed tensor, which it compares with the first (``determinism_check="default"``); ``"none"`` calls an extractor
that returns nothing. The package replaces that extractor; the sentinel reads through it. This benchmark times one
checkpointed region that saves ``N`` small tensors (a chain of ``sin``, each saving its input) for two values of
``N``, forward and backward, and reports the slope: the microseconds each further saved tensor costs, so that
nothing a region call pays once (the wrapper, the sentinel's per-call work, the light tier's own digests) counts.
Each path's cost over torch's ``"none"`` is what its extractor adds per tensor:

- ``torch default``: torch's own extractor (shape, dtype and device, compared after the recomputation);
- ``package, sentinel off``: a region checkpointed by the package, no sentinel (once the region learned its path, its
  calls pass torch's own extractor);
- ``light, not digested``: the sentinel's light tier, for the tensors it does not digest at this call (all but
  three);
- ``sampled`` and ``exact``, each tensor digested: through a window of each row, and every word.

``python -m benchmarks.saved_tensors --rounds 41`` prints the table; the variants run interleaved, round-robin, with
one torch thread, each timed by this thread's CPU time on the CPU (so that other processes do not inflate it) and by
the wall clock, synchronized, on CUDA.
"""

import argparse
import contextvars
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any, get_args

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.common import Regions, interleaved_times, round_orders, torch_threads
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationSentinel, apply_activation_checkpointing
from lightning_ckpt_determinism._torch_compat import determinism_checks
from lightning_ckpt_determinism.checkpointing.determinism_check import DETERMINISM_CHECKS, InRegionCall, recomputing
from lightning_ckpt_determinism.verify.sentinel import SentinelMode

SHAPE = (4, 64)
"""Each saved tensor: 4 rows of 64 ``float32`` (the sampled window reads 2 of each row's 32 words)."""


class Chain(nn.Module):
    """``length`` ``sin`` ops in a row: each saves its input for backward."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = x.sin()
        return x


class Region(nn.Module):
    """One checkpointed ``Chain``, by hand (``check`` is torch's ``determinism_check``) or by the package."""

    def __init__(self, length: int, check: str | None) -> None:
        super().__init__()
        self.chain = Chain(length)
        self.check = check
        if check is None:
            apply_activation_checkpointing(self, CheckpointingConfig(classes=["Chain"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check is None:
            return self.chain(x)
        return checkpoint(self.chain, x, use_reentrant=False, determinism_check=self.check)


def _step(region: Region, x: torch.Tensor) -> None:
    region(x).sum().backward()


def _watched(regions: Regions, sentinel: RecomputationSentinel, region: Region, x: torch.Tensor) -> None:
    """One step under the sentinel as the monitor runs it: windows moved on, the step closed, read if it differed."""
    with regions.observed_by(sentinel):
        sentinel.next_step()
        _step(region, x)
        record = sentinel.end_step()
        sentinel.read(record, clean=not bool(record.mismatch_counts(x.device).any()))


# Each tier's path, named by its tier; the light tier's is measured on the tensors it leaves undigested at a call.
TIER_PATHS = {tier: "light, not digested" if tier == "light" else tier for tier in get_args(SentinelMode)}
PATHS = ("torch none", "torch default", "package, sentinel off", *TIER_PATHS.values())


def _functions(length: int, x: torch.Tensor) -> tuple[dict[str, Callable[[], object]], dict[str, Any]]:
    """Each path's step for a region saving ``length`` tensors, and the sentinel of each tier's path."""
    functions: dict[str, Callable[[], object]] = {
        "torch none": partial(_step, Region(length, "none"), x),
        "torch default": partial(_step, Region(length, "default"), x),
        "package, sentinel off": partial(_step, Region(length, None), x),
    }
    sentinels = {}
    for tier, name in TIER_PATHS.items():
        region = Region(length, None)
        sentinel = sentinels[name] = RecomputationSentinel(region, mode=tier)
        functions[name] = partial(_watched, Regions(region), sentinel, region, x)
    return functions, sentinels


def per_tensor(
    rounds: int, short: int = 32, long: int = 160, device: torch.device | None = None
) -> dict[str, dict[str, float]]:
    """Microseconds per saved tensor on each path: the slope between regions saving ``short`` and ``long`` tensors.

    Args:
        rounds: Interleaved rounds of each variant (their medians are taken).
        short: Tensors the shorter region saves.
        long: Tensors the longer region saves.
        device: Where the tensors are (the CPU by default).

    Returns:
        By path: ``"us"`` (a saved tensor's time, forward, recomputation and backward of its ``sin`` included),
        ``"over none"`` (what the path adds to torch's ``"none"``, the extractor's share), ``"once"`` (what the path
        pays once a step over a hand-written checkpoint with torch's ``"default"``, whatever the region saves: the
        intercept of the line, the region call, and the sentinel's step for its tiers) and, for the sentinel's
        tiers, ``"compared"`` (the tensors it compared per step of the longer region).
    """
    device = device or torch.device("cpu")
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    functions: dict[str, Callable[[], object]] = {}
    sentinels: dict[str, RecomputationSentinel] = {}
    for length in (short, long):
        made, sentinels = _functions(length, x)
        functions.update({f"{name} @ {length}": function for name, function in made.items()})
    with torch_threads(1):
        # On the CPU with one torch thread the work runs on this thread: its CPU time is what it costs.
        clock = time.thread_time if device.type == "cpu" else time.perf_counter
        times = interleaved_times(functions, rounds, warmup=3, device=device, clock=clock)
    medians = {name: sorted(samples)[len(samples) // 2] for name, samples in times.items()}
    slopes = {
        name: (medians[f"{name} @ {long}"] - medians[f"{name} @ {short}"]) / (long - short) * 1e6 for name in PATHS
    }
    # What a step pays once, whatever the region saves: the region call, and the sentinel's step for its tiers.
    once = {name: (medians[f"{name} @ {short}"] * 1e6 - slopes[name] * short) for name in PATHS}
    found: dict[str, dict[str, float]] = {
        name: {"us": slope, "over none": slope - slopes["torch none"], "once": once[name] - once["torch default"]}
        for name, slope in slopes.items()
    }
    for name, sentinel in sentinels.items():
        found[name]["compared"] = sentinel.report().compared / (rounds + 3)
    return found


def extractor_ns(rounds: int = 41, repeats: int = 2000) -> dict[str, dict[str, float]]:
    """Nanoseconds of the extractor alone for a tensor no observer digests, at the pack (inside a region call's
    forward) and at the comparison after the recomputation (``kept != extract(recomputed)``, the value that path kept
    on the left, run inside a backward after the package was told of the recomputation, where torch runs it):

    - torch's own;
    - the package with the sentinel off: the extractor its region's calls pass once the region learned their path
      (read from torch's registry by that name: torch's own);
    - the package's extractor where nothing observes a call (a call that cannot be counted by torch's frame, as one
      that runs a backward inside its forward);
    - the package's inside a light-tier call, for a tensor it does not digest.

    Each timing is ``repeats`` calls, by this thread's CPU time; the eight run round-robin for ``rounds`` rounds, and
    each one's median is taken.

    Args:
        rounds: Interleaved rounds.
        repeats: Calls per timing.
    """
    x = torch.randn(SHAPE)
    region = Region(4, None)  # wrapping the first region registers the package's extractors
    torch_extract = determinism_checks()["default"]
    package_extract = determinism_checks()[DETERMINISM_CHECKS["default"]]
    sentinel = RecomputationSentinel(region, mode="light")
    regions = Regions(region)
    for _ in range(2):  # the region's profile and light layout are learned
        _watched(regions, sentinel, region, x.requires_grad_())
    x = x.detach()
    # A light-tier call left open for every round in a context of its own, past the layout's positions: the tensors
    # it packs from there on are ones the call does not digest.
    light, opened = contextvars.Context(), ExitStack()
    for block in (regions.observed_by(sentinel), sentinel.region_forward("chain", region.chain)):
        light.run(opened.enter_context, block)
    light.run(opened.enter_context, InRegionCall(None, sentinel))
    light.run(lambda: [package_extract(x) for _ in range(8)])
    steady_extract = determinism_checks()[CheckpointingConfig(classes=["Chain"]).determinism_check]
    kept = {
        "torch default": torch_extract(x),
        "package, sentinel off": steady_extract(x),
        "package extractor, nothing observes": package_extract(x),
        "light, not digested": 0,
    }
    kept["light, not digested"] = light.run(package_extract, x)

    def packs(extract: Callable[[torch.Tensor], object]) -> float:
        return _ns(lambda: extract(x), repeats)

    def plain_pack() -> float:
        with InRegionCall(None, None):
            return packs(package_extract)

    def comparison(name: str, extract: Callable[[torch.Tensor], object], observed: bool | None) -> float:
        def timed() -> float:
            if observed is not None:  # the package's comparisons follow a recomputation, which says whose they are
                recomputing(observed=observed)
            return _ns(lambda: kept[name] != extract(x), repeats)

        return contextvars.Context().run(_in_backward, timed)

    timings: dict[tuple[str, str], Callable[[], float]] = {
        ("torch default", "pack"): partial(packs, torch_extract),
        ("package, sentinel off", "pack"): partial(packs, steady_extract),
        ("package extractor, nothing observes", "pack"): partial(contextvars.Context().run, plain_pack),
        ("light, not digested", "pack"): partial(light.run, packs, package_extract),
        ("torch default", "comparison"): partial(comparison, "torch default", torch_extract, None),
        ("package, sentinel off", "comparison"): partial(comparison, "package, sentinel off", steady_extract, None),
        ("package extractor, nothing observes", "comparison"): partial(
            comparison, "package extractor, nothing observes", package_extract, False
        ),
        ("light, not digested", "comparison"): partial(comparison, "light, not digested", package_extract, True),
    }
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in timings}
    try:
        for index, keys in enumerate(round_orders(list(timings), rounds + 2)):
            for key in keys:
                elapsed = timings[key]()
                if index >= 2:
                    samples[key].append(elapsed)
    finally:
        light.run(opened.close)
    found: dict[str, dict[str, float]] = {name: {} for name in kept}
    for (name, phase), values in samples.items():
        found[name][phase] = sorted(values)[len(values) // 2]
    return found


def _ns(function: Callable[[], object], repeats: int) -> float:
    started = time.thread_time_ns()
    for _ in range(repeats):
        function()
    return (time.thread_time_ns() - started) / repeats


def _in_backward(function: Callable[[], float]) -> float:
    """``function``'s value, run inside a backward (where torch compares a recomputed tensor)."""
    leaf = torch.ones(1, requires_grad=True)
    found: list[float] = []
    through = leaf * 1
    through.register_hook(lambda grad: found.append(function()))
    through.sum().backward()
    return found[0]


def extractor_table(found: dict[str, dict[str, float]]) -> str:
    """The figures of :func:`extractor_ns` as a Markdown table, each path's pack and comparison over torch's."""
    base = sum(found["torch default"].values())
    lines = ["| extractor path | pack ns | comparison ns | both / torch's |", "|---|---|---|---|"]
    for name, row in found.items():
        both = row["pack"] + row["comparison"]
        lines.append(f"| {name} | {row['pack']:.0f} | {row['comparison']:.0f} | {both / base:.2f} |")
    return "\n".join(lines)


def table(found: dict[str, dict[str, Any]]) -> str:
    """The figures of :func:`per_tensor` as a Markdown table, each path's extractor share also over torch's default."""
    default = found["torch default"]["over none"]
    lines = [
        "| path | µs per saved tensor | over torch `none` | / torch `default`'s share | once a step, µs |",
        "|---|---|---|---|---|",
    ]
    for name, row in found.items():
        share = row["over none"] / default if name != "torch none" and default > 0 else float("nan")
        lines.append(f"| {name} | {row['us']:.2f} | {row['over none']:.2f} | {share:.2f} | {row['once']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print what one saved tensor costs on each path.

    Example::

        python -m benchmarks.saved_tensors --rounds 31
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.saved_tensors", description=main.__doc__)
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds of each variant")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print(table(per_tensor(args.rounds, device=torch.device(args.device))))
    if args.device == "cpu":
        print()
        print(extractor_table(extractor_ns()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
