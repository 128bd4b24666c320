"""What the sentinel costs: whole fits with each tier and off, its peak memory, and where its time goes.

The fits train the benchmark GPT under ``SingleDeviceCheckpointingStrategy`` with ``RecomputationMonitor`` checking
the first step only (``every_n_steps`` past the fit), so the runs differ by the sentinel alone, at two widths, each
with and without dropout. Each round runs every mode once, in a fresh seeded shuffle, with two torch threads, and each
ratio is the median of per-round ratios of whole ``Trainer.fit`` times; ``off again/off`` pairs two runs without the
sentinel, the noise floor. The peak memory is a training step's with each tier over without, once the tier is past
its first step (and, for the light tier, at its first step too, where it learns what each region saves). The
breakdown times single training steps without Lightning: with each tier, and with the light tier's digests replaced
by a constant (what its hooks and bookkeeping cost without the digest kernels), and the plain step again, timed as a
variant of its own: its ratio to the step is the run's noise at that size (an A/A control).

``python -m benchmarks.sentinel`` runs the breakdown alone for wider models (``--dims 128,256,512``, the sequence
half the width): the sentinel's cost is a few kernels per digested tensor, so its share falls as the blocks grow.
"""

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, get_args

import torch

from benchmarks.common import (
    ModelSize,
    Regions,
    Variant,
    build_model,
    interleaved_times,
    make_batch,
    make_optimizer,
    paired_ratios,
    round_orders,
    summary,
    synchronize,
    torch_threads,
    train_step,
)
from benchmarks.monitor import _fit, _step_peak_bytes
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, RecomputationSentinel
from lightning_ckpt_determinism.verify import digest as digest_module
from lightning_ckpt_determinism.verify.sentinel import SentinelMode

TIERS = get_args(SentinelMode)
MODES = ("off", "off again", *TIERS)
THREADS = 2


def run(
    size: ModelSize, device: torch.device, rounds: int, steps: dict[int, int], dropout: float = 0.1
) -> dict[str, Any]:
    """Fit times by sentinel mode at each width, with and without dropout, their ratios to ``"off"``, the peak
    memory and the step-level breakdown.

    Args:
        size: The model's shape (its width and dropout are replaced by each configuration's).
        device: Where to train.
        rounds: Fits of each mode, per configuration.
        steps: Training steps per fit, by width (the widths measured).
        dropout: The dropout of the configurations with dropout.

    Returns:
        ``"configs"``: by configuration name, ``"fit_s"`` (summaries of whole-fit seconds by mode), ``"ratios"``
        (``"<mode>/off"`` for every other mode), ``"mismatches"`` (the largest count any fit saw, ``0`` on this
        exact model) and its size; ``"peak/step"``: a step's peak memory with each tier over without;
        ``"breakdown"``: step times and their ratios; and the settings.
    """
    configs = {
        f"width {dim}, {'dropout ' + str(p) if p else 'no dropout'}": replace(size, dim=dim, dropout=p)
        for dim in steps
        for p in (dropout, 0.0)
    }
    with torch_threads(THREADS):
        found = {name: _fits(config, device, rounds, steps[config.dim]) for name, config in configs.items()}
        breakdown = _breakdown(size, device, rounds=max(rounds * 3, 3), warmup=1)
        peaks = _peaks(size, device)
    for result in found.values():
        times = result.pop("times")
        result["fit_s"] = {mode: summary(values) for mode, values in times.items()}
        result["ratios"] = {f"{mode}/off": summary(paired_ratios(times[mode], times["off"])) for mode in MODES[1:]}
    return {
        "configs": found,
        "peak/step": peaks,
        "breakdown": breakdown,
        "threads": THREADS,
        "steps_per_fit": {str(dim): count for dim, count in steps.items()},
    }


def _fits(size: ModelSize, device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    mismatches = 0
    for modes in round_orders(MODES, rounds):
        for mode in modes:
            # Checks the first step only, in every mode alike.
            tier = "off" if mode.startswith("off") else mode
            monitor = RecomputationMonitor(every_n_steps=steps + 1, on_divergence="ignore", sentinel=tier)  # type: ignore[arg-type]
            synchronize(device)
            started = time.perf_counter()
            _fit(size, device, [monitor], steps)
            synchronize(device)
            times[mode].append(time.perf_counter() - started)
            report = monitor.sentinel_report
            mismatches = max(mismatches, report.mismatches if report is not None else 0)
    return {"times": times, "mismatches": mismatches, "size": {"dim": size.dim, "dropout": size.dropout}}


def watched(
    regions: Regions, sentinel: RecomputationSentinel, step: Callable[[], object], device: torch.device
) -> None:
    """One training step under ``sentinel``, as the monitor runs it: the windows moved on, the step's comparisons
    closed on the device, read back only when something differed."""
    with regions.observed_by(sentinel):
        sentinel.next_step()
        step()
        record = sentinel.end_step()
        sentinel.read(record, clean=not bool(record.mismatch_counts(device).any()))


STEP_AGAIN = "step again"
"""The breakdown's A/A control: the plain step timed as a second variant."""

UNWATCHED = "light, step unwatched"
"""A step the light sentinel is attached to but paused for: what a step that ``sentinel_every_n_steps`` skips
costs."""


def _breakdown(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, model, optimizer, inputs, targets)
    sentinels = {tier: RecomputationSentinel(model, mode=tier) for tier in TIERS}  # type: ignore[arg-type]
    constant = RecomputationSentinel(model, mode="light")
    regions = Regions(model)

    def hooks_only() -> None:
        with _constant_digests(device):
            watched(regions, constant, step, device)

    paused = RecomputationSentinel(model, mode="light")

    def unwatched() -> None:
        with regions.observed_by(paused), paused.paused():
            step()

    functions: dict[str, Callable[[], object]] = {
        "step": step,
        **{tier: partial(watched, regions, sentinel, step, device) for tier, sentinel in sentinels.items()},
        "light hooks only": hooks_only,
        UNWATCHED: unwatched,
        # An A/A control: the same step again, whose ratio to the step is this run's noise at this size.
        STEP_AGAIN: partial(train_step, model, optimizer, inputs, targets),
    }
    times = interleaved_times(functions, rounds, warmup, device)
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    for name in (*TIERS, "light hooks only", UNWATCHED, STEP_AGAIN):
        result[f"{name}/step"] = summary(paired_ratios(times[name], times["step"]))
    result["digests_per_step"] = {
        tier: sentinel.report().compared / (rounds + warmup) for tier, sentinel in sentinels.items()
    }
    return result


def _peaks(size: ModelSize, device: torch.device) -> dict[str, float]:
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, model, optimizer, inputs, targets)
    step()  # optimizer states and the regions' profiles exist before any measured step
    plain = _step_peak_bytes(step, device)
    regions = Regions(model)
    peaks = {}
    for tier in TIERS:
        sentinel = RecomputationSentinel(model, mode=tier)  # type: ignore[arg-type]
        first = _step_peak_bytes(partial(watched, regions, sentinel, step, device), device)
        if tier == "light":
            peaks["light, its first step"] = first / plain
        peaks[tier] = _step_peak_bytes(partial(watched, regions, sentinel, step, device), device) / plain
    return peaks


@contextmanager
def _constant_digests(device: torch.device) -> Iterator[None]:
    """The sentinel with constant digests: its hooks and bookkeeping without the digests' views and kernels."""
    constant = torch.zeros((), dtype=torch.int64, device=device)

    def constant_read(self: Any, tensor: torch.Tensor, mode: Any) -> torch.Tensor:
        return constant

    def constant_digest(self: Any, matrix: torch.Tensor) -> torch.Tensor:
        return constant

    def constant_combined(self: Any, found: Any) -> torch.Tensor:
        return constant.expand(len(found))

    plans = digest_module.DigestPlans
    real = plans.read, plans.digest_or_sums, plans.combined
    plans.read, plans.digest_or_sums, plans.combined = constant_read, constant_digest, constant_combined  # type: ignore[method-assign]
    try:
        yield
    finally:
        plans.read, plans.digest_or_sums, plans.combined = real  # type: ignore[method-assign]


def scaling(sizes: list[ModelSize], device: torch.device, rounds: int) -> list[dict[str, float]]:
    """The step-level breakdown (medians) for each of ``sizes``.

    Args:
        sizes: The model shapes.
        device: Where to train.
        rounds: Interleaved rounds of each variant.

    Returns:
        One row per size: ``dim``, ``seq_len``, ``step_ms`` and the ``<tier>/step``, ``light hooks only/step``,
        ``light, step unwatched/step`` and ``step again/step`` ratios (the last, the same step timed as another
        variant: the run's noise).
    """
    rows = []
    with torch_threads(THREADS):
        for size in sizes:
            found = _breakdown(size, device, rounds=rounds, warmup=2)
            rows.append(
                {
                    "dim": size.dim,
                    "seq_len": size.seq_len,
                    "step_ms": found["step"]["median"] * 1e3,
                    **{
                        f"{name}/step": found[f"{name}/step"]["median"]
                        for name in (*TIERS, "light hooks only", UNWATCHED, STEP_AGAIN)
                    },
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the sentinel's step-level cost for models of several widths.

    Example::

        python -m benchmarks.sentinel --dims 128,256,512 --rounds 9
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sentinel", description=main.__doc__)
    parser.add_argument("--dims", default="128,256,512", help="model widths, comma-separated (sequence = width / 2)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds of each variant")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    sizes = [
        ModelSize(layers=4, dim=dim, heads=4, seq_len=dim // 2, batch_size=8, vocab_size=256)
        for dim in (int(text) for text in args.dims.split(","))
    ]
    print(
        "dim  seq  step ms  light/step  sampled/step  exact/step  light hooks only/step  light unwatched/step"
        "  step again/step (noise)"
    )
    for row in scaling(sizes, torch.device(args.device), args.rounds):
        print(
            f"{row['dim']:<4} {row['seq_len']:<4} {row['step_ms']:7.1f}  {row['light/step']:10.3f}"
            f"  {row['sampled/step']:12.3f}  {row['exact/step']:10.3f}  {row['light hooks only/step']:21.3f}"
            f"  {row[f'{UNWATCHED}/step']:20.3f}  {row['step again/step']:23.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
