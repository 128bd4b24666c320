"""What the recomputation check costs: one check against one training step, and a Lightning run with the monitor.

A check runs the step's forward and backward twice (once without checkpointing, once with it) and compares the
gradients; a checkpointed training step runs the forward twice and the backward once, plus the optimizer. So one
check costs about two steps, and checking every ``n`` steps slows training by about ``check / (n * step)``.
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
)

_BATCHES_PER_EPOCH = 64

WITHOUT = "without monitor"
MONITOR = "monitor"
MONITOR_ALWAYS = "monitor attribution='always'"


def run_check_cost(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    """Time ``check_recomputation`` against a training step of the same checkpointed model, interleaved.

    The model is checkpointed with the package's default config, as under the monitor. The check is timed without
    attribution (what the monitor runs by default on a step that does not diverge) and with it (what
    ``attribution="always"`` runs on every check, and the default reruns on a diverging one), in the same rounds.

    Args:
        size: The model's shape.
        device: Where to run.
        rounds: Timed rounds.
        warmup: Untimed rounds first.

    Returns:
        ``{"step", "check", "check_attribution"}`` summaries of seconds, ``"check/step"``,
        ``"check_attribution/step"`` and ``"attribution_adds/step"`` (the extra time of attribution, in steps)
        summaries of per-round ratios, and ``"max_grad_divergence"`` over all checks (``0.0`` when recomputation
        is exact).
    """
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    closure = partial(lm_loss, model, inputs, targets)
    divergences: list[float] = []

    def check(**kwargs: Any) -> None:
        divergences.append(check_recomputation(model, closure, **kwargs).grad_divergence)

    functions: dict[str, Callable[[], object]] = {
        "step": partial(train_step, model, optimizer, inputs, targets),
        "check": partial(check, attribution=False),
        "check_attribution": partial(check, attribution=True),
    }
    times = interleaved_times(functions, rounds, warmup, device)
    extra = [with_ - without for with_, without in zip(times["check_attribution"], times["check"], strict=True)]
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    result["check/step"] = summary(paired_ratios(times["check"], times["step"]))
    result["check_attribution/step"] = summary(paired_ratios(times["check_attribution"], times["step"]))
    result["attribution_adds/step"] = summary(paired_ratios(extra, times["step"]))
    result["max_grad_divergence"] = max(divergences)
    return result


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
    steady-state rate of a long run. The runs go round-robin, ``rounds`` times, the order rotated every round.
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
        ``"check_attribution/step"`` with ``attribution="always"``); the monitor's defaults, the steps measured and
        warmed up, ``"checks_per_run"`` and the largest ``"max_grad_divergence"`` the monitors saw.
    """
    defaults = monitor_defaults()
    monitors: dict[str, dict[str, Any] | None] = {WITHOUT: None, MONITOR: {}, MONITOR_ALWAYS: {"attribution": "always"}}
    warmup_steps, measured_steps = every_n_steps, periods * every_n_steps
    rates: dict[str, dict[str, list[float]]] = {name: {"median": [], "wall": []} for name in monitors}
    in_run: dict[str, list[float]] = {name: [] for name in monitors}
    checks: list[int] = []
    divergences: list[float] = []
    names = list(monitors)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            kwargs = monitors[name]
            monitor = None
            if kwargs is not None:
                monitor = RecomputationMonitor(every_n_steps=every_n_steps, on_divergence="ignore", **kwargs)
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
                divergences += [entry["grad_divergence"] for entry in monitor.history]
    ratios = {}
    for name, kwargs in monitors.items():
        if kwargs is None:
            continue
        attributed = kwargs.get("attribution", defaults["attribution"]) == "always"
        check = check_cost["check_attribution/step" if attributed else "check/step"]["median"]
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
