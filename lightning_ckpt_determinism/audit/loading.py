"""Loading what the audit checks from a LightningCLI config: the model, the data and the checkpointing strategy."""

import argparse
import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy, Strategy

from lightning_ckpt_determinism.audit.arguments import UsageError
from lightning_ckpt_determinism.config import resolve_class_path
from lightning_ckpt_determinism.lightning.strategies import ActivationCheckpointingMixin

__all__ = ["build", "one_process_notes", "quiet_lightning", "train_dataloader"]

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")


def build(args: argparse.Namespace) -> LightningCLI:
    if not args.config.is_file():
        raise UsageError(f"`--config` {str(args.config)!r} is not a file")
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
        raise UsageError(f"{args.config} cannot be loaded: {' '.join(str(err).split())}") from err
    strategy = cli.trainer.strategy
    if not isinstance(strategy, ActivationCheckpointingMixin):
        raise UsageError(
            f"`trainer.strategy` in {args.config} is {type(strategy).__name__}, which applies no activation"
            " checkpointing; use one of this package's strategies (e.g."
            " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy) with `checkpointing`"
        )
    _require_runnable_here(strategy, args.config)
    if not cli.model.automatic_optimization:
        raise UsageError(
            f"{type(cli.model).__name__} uses manual optimization: its `training_step` steps the optimizers, so the"
            " audit cannot rerun it; use `RecomputationMonitor(loss_fn=...)` during training instead"
        )
    cli.model.configure_model()
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
    raise UsageError(
        f"`trainer.strategy` {type(strategy).__name__} in {config} needs a CUDA accelerator (Lightning's FSDP"
        f" shards on GPUs only), got {accelerator}; {fix}"
    )


def one_process_notes(strategy: Strategy) -> list[str]:
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
        raise UsageError(f"`--config` {str(args.config)!r} cannot be read: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise UsageError(
            f"`--config` {str(args.config)!r} is no UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8"
        ) from err
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(_yaml_error(args.config, text, err)) from err
    if not isinstance(config, dict):
        raise UsageError(f"{args.config} holds no LightningCLI config (a mapping with `model`, `trainer` ...)")
    for key, option, example in (("model", args.model, "Module"), ("data", args.data, "DataModule")):
        section = config.get(key)
        if option is None and isinstance(section, dict) and "class_path" not in section:
            raise UsageError(
                f"`{key}` in {args.config} names no class: give it `class_path: package.{example}` with its"
                f" settings under `init_args`, or pass `--{key} package.{example}`"
            )
    if args.model is None and "model" not in config:
        raise UsageError(f"{args.config} has no `model`: add one with a `class_path`, or pass `--model`")


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


def train_dataloader(cli: LightningCLI) -> Any:
    try:
        if cli.datamodule is not None:
            cli.datamodule.prepare_data()
            cli.datamodule.setup("fit")
            return cli.datamodule.train_dataloader()
        return cli.model.train_dataloader()
    except Exception as err:
        raise UsageError(f"no training data: {type(err).__name__}: {err}") from err


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
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
