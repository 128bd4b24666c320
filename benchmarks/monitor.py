"""What the recomputation check costs: a checked step against a training step, its peak memory, and Lightning runs.

The monitor checks the live step: the step runs as always (checkpointed), and after its backward one reference pass
with checkpointing off (a forward and a backward without recomputation) is compared with it. So a check costs a bit
less than a training step, and checking every ``n`` steps slows training by about ``check / n`` steps. The two-pass
check (a reference and a checkpointed pass, without and with attribution) is what ``attribution="always"`` and a
``loss_fn`` under automatic optimization run.
"""

import inspect
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from benchmarks.common import (
    ModelSize,
    Variant,
    build_model,
    interleaved_times,
    lm_loss,
    make_batch,
    make_optimizer,
    paired_ratios,
    round_orders,
    summary,
    synchronize,
    train_step,
)
from examples.gpt import GPTModule, SyntheticTokensDataModule
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    check_recomputation,
    checkpointed_modules,
)
from lightning_ckpt_determinism.verify.compiled import reference_pass
from lightning_ckpt_determinism.verify.live_step import check_live_step
from lightning_ckpt_determinism.verify.state import StepState

_BATCHES_PER_EPOCH = 64

CHECKED = "checked step"
CHECKED_ONE_REGION = "checked step, reference_regions=1"
WITHOUT = "without monitor"
MONITOR = "monitor"
MONITOR_ALWAYS = "monitor attribution='always'"


def run_check_cost(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    """Time a training step with and without the monitor's live-step check, interleaved, and the two-pass checks.

    The model is checkpointed with the package's default config, as under the monitor. A checked step is what the
    monitor does on a check step: the live, checkpointed forward and backward, then :func:`check_live_step` with one
    reference pass (every region plain, or one with ``reference_regions=1``), then the optimizer step. The
    two-pass :func:`check_recomputation` is timed too, without attribution (what ``loss_fn`` under automatic
    optimization runs) and with it (what ``attribution="always"`` runs on every check, and the default reruns on
    a diverging one).

    Args:
        size: The model's shape.
        device: Where to run.
        rounds: Timed rounds.
        warmup: Untimed rounds first.

    Returns:
        Summaries of seconds by variant (``"step"``, ``"checked step"``, ``"checked step, reference_regions=1"``,
        ``"two-pass check"``, ``"two-pass check with attribution"``); per-round ratios: ``"check/step"`` (the extra
        time of a checked step over a step, in steps), ``"check regions=1/step"``, ``"two-pass/step"``,
        ``"two-pass attribution/step"``; and ``"max_grad_divergence"`` over all checks (``0.0`` when exact).
    """
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    closure = partial(lm_loss, model, inputs, targets)
    divergences: list[float] = []
    first_block = [next(iter(checkpointed_modules(model).values()))]

    def two_pass(**kwargs: Any) -> None:
        divergences.append(check_recomputation(model, closure, **kwargs).grad_divergence)

    def checked(plain: list[torch.nn.Module] | None) -> None:
        divergences.append(checked_step(model, optimizer, inputs, targets, plain))

    functions: dict[str, Callable[[], object]] = {
        "step": partial(train_step, model, optimizer, inputs, targets),
        CHECKED: partial(checked, None),
        CHECKED_ONE_REGION: partial(checked, first_block),
        "two-pass check": partial(two_pass, attribution=False),
        "two-pass check with attribution": partial(two_pass, attribution=True),
    }
    times = interleaved_times(functions, rounds, warmup, device)
    step = times["step"]
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    for key, name in (("check/step", CHECKED), ("check regions=1/step", CHECKED_ONE_REGION)):
        extra = [with_ - without for with_, without in zip(times[name], step, strict=True)]
        result[key] = summary(paired_ratios(extra, step))
    result["two-pass/step"] = summary(paired_ratios(times["two-pass check"], step))
    result["two-pass attribution/step"] = summary(paired_ratios(times["two-pass check with attribution"], step))
    result["max_grad_divergence"] = max(divergences)
    return result


def checked_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    plain: list[torch.nn.Module] | None,
) -> float:
    """A training step checked as the monitor checks it; returns the check's ``grad_divergence``.

    Args:
        model: The checkpointed model.
        optimizer: Its optimizer.
        inputs: Input tokens.
        targets: Next-token targets.
        plain: The regions the reference pass runs plainly (``None``: all of them).
    """
    entry = StepState(model)
    lm_loss(model, inputs, targets).backward()

    def reference() -> float:
        with reference_pass(plain):
            loss = lm_loss(model, inputs, targets)
            loss.backward()
        return float(loss.detach())

    report = check_live_step(model, reference, entry)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert report is not None
    return report.grad_divergence


def run_check_memory(size: ModelSize, device: torch.device) -> dict[str, Any]:
    """The peak memory of a checked step relative to a plain training step of the same checkpointed model.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the step, less what was allocated before it. On
    the CPU, where torch keeps no such statistic, a dispatch mode tracks every storage an op creates during the
    step and the peak of their total size while they live (parameters, and optimizer states made before the step,
    are not counted in either).

    Args:
        size: The model's shape.
        device: Where to run.

    Returns:
        ``{"peak_bytes": {variant: bytes}, "peak/step": {variant: ratio to the plain step}}`` for ``"step"``,
        ``"checked step"`` (every region plain in the reference) and ``"checked step, reference_regions=1"``.
    """
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    train_step(model, optimizer, inputs, targets)  # optimizer states exist before any measured step
    first_block = [next(iter(checkpointed_modules(model).values()))]
    variants: dict[str, Callable[[], object]] = {
        "step": partial(train_step, model, optimizer, inputs, targets),
        CHECKED: partial(checked_step, model, optimizer, inputs, targets, None),
        CHECKED_ONE_REGION: partial(checked_step, model, optimizer, inputs, targets, first_block),
    }
    peaks = {name: _step_peak_bytes(function, device) for name, function in variants.items()}
    return {"peak_bytes": peaks, "peak/step": {name: peak / peaks["step"] for name, peak in peaks.items()}}


def _step_peak_bytes(function: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        function()
        synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before)
    with _PeakBytes() as tracker:
        function()
    return float(tracker.peak)


class _PeakBytes(TorchDispatchMode):
    """The peak total size of the storages that ops create while the mode is active, while they are alive."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._total = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for expired in [key for key, (ref, _) in self._live.items() if ref.expired()]:
            self._total -= self._live.pop(expired)[1]
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                ref = StorageWeakRef(leaf.untyped_storage())
                if ref.cdata not in self._live:
                    nbytes = leaf.untyped_storage().nbytes()
                    self._live[ref.cdata] = (ref, nbytes)
                    self._total += nbytes
        self.peak = max(self.peak, self._total)
        return out


def monitor_defaults() -> dict[str, Any]:
    """The default arguments of the installed ``RecomputationMonitor``."""
    parameters = inspect.signature(RecomputationMonitor.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def run_lightning(
    size: ModelSize, device: torch.device, rounds: int, every_n_steps: int, periods: int, check_cost: dict[str, Any]
) -> dict[str, Any]:
    """Training throughput of Lightning runs with ``RecomputationMonitor`` relative to the same run without it.

    Every run trains :class:`examples.gpt.GPTModule` under :class:`SingleDeviceCheckpointingStrategy` (every
    block checkpointed), with no logger, progress bar, model summary or checkpointing. The monitor runs with its
    defaults (``attribution="on_divergence"``: a check that does not diverge is not attributed, so on this exact
    model each check costs a check without attribution) and with ``attribution="always"`` (every check
    attributed), both with ``on_divergence="ignore"`` (a check costs the same; the largest divergence seen is
    returned instead). It
    always checks the first step of a fit, then every ``every_n_steps``; the first period is warm-up, and the
    following ``periods`` whole periods are measured, each holding exactly one check, so the figures are the
    steady-state rate of a long run. Each of ``rounds`` rounds runs every kind once, in a fresh seeded shuffle
    (:func:`~benchmarks.common.round_orders`).
    Each step is timed from its start to the next one's (data loading, the check, forward, backward, optimizer
    and hooks), and the throughput is given two ways:

    * ``wall``: steps over the window's wall time. Exact on a quiet machine, but one stall of a shared machine
      (seconds, when another process takes the cores) lands in one run and swamps a difference of a few percent.
    * ``median``: a period rebuilt from medians, ``(n - 1) * median(plain step) + median(check step)`` with the
      monitor and ``n * median(step)`` without it, which stalls do not move; the machine's drift between runs
      (several percent on a shared one) still does.
    * ``in_run`` (ratios only): ``n * median(plain step) / ((n - 1) * median(plain step) + median(check step))``
      within each monitored run, so no drift between runs enters. It takes the monitored run's plain steps for
      the run without, which holds because the monitor does nothing on them (a few comparisons); the two
      ratios above confirm it within their noise. Goals are judged on it.

    Args:
        size: The model's shape.
        device: Where to train.
        rounds: Runs of each kind.
        every_n_steps: The monitor's period.
        periods: Measured periods per run.
        check_cost: The result of :func:`run_check_cost`, for the ratio the check's cost predicts.

    Returns:
        ``"runs"``: by run, summaries of steps per second (``"median"``, ``"wall"``); ``"ratios"``: by monitored
        run, summaries of its per-round ratio to the run without (``"median"``, ``"wall"``) and of ``"in_run"``, its
        ``"monitor_kwargs"``, and ``"expected"``, ``1 / (1 + check / (every_n_steps * step))`` with the measured
        cost of the check that monitor runs on a step that does not diverge (``"check/step"`` by default,
        ``"two-pass attribution/step"`` with ``attribution="always"``); the monitor's defaults, the steps measured and
        warmed up, ``"checks_per_run"`` and the largest ``"max_grad_divergence"`` the monitors saw.
    """
    defaults = monitor_defaults()
    monitors: dict[str, dict[str, Any] | None] = {WITHOUT: None, MONITOR: {}, MONITOR_ALWAYS: {"attribution": "always"}}
    warmup_steps, measured_steps = every_n_steps, periods * every_n_steps
    rates: dict[str, dict[str, list[float]]] = {name: {"median": [], "wall": []} for name in monitors}
    in_run: dict[str, list[float]] = {name: [] for name in monitors}
    checks: list[int] = []
    divergences: list[float] = []
    for names in round_orders(list(monitors), rounds):
        for name in names:
            kwargs = monitors[name]
            monitor = None
            if kwargs is not None:
                # The periodic check alone: the sentinel's cost is measured by itself (benchmarks/sentinel.py).
                monitor = RecomputationMonitor(
                    every_n_steps=every_n_steps, on_divergence="ignore", sentinel="off", **kwargs
                )
            timer = _StepTimer(warmup_steps, warmup_steps + measured_steps, device)
            _fit(size, device, [timer] if monitor is None else [timer, monitor], warmup_steps + measured_steps)
            durations = timer.durations()
            rates[name]["wall"].append(measured_steps / sum(durations.values()))
            rates[name]["median"].append(_median_rate(durations, every_n_steps, monitored=monitor is not None))
            if monitor is not None:
                in_run[name].append(
                    _median_rate(durations, every_n_steps, monitored=True) * _plain_step(durations, every_n_steps)
                )
                checks.append(len(monitor.history))
                divergences += [entry.grad_divergence for entry in monitor.history]
    ratios = {}
    for name, kwargs in monitors.items():
        if kwargs is None:
            continue
        attributed = kwargs.get("attribution", defaults["attribution"]) == "always"
        check = check_cost["two-pass attribution/step" if attributed else "check/step"]["median"]
        ratios[name] = {
            kind: summary(paired_ratios(rates[name][kind], rates[WITHOUT][kind])) for kind in ("median", "wall")
        }
        ratios[name]["in_run"] = summary(in_run[name])
        ratios[name]["monitor_kwargs"] = {"every_n_steps": every_n_steps, **kwargs}
        ratios[name]["expected"] = 1 / (1 + check / every_n_steps)
    return {
        "runs": {name: {kind: summary(values) for kind, values in by_kind.items()} for name, by_kind in rates.items()},
        "ratios": ratios,
        "monitor_defaults": defaults,
        "warmup_steps": warmup_steps,
        "measured_steps": measured_steps,
        "every_n_steps": every_n_steps,
        "checks_per_run": checks[0],
        "max_grad_divergence": max(divergences),
    }


def _median_rate(durations: dict[int, float], every_n_steps: int, monitored: bool) -> float:
    """Steps per second of a period rebuilt from median step times (see :func:`run_lightning`)."""
    if not monitored:
        return 1 / statistics.median(durations.values())
    checked = [seconds for step, seconds in durations.items() if step % every_n_steps == 0]
    plain = [seconds for step, seconds in durations.items() if step % every_n_steps]
    return every_n_steps / ((every_n_steps - 1) * statistics.median(plain) + statistics.median(checked))


def _plain_step(durations: dict[int, float], every_n_steps: int) -> float:
    """Median seconds of the steps without a check."""
    return statistics.median(seconds for step, seconds in durations.items() if step % every_n_steps)


def _fit(size: ModelSize, device: torch.device, callbacks: list[Callback], max_steps: int) -> None:
    torch.manual_seed(0)
    module = GPTModule(size.vocab_size, size.seq_len, size.dim, size.heads, size.layers, size.dropout)
    data = SyntheticTokensDataModule(
        size=_BATCHES_PER_EPOCH * size.batch_size,
        seq_len=size.seq_len,
        vocab_size=size.vocab_size,
        batch_size=size.batch_size,
    )
    strategy = SingleDeviceCheckpointingStrategy(
        checkpointing=CheckpointingConfig(classes=["Block"]), device=str(device)
    )
    with tempfile.TemporaryDirectory() as root, _quiet_lightning():
        trainer = pl.Trainer(
            accelerator=device.type,
            strategy=strategy,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=callbacks,
            default_root_dir=root,
        )
        trainer.fit(module, datamodule=data)


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Keep Lightning's setup lines and data-loader hints out of the benchmark's table."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=PossibleUserWarning)
            # Lightning 2.6's pytree helper builds torch's LeafSpec, which torch 2.13 deprecates.
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class _StepTimer(Callback):
    """Times steps ``start`` to ``end - 1``, each from its start (before any other callback) to the next one's."""

    def __init__(self, start: int, end: int, device: torch.device) -> None:
        self._start, self._end, self._device = start, end, device
        self._stamps: dict[int, float] = {}

    def durations(self) -> dict[int, float]:
        """Seconds per step, by global step."""
        return {step: self._stamps[step + 1] - self._stamps[step] for step in range(self._start, self._end)}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stamp(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._end:
            self._stamp(self._end)

    def _stamp(self, step: int) -> None:
        if self._start <= step <= self._end:
            synchronize(self._device)
            self._stamps[step] = time.perf_counter()
