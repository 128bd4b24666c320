"""The ``audit`` command: check a training configuration's recomputation before a long run.

``python -m lightning_ckpt_determinism audit --config CONFIG.yaml`` (or the ``lightning-ckpt-determinism`` console
script) builds the model, the data and the checkpointing strategy from the LightningCLI YAML used for training,
converts the model to the Trainer's precision and checkpoints it as the strategy does, and runs
:func:`~lightning_ckpt_determinism.check_recomputation` with attribution on the first batches, on one process, on the
strategy's device (a multi-process strategy is audited on one process with its checkpointing config, and the output
says so; one that cannot train on this machine, such as FSDP without CUDA, is refused). It prints one row per
checkpointed region and exits 0 when every region reproduces its forward (and the gradients agree), 1 when any
diverges, 2 on a usage or configuration error. A config with a ``memory_budget`` first prints its trade-off at module
and op granularity (the bytes the candidates keep and the share of their recompute cost recomputed, for each
granularity's plan at a sweep of budgets) and the plan for the budget, measured on the first batch; every candidate is
checked, since any of them may be checkpointed.
"""

import argparse
import contextlib
import json
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from tqdm import tqdm

from lightning_ckpt_determinism.audit.arguments import (
    EXIT_DIVERGED,
    EXIT_OK,
    EXIT_USAGE,
    PROGRAM,
    UsageError,
    misspelt_option,
    parser,
)
from lightning_ckpt_determinism.audit.files import finite, json_target, replace_atomically
from lightning_ckpt_determinism.audit.loading import (
    build,
    configs_text,
    fit_notes,
    monitor_settings,
    one_process_notes,
    quiet_lightning,
    train_dataloader,
)
from lightning_ckpt_determinism.audit.plot import trade_off_svg
from lightning_ckpt_determinism.audit.rendering import (
    diverged,
    document,
    footer,
    scan_notes,
    shortfall_note,
    summarize,
    table,
)
from lightning_ckpt_determinism.audit.trade_off import trade_off, trade_off_table
from lightning_ckpt_determinism.checkpointing.budget_plan import (
    CheckpointingPlan,
    check_plannable,
    measure_candidates,
    plan_from_figures,
)
from lightning_ckpt_determinism.checkpointing.rng import capture_rng, restore_rng
from lightning_ckpt_determinism.checkpointing.wrapper import remove_activation_checkpointing
from lightning_ckpt_determinism.errors import CheckpointingConfigError, LightningCkptDeterminismWarning
from lightning_ckpt_determinism.lightning.cli import configuration_error
from lightning_ckpt_determinism.lightning.step import (
    SkippedStep,
    logging_suppressed,
    training_step_arguments,
    training_step_loss,
)
from lightning_ckpt_determinism.lightning.strategies import ActivationCheckpointingMixin
from lightning_ckpt_determinism.verify.compiled import is_compiled
from lightning_ckpt_determinism.verify.compiled.graph_scan import GraphScan, scanned
from lightning_ckpt_determinism.verify.reports import RecomputationReport
from lightning_ckpt_determinism.verify.two_pass import NothingRecomputed, PassFailed, check_recomputation

__all__ = ["main"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""This package's folder: frames in it are not the user's code."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        ``0`` when every checkpointed region reproduces its forward and the gradients agree, ``1`` when any
        diverges, ``2`` on a usage or configuration error (printed as one line on stderr), found before any batch
        runs, or when the ``--json`` report cannot be written in the end (after the verdict is printed).

    Example::

        >>> code = main(["audit", "--config", "examples/configs/broken_python_state.yaml"])  # doctest: +ELLIPSIS
        region    verdict   cause         max diff  first divergent op      hint
        ...
        result: 1 of 4 checkpointed regions diverged: blocks.3
        >>> code
        1
    """
    try:
        args, overrides = parser().parse_known_args(argv)
    except SystemExit as exit_:  # argparse printed the usage and the error, or the help
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    misspelt = misspelt_option(overrides)
    if misspelt is not None:
        print(f"{PROGRAM} audit: error: {misspelt} (see `{PROGRAM} audit --help`)", file=sys.stderr)
        return EXIT_USAGE
    args.overrides = overrides
    try:
        with _importable_from(os.getcwd()), _own_warnings_as_lines(), _seeds_kept():
            return _audit(args)
    except CheckpointingConfigError as err:
        print(f"{PROGRAM} audit: error: {_keyed(err)}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as err:
        print(f"{PROGRAM} audit: error: {err}", file=sys.stderr)
        return EXIT_USAGE


@contextlib.contextmanager
def _seeds_kept() -> Iterator[None]:
    """Every random stream and Lightning's seed variables as they were before the block: the audit's LightningCLI
    seeds everything (``seed_everything``), and a script that audits then trains in one process keeps its own seed."""
    devices = [torch.device("cuda")] if torch.cuda.is_available() else []
    streams = capture_rng(devices)
    variables = {name: os.environ.get(name) for name in _SEED_VARIABLES}
    try:
        yield
    finally:
        restore_rng(streams)
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# What `lightning.seed_everything` sets in the environment.
_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@contextlib.contextmanager
def _own_warnings_as_lines() -> Iterator[None]:
    """The package's warnings printed inside this block as their one line, as a fit prints them (Python's default
    puts the path and line of the audit's code that asked first)."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, LightningCkptDeterminismWarning):
            print(str(message), file=sys.stderr)
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _keyed(err: CheckpointingConfigError) -> str:
    """``err`` naming the config's key, as `fit` names it (``trainer.strategy.checkpointing.every_n``)."""
    return configuration_error(err) or str(err)


@contextlib.contextmanager
def _importable_from(directory: str) -> Iterator[None]:
    """Import from ``directory`` inside this block, as under ``python -m``: the YAML's class paths
    (``examples.gpt.GPTModule``) import from the directory the console script runs in."""
    added = directory not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added:
            sys.path.remove(directory)


def _audit(args: argparse.Namespace) -> int:
    # Before the audit, which may run for minutes: a report that cannot be written is a usage error.
    target = json_target(args.json, args.config) if args.json is not None else None
    picture = _plot_target(args)
    with quiet_lightning():
        cli = build(args)
    strategy = cli.trainer.strategy
    budgeted = cast(ActivationCheckpointingMixin, strategy).checkpointing.memory_budget is not None
    if picture is not None and not budgeted:
        raise UsageError(
            f"`--plot` {str(args.plot)!r} draws a `memory_budget`'s trade-off, and {configs_text(args.config)} sets"
            " none: set `memory_budget` under `trainer.strategy.init_args.checkpointing`, or leave out `--plot`"
        )
    callbacks = cli.trainer.callbacks  # type: ignore[attr-defined]
    notes = one_process_notes(strategy) + fit_notes(cli.fit_arguments) + monitor_settings(args, callbacks)
    loader = train_dataloader(cli)
    with quiet_lightning():
        model = _set_up(cli.model, strategy)
    try:
        reports, seen, scan = _check_batches(model, strategy, loader, cli.datamodule, cli.trainer, args)
        if not reports:
            raise UsageError(
                f"the training data of {configs_text(args.config)} gave no batch whose `training_step` returned a loss"
            )
        if len(reports) < args.batches:
            notes.append(shortfall_note(len(reports), seen, args.batches))
        if scan is not None:
            notes.extend(scan_notes(scan))
        summaries = summarize(reports)
        found = None
        if budgeted:
            plan = _plan(model, strategy, loader, cli.datamodule, cli.trainer)
            found = trade_off(plan)
            print(trade_off_table(found, plan) + "\n")
        print(table(summaries))
        print(footer(reports, summaries, notes, args))
        if target is not None:
            budget = found.figures() if found is not None else None
            report = document(args, str(strategy.root_device), reports, summaries, notes, budget)
            _write(args.json, target, json.dumps(finite(report), indent=2) + "\n", "--json", "report")
        if picture is not None and found is not None:
            _write(args.plot, picture, trade_off_svg(found), "--plot", "picture")
        return EXIT_DIVERGED if diverged(reports) else EXIT_OK
    finally:
        # The caller's process keeps no checkpointed model of the audit's (`main` runs inside Python too).
        remove_activation_checkpointing(model)


def _plot_target(args: argparse.Namespace) -> Path | None:
    """Where ``--plot`` writes, checked before the audit starts."""
    if args.plot is None:
        return None
    if args.plot.suffix.lower() != ".svg":
        raise UsageError(
            f"`--plot` {str(args.plot)!r} must end in .svg: the trade-off is drawn as an SVG picture; give a path such"
            " as trade-off.svg"
        )
    picture = json_target(args.plot, args.config, "--plot")
    if args.json is not None and json_target(args.json, args.config) == picture:
        raise UsageError(f"`--plot` {str(args.plot)!r} is the `--json` file; give each its own path")
    return picture


def _set_up(model: pl.LightningModule, strategy: Any) -> pl.LightningModule:
    """The model as the strategy's setup leaves it on one process: precision first, then checkpointing."""
    model = cast(pl.LightningModule, strategy.precision_plugin.convert_module(model)).to(strategy.root_device)
    try:
        strategy.apply_checkpointing(strategy.select_for_checkpointing(model), model)
    except CheckpointingConfigError as err:
        raise UsageError(_keyed(err)) from err
    except ValueError as err:
        raise UsageError(str(err)) from err
    model.train()
    return model


def _plan(
    model: pl.LightningModule,
    strategy: Any,
    loader: Any,
    datamodule: pl.LightningDataModule | None,
    trainer: pl.Trainer,
) -> CheckpointingPlan:
    """The plan for the config's ``memory_budget``, measured on the first batch that gives a loss, with each
    candidate's op calls, from which the trade-off plans both granularities."""
    try:
        check_plannable(strategy.checkpointing, strategy.root_device)
    except CheckpointingConfigError as err:
        raise UsageError(_keyed(err)) from err
    for batch_idx, batch in enumerate(loader):
        batch = _prepared(model, strategy, batch, datamodule, trainer)

        def step(batch: Any = batch, batch_idx: int = batch_idx) -> None:
            training_step_loss(model, *training_step_arguments(model, batch, batch_idx)).backward()

        try:
            with strategy.precision_plugin.train_step_context(), logging_suppressed(model):
                figures = measure_candidates(model, strategy.checkpointing, step, ops=True)
            return plan_from_figures(figures, strategy.checkpointing)
        except SkippedStep:
            continue
        except CheckpointingConfigError as err:
            raise UsageError(_keyed(err)) from err
    raise UsageError("the training data gave no batch whose `training_step` returned a loss to plan the budget on")


def _prepared(
    model: pl.LightningModule,
    strategy: Any,
    batch: Any,
    datamodule: pl.LightningDataModule | None = None,
    trainer: pl.Trainer | None = None,
) -> Any:
    """``batch`` as `fit` gives it to ``training_step``: converted to the precision's dtype (``"bf16-true"`` casts
    floating inputs to bfloat16), through ``on_before_batch_transfer``, moved to the strategy's device by
    ``transfer_batch_to_device``, then through ``on_after_batch_transfer``; each hook the datamodule's where it
    overrides it, and run with the model and the datamodule attached to ``trainer`` in its training stage, as in
    `fit` (a hook that augments only while ``self.trainer.training``).

    Raises:
        UsageError: If a step fails (a frozen dataclass, which Lightning cannot rebuild, or a hook that raises), as it
            would in `fit`.
    """
    try:
        with _attached(trainer, model, datamodule):
            prepared = _batch_hook(model, datamodule, "on_before_batch_transfer")(
                strategy.precision_plugin.convert_input(batch), 0
            )
            prepared = _batch_hook(model, datamodule, "transfer_batch_to_device")(prepared, strategy.root_device, 0)
            return _batch_hook(model, datamodule, "on_after_batch_transfer")(prepared, 0)
    except Exception as err:
        raise UsageError(
            f"a batch of {type(batch).__name__} cannot be prepared as `fit` prepares it for `training_step` (the"
            " precision's conversion, `on_before_batch_transfer`, the move to the device, `on_after_batch_transfer`):"
            f" {type(err).__name__}: {err}"
        ) from err


@contextlib.contextmanager
def _attached(
    trainer: pl.Trainer | None, model: pl.LightningModule, datamodule: pl.LightningDataModule | None
) -> Iterator[None]:
    """The model and the datamodule attached to ``trainer``, fitting in its training stage, then as they were (the
    trainer's ``datamodule`` stays unset: `fit` attaches it through Lightning's own data connector)."""
    if trainer is None:
        yield
        return
    try:
        held = model.trainer
    except RuntimeError:  # not attached
        held = None
    held_by_data = datamodule.trainer if datamodule is not None else None
    state = (trainer.state.fn, trainer.state.stage)
    model.trainer = trainer
    if datamodule is not None:
        datamodule.trainer = trainer
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    try:
        yield
    finally:
        trainer.state.fn, trainer.state.stage = state
        model.trainer = held  # type: ignore[assignment]
        if datamodule is not None:
            datamodule.trainer = held_by_data


def _batch_hook(model: pl.LightningModule, datamodule: pl.LightningDataModule | None, name: str) -> Any:
    """The datamodule's batch hook ``name`` where it overrides it, else the model's, as `fit` chooses."""
    if datamodule is not None and is_overridden(name, datamodule):
        return getattr(datamodule, name)
    return getattr(model, name)


def _check_batches(
    model: pl.LightningModule,
    strategy: Any,
    loader: Any,
    datamodule: pl.LightningDataModule | None,
    trainer: pl.Trainer,
    args: argparse.Namespace,
) -> tuple[list[RecomputationReport], int, GraphScan | None]:
    """The reports of the first ``--batches`` batches that give a loss, how many batches it took, and the scan."""
    reports: list[RecomputationReport] = []
    seen = 0
    # A compiled model compiles through the graph scan from its first pass: the check's scan of a compiler_recompute
    # divergence then reads the graphs the check compiled, and compiles nothing more.
    scan_graphs = scanned(model) if is_compiled(model) else contextlib.nullcontext()
    # A bar for one batch says nothing and leaves "1/1" in logs; tqdm's `None` hides it off a terminal too.
    hidden = True if args.batches == 1 else None
    with (
        scan_graphs as scan,
        tqdm(total=args.batches, desc="audit", unit="batch", file=sys.stderr, leave=False, disable=hidden) as progress,
    ):
        for batch_idx, batch in enumerate(loader):
            seen += 1
            report = _check_batch(
                model, strategy, _prepared(model, strategy, batch, datamodule, trainer), batch_idx, args
            )
            if report is not None:
                reports.append(report)
                progress.update()
            if len(reports) == args.batches:
                break
    return reports, seen, scan


def _check_batch(
    model: pl.LightningModule, strategy: Any, batch: Any, batch_idx: int, args: argparse.Namespace
) -> RecomputationReport | None:
    def closure() -> torch.Tensor:
        return training_step_loss(model, *training_step_arguments(model, batch, batch_idx))

    try:
        with strategy.precision_plugin.train_step_context(), logging_suppressed(model):
            return check_recomputation(
                model,
                closure,
                tolerance=args.tolerance,
                attribution=True,
                calibrate_noise=args.calibrate_noise,
                exclude_attributes=args.exclude_attributes,
            )
    except SkippedStep:
        return None
    except NothingRecomputed as err:
        raise UsageError(
            "the training step recomputed no checkpointed region, so the audit would compare it with itself: check"
            " that `training_step` calls the modules the config checkpoints, with gradients enabled"
        ) from err
    except PassFailed as err:  # the checkpointed pass failed before its backward: not in a recomputation
        raise UsageError(
            f"the training step runs without checkpointing but fails when run again with it, before its backward"
            f" (where regions are recomputed): {err}"
        ) from err
    except Exception as err:  # the reference pass failed: a problem of the model or config, not of recomputation
        raise UsageError(
            f"the training step fails without checkpointing: {type(err).__name__}: {err}{_raised_in_your_code(err)}"
        ) from err


def _raised_in_your_code(err: BaseException) -> str:
    """Where ``err`` was raised in the user's code: the innermost frame of its traceback outside torch, Lightning
    and this package (``", raised at path:line in name"``), or ``""`` where it has none."""
    libraries = (*(str(Path(str(package.__file__)).parent) for package in (torch, lightning)), str(_PACKAGE_ROOT))
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not frame.filename.startswith(libraries):
            return f", raised at {frame.filename}:{frame.lineno} in {frame.name}"
    return ""


def _write(given: Path, target: Path, text: str, option: str, what: str) -> None:
    try:
        replace_atomically(target, text)
    except OSError as err:
        raise UsageError(
            f"`{option}` {str(given)!r} cannot be written: {err.strerror or err}; the verdict above stands, but no"
            f" {what} was written (an existing file is unchanged)"
        ) from err
