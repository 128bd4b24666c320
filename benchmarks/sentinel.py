"""What the sentinel costs: whole fits with it sampled, exact and off, its peak memory, and where its time goes.

The fits train the benchmark GPT under ``SingleDeviceCheckpointingStrategy`` with ``RecomputationMonitor`` checking
the first step only (``every_n_steps`` past the fit), so the runs differ by the sentinel alone; they go round-robin,
the order rotated every round, with two torch threads, and each ratio is the median of per-round ratios of whole
``Trainer.fit`` times. The breakdown times single training steps without Lightning: with the sentinel, and with its
digests replaced by a constant (what the hooks and bookkeeping cost without the digest kernels).
"""

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from benchmarks.common import (
    ModelSize,
    Variant,
    build_model,
    interleaved_times,
    make_batch,
    make_optimizer,
    paired_ratios,
    summary,
    synchronize,
    train_step,
)
from benchmarks.monitor import _fit, _step_peak_bytes
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, recomputation_sentinel
from lightning_ckpt_determinism.verify import sentinel as sentinel_module

MODES = ("off", "sampled", "exact")
THREADS = 2


def run(size: ModelSize, device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """Fit times by sentinel mode, their ratios to ``"off"``, the peak memory and the step-level breakdown.

    Args:
        size: The model's shape.
        device: Where to train.
        rounds: Fits of each mode.
        steps: Training steps per fit.

    Returns:
        ``"fit_s"``: summaries of whole-fit seconds by mode; ``"ratios"``: ``"sampled/off"`` and ``"exact/off"``;
        ``"peak/step"``: the peak memory of a training step with each digest over without; ``"breakdown"``: step
        times (``"step"``, ``"sampled"``, ``"exact"``, ``"hooks only"``) and ``"digests_per_step"``;
        ``"mismatches"``: the largest count any fit saw (``0`` on this exact model); and the settings.
    """
    with _threads(THREADS):
        fits = _fits(size, device, rounds, steps)
        breakdown = _breakdown(size, device, rounds=max(rounds * 3, 3), warmup=1)
        peaks = _peaks(size, device)
    times = fits.pop("times")
    return {
        "fit_s": {mode: summary(values) for mode, values in times.items()},
        "ratios": {f"{mode}/off": summary(paired_ratios(times[mode], times["off"])) for mode in ("sampled", "exact")},
        "peak/step": peaks,
        "breakdown": breakdown,
        "threads": THREADS,
        "steps_per_fit": steps,
        **fits,
    }


def _fits(size: ModelSize, device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    mismatches = 0
    for index in range(rounds):
        shift = index % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            # Checks the first step only, in every mode alike.
            monitor = RecomputationMonitor(every_n_steps=steps + 1, on_divergence="ignore", sentinel=mode)  # type: ignore[arg-type]
            synchronize(device)
            started = time.perf_counter()
            _fit(size, device, [monitor], steps)
            synchronize(device)
            times[mode].append(time.perf_counter() - started)
            report = monitor.sentinel_report
            mismatches = max(mismatches, report.mismatches if report is not None else 0)
    return {"times": times, "mismatches": mismatches}


def _breakdown(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, model, optimizer, inputs, targets)
    digests: list[int] = []

    def watched(exact: bool, hooks_only: bool = False) -> None:
        constant = _constant_digests(device) if hooks_only else contextlib.nullcontext()
        with constant, recomputation_sentinel(model, exact=exact) as s:
            step()
            s.next_step()
            s.settle(clean=not bool(s.pending_mismatches(device).any()))
        digests.append(s.report().compared)

    functions: dict[str, Callable[[], object]] = {
        "step": step,
        "sampled": partial(watched, False),
        "exact": partial(watched, True),
        "hooks only": partial(watched, False, True),
    }
    times = interleaved_times(functions, rounds, warmup, device)
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    for name in ("sampled", "exact", "hooks only"):
        result[f"{name}/step"] = summary(paired_ratios(times[name], times["step"]))
    result["digests_per_step"] = statistics.median(digests)
    return result


def _peaks(size: ModelSize, device: torch.device) -> dict[str, float]:
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    train_step(model, optimizer, inputs, targets)  # optimizer states exist before any measured step

    def watched(exact: bool) -> None:
        with recomputation_sentinel(model, exact=exact):
            train_step(model, optimizer, inputs, targets)

    plain = _step_peak_bytes(partial(train_step, model, optimizer, inputs, targets), device)
    return {mode: _step_peak_bytes(partial(watched, mode == "exact"), device) / plain for mode in ("sampled", "exact")}


@contextmanager
def _constant_digests(device: torch.device) -> Iterator[None]:
    """The sentinel with every digest one constant tensor: its hooks and bookkeeping without the digest kernels."""
    constant = torch.zeros(1, dtype=torch.int32, device=device)
    real = sentinel_module.digest
    sentinel_module.digest = lambda tensor, offset=None, weights=None: constant  # type: ignore[assignment]
    try:
        yield
    finally:
        sentinel_module.digest = real


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
