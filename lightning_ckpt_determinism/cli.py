"""The ``audit`` command: check a training configuration's recomputation before a long run.

``python -m lightning_ckpt_determinism audit --config CONFIG.yaml`` (or the ``lightning-ckpt-determinism`` console
script) builds the model, the data and the checkpointing strategy from the LightningCLI YAML used for training,
checkpoints the model as the strategy would, and runs :func:`~lightning_ckpt_determinism.check_recomputation` with
attribution on the first batches, on one process, on the strategy's device and under the Trainer's precision (a
multi-process strategy is audited on one process with its checkpointing config, and the output says so; one that
cannot train on this machine, such as FSDP without CUDA, is refused). It prints one row per checkpointed region and
exits 0 when every region reproduces its forward (and the gradients agree), 1 when any diverges, 2 on a usage or
configuration error.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import stat
import sys
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy, Strategy
from tqdm import tqdm

from lightning_ckpt_determinism._compile import is_compiled
from lightning_ckpt_determinism._graph_scan import GraphScan, scanned
from lightning_ckpt_determinism._lightning_step import (
    SkippedStep,
    logging_suppressed,
    training_step_arguments,
    training_step_loss,
)
from lightning_ckpt_determinism.check import RecomputationReport, check_recomputation
from lightning_ckpt_determinism.config import resolve_class_path
from lightning_ckpt_determinism.strategy import ActivationCheckpointingMixin
from lightning_ckpt_determinism.wrapping import apply_activation_checkpointing

__all__ = ["main"]

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_USAGE = 2
_PROGRAM = "lightning-ckpt-determinism"
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")
_SPECIAL_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a pipe"),
    (stat.S_ISSOCK, "a socket"),
)


class _UsageError(Exception):
    """A problem with the command line or the configuration: reported in one line, exit code 2."""


@dataclass
class _RegionSummary:
    """One region over every checked batch.

    ``verdict`` is ``"diverged"``, ``"noise"`` (it differed, within the noise floor), ``"unchecked"`` (no op of it
    was recomputed: it did not run, or the pass failed before its recomputation) or ``"ok"``. ``data_dependent_ops``
    maps each data-dependent op its forward ran to whether its outputs were kept from the forward in every batch.
    """

    name: str
    verdict: str
    cause: str | None
    max_abs_diff: float
    first_divergent_op: tuple[str, int] | None
    hint: str | None
    batches_diverged: int = 0
    ops_compared: int = 0
    data_dependent_ops: dict[str, bool] = field(default_factory=dict)


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
    if os.getcwd() not in sys.path and "" not in sys.path:
        # As under `python -m`: the YAML's class paths (examples.gpt.GPTModule) import from the directory the
        # console script runs in.
        sys.path.insert(0, os.getcwd())
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse printed the usage and the error, or the help
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return _audit(args)
    except _UsageError as err:
        print(f"{_PROGRAM} audit: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROGRAM, description="Check that activation recomputation is exact.")
    commands = parser.add_subparsers(dest="command", required=True)
    audit = commands.add_parser(
        "audit",
        help="check a LightningCLI training config before a long run",
        description=(
            "Build the model, data and checkpointing strategy from a LightningCLI YAML, check that every checkpointed"
            " region recomputes exactly what its forward produced, and say what to change where it does not."
            " Exit 0 when all regions agree, 1 when any diverges, 2 on a usage or configuration error."
        ),
    )
    audit.add_argument("--config", required=True, type=Path, help="the LightningCLI YAML used for training")
    audit.add_argument("--batches", type=_positive_int, default=1, help="training batches to check (default 1)")
    audit.add_argument("--json", type=Path, help="also write the full report as JSON to this file")
    audit.add_argument(
        "--tolerance", type=_non_negative_float, default=0.0, help="largest gradient divergence counted as equal"
    )
    audit.add_argument(
        "--calibrate-noise",
        action="store_true",
        help="run the reference pass twice and tolerate differences within the noise floor (GPU atomics)",
    )
    audit.add_argument(
        "--model", metavar="CLASS_PATH", help="the LightningModule class, when the YAML's `model` names no class_path"
    )
    audit.add_argument(
        "--data", metavar="CLASS_PATH", help="the LightningDataModule class, when the YAML's `data` names no class_path"
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def _audit(args: argparse.Namespace) -> int:
    # Before the audit, which may run for minutes: a report that cannot be written is a usage error.
    json_target = _json_target(args.json, args.config) if args.json is not None else None
    with _quiet_lightning():
        cli = _build(args)
    model, strategy = cli.model, cli.trainer.strategy
    device = strategy.root_device
    notes = _one_process_notes(strategy)
    loader = _train_dataloader(cli)
    model = cast(pl.LightningModule, strategy.precision_plugin.convert_module(model)).to(device)
    model.train()
    reports: list[RecomputationReport] = []
    seen = 0
    # A compiled model compiles through the graph scan from its first pass: the check's scan of a compiler_recompute
    # divergence then reads the graphs the check compiled, and compiles nothing more.
    scan_graphs = scanned(model) if is_compiled(model) else contextlib.nullcontext()
    with (
        scan_graphs as scan,
        tqdm(total=args.batches, desc="audit", unit="batch", file=sys.stderr, leave=False) as progress,
    ):
        for batch_idx, batch in enumerate(loader):
            seen += 1
            report = _check_batch(model, strategy, model.transfer_batch_to_device(batch, device, 0), batch_idx, args)
            if report is not None:
                reports.append(report)
                progress.update()
            if len(reports) == args.batches:
                break
    if not reports:
        raise _UsageError(f"the training data of {args.config} gave no batch whose `training_step` returned a loss")
    if len(reports) < args.batches:
        notes.append(_shortfall_note(len(reports), seen, args.batches))
    if scan is not None:
        notes.extend(_scan_notes(scan))
    summaries = _summarize(reports)
    print(_table(summaries))
    print(_footer(reports, summaries, notes, args))
    if json_target is not None:
        _write_json(args, json_target, str(device), reports, summaries, notes)
    return EXIT_DIVERGED if _diverged(reports) else EXIT_OK


def _build(args: argparse.Namespace) -> LightningCLI:
    if not args.config.is_file():
        raise _UsageError(f"`--config` {str(args.config)!r} is not a file")
    _require_class_paths(args)
    try:
        model_class = resolve_class_path(args.model) if args.model else None
        data_class = resolve_class_path(args.data) if args.data else None
        with warnings.catch_warnings():
            # The audit's own command line is not LightningCLI's; `args` is all it should read.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            cli = LightningCLI(
                model_class,
                data_class,
                subclass_mode_model=model_class is None,
                subclass_mode_data=data_class is None,
                args=["--config", str(args.config)],
                run=False,
                save_config_callback=None,
                seed_everything_default=0,
                parser_kwargs={"exit_on_error": False},
            )
    except Exception as err:
        raise _UsageError(f"{args.config} cannot be loaded: {' '.join(str(err).split())}") from err
    strategy = cli.trainer.strategy
    if not isinstance(strategy, ActivationCheckpointingMixin):
        raise _UsageError(
            f"`trainer.strategy` in {args.config} is {type(strategy).__name__}, which applies no activation"
            " checkpointing; use one of this package's strategies (e.g."
            " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy) with `checkpointing`"
        )
    _require_runnable_here(strategy, args.config)
    if not cli.model.automatic_optimization:
        raise _UsageError(
            f"{type(cli.model).__name__} uses manual optimization: its `training_step` steps the optimizers, so the"
            " audit cannot rerun it; use `RecomputationMonitor(loss_fn=...)` during training instead"
        )
    try:
        cli.model.configure_model()
        apply_activation_checkpointing(cli.model, strategy.checkpointing)
    except ValueError as err:
        raise _UsageError(str(err)) from err
    return cli


def _require_runnable_here(strategy: Strategy, config: Path) -> None:
    """Refuse a strategy that cannot train on this machine, which the audit's single unwrapped process would hide.

    Lightning's accelerator connector demands a CUDA accelerator of FSDP, but only of ``FSDPStrategy`` itself and
    its registered names (``type(strategy) is FSDPStrategy``): a subclass such as ``FSDPCheckpointingStrategy``
    passes the Trainer's construction and fails in ``fit``, where torch's FSDP finds no accelerator device. Here the
    same rule holds for every subclass, and the accelerator says whether the machine could follow it.
    """
    if not isinstance(strategy, FSDPStrategy) or isinstance(strategy.accelerator, CUDAAccelerator):
        return
    accelerator = type(strategy.accelerator).__name__
    fix = (
        "set `trainer.accelerator: cuda`"
        if CUDAAccelerator.is_available()
        else "this machine has none: audit with lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy and"
        " the same `checkpointing`, or on a machine with a GPU"
    )
    raise _UsageError(
        f"`trainer.strategy` {type(strategy).__name__} in {config} needs a CUDA accelerator (Lightning's FSDP"
        f" shards on GPUs only), got {accelerator}; {fix}"
    )


def _one_process_notes(strategy: Strategy) -> list[str]:
    """The audit runs the unwrapped model on one process; say so when training would run several."""
    if not isinstance(strategy, ParallelStrategy):
        return []
    devices, nodes = len(strategy.parallel_devices or []), getattr(strategy, "num_nodes", 1)
    if devices * nodes <= 1:
        return []
    where = f"{devices} devices" + (f" on each of {nodes} nodes" if nodes > 1 else "")
    return [
        f"note: {type(strategy).__name__} with {where} is audited on one process with the same checkpointing config"
    ]


def _require_class_paths(args: argparse.Namespace) -> None:
    """A YAML written for ``LightningCLI(MyModule, MyData)`` does not name its classes: the audit must be told."""
    try:
        text = args.config.read_text(encoding="utf-8")
    except OSError as err:
        raise _UsageError(f"`--config` {str(args.config)!r} cannot be read: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise _UsageError(
            f"`--config` {str(args.config)!r} is no UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8"
        ) from err
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise _UsageError(_yaml_error(args.config, text, err)) from err
    if not isinstance(config, dict):
        raise _UsageError(f"{args.config} holds no LightningCLI config (a mapping with `model`, `trainer` ...)")
    for key, option, example in (("model", args.model, "Module"), ("data", args.data, "DataModule")):
        section = config.get(key)
        if option is None and isinstance(section, dict) and "class_path" not in section:
            raise _UsageError(
                f"`{key}` in {args.config} names no class: give it `class_path: package.{example}` with its"
                f" settings under `init_args`, or pass `--{key} package.{example}`"
            )
    if args.model is None and "model" not in config:
        raise _UsageError(f"{args.config} has no `model`: add one with a `class_path`, or pass `--model`")


def _yaml_error(path: Path, text: str, err: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: ``file:line:column`` (1-based) and yaml's problem."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        line, column = err.problem_mark.line, err.problem_mark.column
        problem = " ".join(part for part in (err.problem, err.context) if part)
    elif isinstance(err, yaml.reader.ReaderError):
        line = text.count("\n", 0, err.position)
        column = err.position - (text.rfind("\n", 0, err.position) + 1)
        problem = f"unacceptable character #x{err.character:04x}: {err.reason}"
    else:
        return f"{path} is no valid YAML: {' '.join(str(err).split())}; correct the file"
    return f"{path}:{line + 1}:{column + 1}: invalid YAML: {problem}; correct the file there"


def _train_dataloader(cli: LightningCLI) -> Any:
    try:
        if cli.datamodule is not None:
            cli.datamodule.prepare_data()
            cli.datamodule.setup("fit")
            return cli.datamodule.train_dataloader()
        return cli.model.train_dataloader()
    except Exception as err:
        raise _UsageError(f"no training data: {type(err).__name__}: {err}") from err


def _check_batch(
    model: pl.LightningModule, strategy: Any, batch: Any, batch_idx: int, args: argparse.Namespace
) -> RecomputationReport | None:
    def closure() -> torch.Tensor:
        return training_step_loss(model, *training_step_arguments(model, batch, batch_idx))

    try:
        with strategy.precision_plugin.train_step_context(), logging_suppressed(model):
            return check_recomputation(
                model, closure, tolerance=args.tolerance, attribution=True, calibrate_noise=args.calibrate_noise
            )
    except SkippedStep:
        return None
    except Exception as err:  # the reference pass failed: a problem of the model or config, not of recomputation
        raise _UsageError(f"the training step fails without checkpointing: {type(err).__name__}: {err}") from err


def _summarize(reports: list[RecomputationReport]) -> list[_RegionSummary]:
    summaries: dict[str, _RegionSummary] = {}
    for report in reports:
        for region in report.regions:
            summary = summaries.setdefault(region.name, _RegionSummary(region.name, "ok", None, 0.0, None, None))
            summary.max_abs_diff = max(summary.max_abs_diff, region.max_abs_diff)
            summary.batches_diverged += region.diverged
            first_of_its_kind = summary.cause is None or (region.diverged and summary.verdict != "diverged")
            if region.cause is not None and first_of_its_kind:
                summary.cause, summary.hint = region.cause, region.hint
                summary.first_divergent_op = region.first_divergent_op
            if region.diverged:
                summary.verdict = "diverged"
            elif region.cause is not None and summary.verdict == "ok":
                summary.verdict = "noise"
            summary.ops_compared += region.ops_compared
            for op, kept in region.data_dependent_ops.items():
                summary.data_dependent_ops[op] = summary.data_dependent_ops.get(op, True) and kept
    for summary in summaries.values():
        if summary.verdict == "ok" and summary.ops_compared == 0:
            summary.verdict = "unchecked"
    return list(summaries.values())


def _diverged(reports: list[RecomputationReport]) -> bool:
    return any(report.diverged or any(region.diverged for region in report.regions) for report in reports)


def _table(summaries: list[_RegionSummary]) -> str:
    header = ("region", "verdict", "cause", "max diff", "first divergent op", "hint")
    rows = [header]
    for summary in summaries:
        op = "-"
        if summary.first_divergent_op is not None:
            op = f"{summary.first_divergent_op[0]} (op {summary.first_divergent_op[1]})"
        rows.append(
            (
                summary.name,
                summary.verdict,
                summary.cause or "-",
                f"{summary.max_abs_diff:.3g}",
                op,
                summary.hint or "-",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in rows
    )


def _scan_notes(scan: GraphScan) -> list[str]:
    """Say what the scan of the compiled backward graphs covered."""
    notes = [
        f"note: {scan.scanned_graphs} compiled backward graph{'s' if scan.scanned_graphs != 1 else ''} scanned for"
        " random ops that recomputation draws afresh instead of replaying"
    ]
    notes.extend(
        f"note: {part} is not scanned (inductor and aot_autograd backends are): a compiler_recompute divergence there"
        " names no region"
        for part in scan.unscanned
    )
    return notes


def _shortfall_note(checked: int, seen: int, asked: int) -> str:
    """Say that the training data ran out before ``--batches`` were checked."""
    skipped = seen - checked
    no_loss = f", and `training_step` returned no loss for {skipped}" if skipped else ""
    return f"note: checked {_batches(checked)}: the training data has only {seen}{no_loss} (asked for {asked})"


def _batches(count: int) -> str:
    return f"{count} batch{'es' if count != 1 else ''}"


def _footer(
    reports: list[RecomputationReport], summaries: list[_RegionSummary], notes: list[str], args: argparse.Namespace
) -> str:
    divergence = max(report.grad_divergence for report in reports)
    noise = max(report.noise_floor for report in reports)
    lines = [
        f"gradients: grad_divergence up to {divergence:.3g} over {_batches(len(reports))} (tolerance {args.tolerance:g}"
        + (f", noise floor {noise:.3g})" if args.calibrate_noise else ")"),
        *notes,
    ]
    lines.extend(_data_dependent_line(summary) for summary in summaries if summary.data_dependent_ops)
    buffers = list(dict.fromkeys(name for report in reports for name in report.buffer_mutations))
    if buffers:
        lines.append(f"buffers changed by recomputation: {', '.join(buffers)}")
    errors = list(dict.fromkeys(report.error.splitlines()[0] for report in reports if report.error))
    lines.extend(f"error: {error}" for error in errors)
    if any(report.compiled for report in reports):
        scanned_regions = any(summary.cause == "compiler_recompute" for summary in summaries)
        lines.append(
            "compiled: both passes ran compiled; the regions were compared with eager semantics (the same step run"
            " under torch.compiler.set_stance('force_eager'))"
            + ("; compiler_recompute regions were found in the compiled backward graphs" if scanned_regions else "")
        )
    diverged = [summary.name for summary in summaries if summary.verdict == "diverged"]
    if diverged:
        lines.append(
            f"result: {len(diverged)} of {len(summaries)} checkpointed regions diverged: {', '.join(diverged)}"
        )
    elif any(report.cause == "compiler_recompute" for report in reports):
        hint = next(report.hint for report in reports if report.cause == "compiler_recompute")
        lines.append(f"result: diverged: compiler_recompute: {hint}")
    elif _diverged(reports):
        lines.append(
            "result: diverged: every region recomputed what its forward produced, but the gradients of the two"
            " passes differ (Python state a module changes in forward, such as a counter)"
        )
    else:
        noise = sum(summary.verdict == "noise" for summary in summaries)
        within = f" ({noise} differ within the noise floor)" if noise else ""
        lines.append(f"result: none of the {len(summaries)} checkpointed regions diverged{within}")
    return "\n".join(lines)


def _data_dependent_line(summary: _RegionSummary) -> str:
    ops = ", ".join(f"{op} ({'kept' if kept else 'recomputed'})" for op, kept in summary.data_dependent_ops.items())
    return f"data-dependent ops in {summary.name}: {ops}"


def _write_json(
    args: argparse.Namespace,
    target: Path,
    device: str,
    reports: list[RecomputationReport],
    summaries: list[_RegionSummary],
    notes: list[str],
) -> None:
    document = {
        "config": str(args.config),
        "device": device,
        "batches": len(reports),
        "batches_asked": args.batches,
        "tolerance": args.tolerance,
        "calibrate_noise": args.calibrate_noise,
        "diverged": _diverged(reports),
        "notes": notes,
        "regions": [asdict(summary) for summary in summaries],
        "buffer_mutations": list(dict.fromkeys(name for report in reports for name in report.buffer_mutations)),
        "checks": [asdict(report) for report in reports],
    }
    try:
        _replace_atomically(target, json.dumps(_finite(document), indent=2) + "\n")
    except OSError as err:
        raise _UsageError(
            f"`--json` {str(args.json)!r} cannot be written: {err.strerror or err}; the verdict above stands, but no"
            " report was written (an existing file is unchanged)"
        ) from err


def _json_target(path: Path, config: Path) -> Path:
    """The file ``--json`` names (through symbolic links), once it is known that the report can replace it.

    An existing path must be a regular file the user may write; the directory must take a new file, as the report
    is written beside the target first and then moved onto it. Nothing of the user's is removed.
    """
    target = Path(os.path.realpath(path))
    if target == Path(os.path.realpath(config)):
        raise _UsageError(f"`--json` {str(path)!r} is the `--config` file; give another path for the report")
    if target.exists():
        mode = target.stat().st_mode
        if stat.S_ISDIR(mode):
            raise _UsageError(f"`--json` {str(path)!r} is a directory; give the path of a file in it for the report")
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _SPECIAL_FILES if test(mode)), "not a regular file")
            raise _UsageError(
                f"`--json` {str(path)!r} is {kind}; the report goes to a new or an existing regular file: give the"
                " path of one"
            )
        if not os.access(target, os.W_OK):
            raise _UsageError(
                f"`--json` {str(path)!r} is read-only (mode {stat.S_IMODE(mode):o}); make it writable (chmod u+w) or"
                " give another path"
            )
    elif not target.parent.is_dir():
        raise _UsageError(f"`--json` {str(path)!r} cannot be written: {str(target.parent)!r} is no directory")
    try:
        os.unlink(_create_beside(target))
    except OSError as err:
        raise _UsageError(
            f"`--json` {str(path)!r} cannot be written: no new file can be made in {str(target.parent)!r}"
            f" ({err.strerror or err}); give a path in a writable directory"
        ) from err
    return target


def _create_beside(target: Path) -> Path:
    """A new empty file in ``target``'s directory, with the permissions a new file gets there (the umask's)."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return temporary


def _replace_atomically(target: Path, text: str) -> None:
    """Write ``text`` to a new file beside ``target`` and move it onto ``target``: a failed write (a full disk)
    leaves ``target`` as it was and no temporary file behind. An existing ``target`` keeps its permissions."""
    temporary = _create_beside(target)
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, which JSON lacks."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Keep Lightning's informational lines (seed, accelerators, tips) out of the audit's output."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
