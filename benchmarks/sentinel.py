"""What the sentinel costs: whole fits with it sampled, exact and off, its peak memory, and where its time goes.

The fits train the benchmark GPT under ``SingleDeviceCheckpointingStrategy`` with ``RecomputationMonitor`` checking
the first step only (``every_n_steps`` past the fit), so the runs differ by the sentinel alone; they go round-robin,
the order rotated every round, with two torch threads, and each ratio is the median of per-round ratios of whole
``Trainer.fit`` times. The breakdown times single training steps without Lightning: with the sentinel, and with its
digests replaced by a constant (what the hooks and bookkeeping cost without the digest kernels).

``python -m benchmarks.sentinel`` runs the breakdown alone for wider models (``--dims 128,256,512``, the sequence
half the width): the sentinel's cost is a few kernels per saved tensor, so its share falls as the blocks grow.
"""

import argparse
import contextlib
import statistics
import sys
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
from lightning_ckpt_determinism.verify import digest as digest_module

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
    """The sentinel with constant digests: its hooks and bookkeeping without the digests' views and kernels."""
    constant = torch.zeros((), dtype=torch.int64, device=device)

    def constant_read(self: Any, tensor: torch.Tensor, mode: Any) -> torch.Tensor:
        return constant

    def constant_digest(self: Any, matrix: torch.Tensor) -> torch.Tensor:
        return constant

    plans = digest_module.DigestPlans
    real = plans.read, plans.digest
    plans.read, plans.digest = constant_read, constant_digest  # type: ignore[method-assign]
    try:
        yield
    finally:
        plans.read, plans.digest = real  # type: ignore[method-assign]


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def scaling(sizes: list[ModelSize], device: torch.device, rounds: int) -> list[dict[str, float]]:
    """The step-level breakdown (medians) for each of ``sizes``.

    Args:
        sizes: The model shapes.
        device: Where to train.
        rounds: Interleaved rounds of each variant.

    Returns:
        One row per size: ``dim``, ``seq_len``, ``step_ms`` and the ``sampled/step``, ``exact/step`` and
        ``hooks only/step`` ratios.
    """
    rows = []
    with _threads(THREADS):
        for size in sizes:
            found = _breakdown(size, device, rounds=rounds, warmup=2)
            rows.append(
                {
                    "dim": size.dim,
                    "seq_len": size.seq_len,
                    "step_ms": found["step"]["median"] * 1e3,
                    **{name: found[name]["median"] for name in ("sampled/step", "exact/step", "hooks only/step")},
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
    print("dim  seq  step ms  sampled/step  exact/step  hooks only/step")
    for row in scaling(sizes, torch.device(args.device), args.rounds):
        print(
            f"{row['dim']:<4} {row['seq_len']:<4} {row['step_ms']:7.1f}  {row['sampled/step']:12.3f}"
            f"  {row['exact/step']:10.3f}  {row['hooks only/step']:15.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
