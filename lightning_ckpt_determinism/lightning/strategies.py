"""Apply activation checkpointing inside any Lightning strategy, in the order that strategy needs."""

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ckpt_determinism._library_compat import ModelSetupHook
from lightning_ckpt_determinism.checkpointing import (
    checkpointed_modules,
    remove_activation_checkpointing,
    select_modules,
)
from lightning_ckpt_determinism.checkpointing.auto import auto_layers
from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan, check_budget_device
from lightning_ckpt_determinism.checkpointing.selection import checkpoint_selected
from lightning_ckpt_determinism.checkpointing.wrapper import routes
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    CheckpointingTypeError,
    LightningCkptDeterminismWarning,
)
from lightning_ckpt_determinism.lightning.fit_budget import BudgetedCheckpointing
from lightning_ckpt_determinism.lightning.fit_output import FitOutput
from lightning_ckpt_determinism.lightning.support import DDPSupport, FSDPSupport, StrategySupport, stock_support

__all__ = [
    "ActivationCheckpointingMixin",
    "DDPCheckpointingStrategy",
    "FSDPCheckpointingStrategy",
    "ModelParallelCheckpointingStrategy",
    "SingleDeviceCheckpointingStrategy",
]


class ActivationCheckpointingMixin(ModelSetupHook):
    """Adds non-reentrant activation checkpointing of configured submodules to a Lightning strategy.

    Put it first among the bases: ``class MyStrategy(ActivationCheckpointingMixin, DDPStrategy)``. The config is
    applied when the strategy sets up the model, after ``LightningModule.configure_model`` has run (so modules
    created there are covered) and after Lightning's own module conversions (``sync_batchnorm``, precision), then
    before the strategy wraps the model (DDP) or after it (strategies that set ``_checkpoint_after_wrapping``,
    as FSDP requires). Strategies that leave the wrapping to ``configure_model`` (``ModelParallelStrategy``) get
    it at the end of their setup, when fitting. Module names in the config are relative to the LightningModule.
    Checkpointing applied by the strategy is removed again at teardown, leaving the model as it was given.

    With a ``memory_budget``, the first training batch runs with every match checkpointed and measures them; from the
    second batch on, the plan (:attr:`checkpointing_plan`) applies, the same on every rank, and rank zero logs it.

    Args:
        checkpointing: Which submodules to checkpoint and how. ``None`` is rejected: the type admits it so that a
            YAML ``checkpointing: null`` reaches the error that says what to give instead, rather than failing
            inside LightningCLI's parser.
        *args: Passed to the base strategy.
        **kwargs: Passed to the base strategy.

    Raises:
        CheckpointingConfigError: If ``checkpointing`` is not a :class:`CheckpointingConfig` (also a ``TypeError``
            then), or at setup, before any training step, if the config matches no module or its ``memory_budget`` is
            ``"auto"`` off CUDA.

    Example::

        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> from lightning_ckpt_determinism import ActivationCheckpointingMixin, CheckpointingConfig
        >>> class MyStrategy(ActivationCheckpointingMixin, SingleDeviceStrategy):
        ...     pass
        >>> strategy = MyStrategy(checkpointing=CheckpointingConfig(classes=["Block"]), device="cpu")
        >>> strategy.checkpointing.classes
        ['Block']
    """

    _checkpoint_after_wrapping: ClassVar[bool] = False
    # What the monitor needs of the strategy; `None`: what it needs of the stock strategy it is built on.
    _monitor_support: ClassVar[type[StrategySupport] | None] = None

    def __init__(self, *args: Any, checkpointing: CheckpointingConfig | None, **kwargs: Any) -> None:
        if checkpointing is None:
            raise CheckpointingTypeError(
                f"`checkpointing` is missing: `{type(self).__name__}` needs one. Build it with"
                " `CheckpointingConfig(classes=[...])`, or in YAML give the strategy"
                " `init_args: {checkpointing: {classes: [Block]}}`."
            )
        if not isinstance(checkpointing, CheckpointingConfig):
            raise CheckpointingTypeError(
                f"`checkpointing` must be a `CheckpointingConfig`, got {type(checkpointing).__name__}."
                + (
                    _device_first_hint(type(self), checkpointing)
                    or " Build one with `CheckpointingConfig(classes=[...])` or give a mapping such as"
                    " `checkpointing: {classes: [Block]}` in YAML."
                )
            )
        self.checkpointing = checkpointing
        self._applied_checkpointing: dict[str, nn.Module] = {}
        # What `apply_checkpointing` checkpointed, in which module: a budget measures them all again after a restore.
        self._selected: tuple[nn.Module, dict[str, nn.Module]] | None = None
        # The line `apply_checkpointing` last said this fit: validate, test and predict apply the same again.
        self._said_applied: str | None = None
        self._model_set_up = False
        self._budgeted: BudgetedCheckpointing | None = None
        # The package's warnings and notes while this strategy's run lasts (see `fit_output`).
        self._fit_output = FitOutput()
        # Training batches started this fit: at the second, the regions that route are named.
        self._batches_started = 0
        # The global step the latest training batch started at: a later batch starting before it restarted the loop.
        self._batch_step = -1
        super().__init__(*args, **kwargs)

    @property
    def checkpointing_plan(self) -> CheckpointingPlan | None:
        """The plan a ``memory_budget`` chose in this fit, from its second training batch on; ``None`` before, and
        without a budget."""
        return self._budgeted.plan if self._budgeted is not None else None

    def setup(self, trainer: "pl.Trainer") -> None:
        self._model_set_up = False
        if trainer.state.fn == TrainerFn.FITTING:  # each fit says what it applies, once
            self._said_applied = None
        self._batches_started, self._batch_step = 0, -1
        self._fit_output.hold(trainer)
        if self.checkpointing.memory_budget is not None:
            check_budget_device(self.checkpointing, self.root_device)  # type: ignore[attr-defined]
            self._budgeted = BudgetedCheckpointing(self.checkpointing)
        super().setup(trainer)  # type: ignore[misc]
        if not self._model_set_up and trainer.state.fn == TrainerFn.FITTING:
            # Some strategies never call `_setup_model` (ModelParallelStrategy; FSDP with `configure_sharded_model`):
            # the user's `configure_model` has wrapped the model already, so it is final once their setup returns.
            self.apply_checkpointing(self.select_for_checkpointing(self.lightning_module))  # type: ignore[attr-defined]

    def _around_setup_model(self, model: nn.Module, setup: Callable[[nn.Module], nn.Module]) -> nn.Module:
        self._model_set_up = True
        selected = self.select_for_checkpointing(self.lightning_module)  # type: ignore[attr-defined]
        if self._checkpoint_after_wrapping:
            # The wrapper (FSDP) must own the modules before their forward is checkpointed; they were selected
            # above, while their names were still those of the LightningModule.
            model = setup(model)
            self.apply_checkpointing(selected)
            return model
        # Before the wrapper (DDP) registers its hooks on the model.
        self.apply_checkpointing(selected)
        return setup(model)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        root = self.lightning_module  # type: ignore[attr-defined]
        if root.trainer.global_step < self._batch_step:
            # `BatchSizeFinder` starts each trial, at its next batch size, from step 0: the trial measures anew.
            self._measure_again()
        self._batch_step = root.trainer.global_step
        if self._budgeted is not None:
            # Before the batch's forward, on every rank alike: the plan's reduction is a collective.
            made_plain = self._budgeted.batch_started(
                self, root, self._applied_checkpointing, batch, root.trainer.loggers, root.trainer.global_step
            )
            for name in made_plain:
                del self._applied_checkpointing[name]
        self._batches_started += 1
        if self._batches_started == 2:
            self._name_routing_regions()

    def _name_routing_regions(self) -> None:
        """Once the first batch's forward has run every region: one info line naming those whose forward ran a
        data-dependent op, which ``keep_data_dependent`` guards (none for a model without such ops)."""
        if not self.checkpointing.keep_data_dependent:
            return
        routing = [name for name, module in self._applied_checkpointing.items() if routes(module)]
        if routing:
            rank_zero_info(_routing_line(routing))

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning's finders (`BatchSizeFinder`, `LearningRateFinder`) restore the model after trial batches, which a
        # `memory_budget` measured (and planned from, at another batch size): the training that follows measures anew.
        self._measure_again()
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]

    def _measure_again(self) -> None:
        """Forget what a ``memory_budget`` measured or planned this fit: every candidate checkpointed again, and the
        next training batch measured as the first."""
        if self._budgeted is None or not self._budgeted.started or self._selected is None:
            return
        self._remove_checkpointing()
        root, selected = self._selected
        checkpoint_selected(root, selected, self.checkpointing)
        self._applied_checkpointing = dict(selected)
        self._budgeted = BudgetedCheckpointing(self.checkpointing)
        self._batches_started = 0

    def _remove_checkpointing(self) -> None:
        """Stop a budget's measurement and remove the checkpointing this strategy applied."""
        if self._budgeted is not None:
            self._budgeted.stop()
        for module in self._applied_checkpointing.values():
            remove_activation_checkpointing(module)
        self._applied_checkpointing = {}

    def teardown(self) -> None:
        self._remove_checkpointing()
        self._selected = None
        self._fit_output.release()
        super().teardown()  # type: ignore[misc]

    def measurement_paused(self) -> AbstractContextManager[None]:
        """A block whose forwards a ``memory_budget``'s measurement of the first training batch does not count:
        :class:`~lightning_ckpt_determinism.RecomputationMonitor` runs each check's passes inside it, so that a
        monitored fit measures, plans and trains as one without the monitor. Nothing to pause outside that batch.

        Example::

            >>> strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"]))
            >>> with strategy.measurement_paused():
            ...     pass
        """
        if self._budgeted is None:
            return contextlib.nullcontext()
        return self._budgeted.not_counting()

    def monitor_support(self) -> StrategySupport | None:
        """What :class:`~lightning_ckpt_determinism.RecomputationMonitor` needs of this strategy (its gradient
        holders, how it takes gradients): what the class declares, else what it needs of the Lightning strategy this
        one is built on; ``None`` when that is none the monitor is tested under, and the monitor does not run.

        Example::

            >>> from lightning.pytorch.strategies import DDPStrategy
            >>> class MyStrategy(ActivationCheckpointingMixin, DDPStrategy):
            ...     pass
            >>> type(MyStrategy(checkpointing=CheckpointingConfig(classes=["Block"])).monitor_support()).__name__
            'DDPSupport'
        """
        if self._monitor_support is not None:
            return self._monitor_support(self)  # type: ignore[arg-type]
        return stock_support(self)  # type: ignore[arg-type]

    def select_for_checkpointing(self, module: nn.Module) -> dict[str, nn.Module]:
        """The submodules of ``module`` this strategy's config selects, by name; none when checkpointing is applied
        already (by this strategy, or to the model by hand, which is warned).

        Args:
            module: The LightningModule, as the strategy sets it up.

        Raises:
            CheckpointingConfigError: If the config matches no module.
        """
        if self._applied_checkpointing:
            return {}
        already = checkpointed_modules(module)
        if already:
            budget = self.checkpointing.memory_budget
            ignored = f", nor its `memory_budget` ({budget!r})" if budget is not None else ""
            rank_zero_warn(
                f"lightning_ckpt_determinism: {len(already)} module{'s' if len(already) != 1 else ''} of"
                f" {type(module).__name__} {'are' if len(already) != 1 else 'is'} already checkpointed"
                f" ({_summary(already)}); `{type(self).__name__}` leaves them as they are and applies"
                f" nothing{ignored}. Remove `apply_activation_checkpointing` from the model to let the strategy apply"
                " it; a model saved or copied while checkpointed (`torch.save`, `copy.deepcopy` during a fit) carries"
                " its checkpointing with it: call `remove_activation_checkpointing` on it first.",
                category=LightningCkptDeterminismWarning,
            )
            self._budgeted = None
            return {}
        return select_modules(module, self.checkpointing)

    def apply_checkpointing(self, selected: dict[str, nn.Module], root: nn.Module | None = None) -> None:
        """Checkpoint the modules :meth:`select_for_checkpointing` chose, with one info line saying what was done
        (said once a fit while it stays the same: ``validate``, ``test`` and ``predict`` apply it again);
        :meth:`teardown` removes it again. A transformers model around them runs without its key-value cache
        meanwhile (see :func:`~lightning_ckpt_determinism.apply_activation_checkpointing`).

        Args:
            selected: The modules by name.
            root: The module they were selected in; ``None`` for the strategy's LightningModule.
        """
        if not selected:
            return
        root = root if root is not None else self.lightning_module  # type: ignore[attr-defined]
        checkpoint_selected(root, selected, self.checkpointing)
        self._applied_checkpointing.update(selected)
        self._selected = (root, dict(selected))
        chose = f", chosen by `auto`: {auto_layers(root).reason}" if self.checkpointing.classes == "auto" else ""
        # Under a budget every match is checkpointed for the first batch's measurement only: say the plan is to come.
        pending = (
            f" The memory_budget's plan is pending: the first batch measures these {len(selected)} checkpointed, and"
            " from the second the plan keeps some of them plain (its own line says which)."
            if self.checkpointing.memory_budget is not None
            else ""
        )
        unwatched = (
            " Nothing checks its recomputation: add `RecomputationMonitor` to the Trainer's callbacks."
            if not _monitored(root)
            else ""
        )
        line = (
            f"lightning_ckpt_determinism: activation checkpointing (non-reentrant) applied to {len(selected)}"
            f" module{'s' if len(selected) != 1 else ''} ({_summary(selected)}{chose});"
            f" every_n={self.checkpointing.every_n}, save_ops={self.checkpointing.save_ops or 'none'}.{pending}"
            f"{unwatched}"
        )
        if line != self._said_applied:
            rank_zero_info(line)
            self._said_applied = line


def _monitored(root: nn.Module) -> bool:
    """Whether the Trainer fitting ``root`` has a ``RecomputationMonitor`` (``True`` where no Trainer is attached)."""
    from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor

    if not isinstance(root, pl.LightningModule):
        return True
    try:
        callbacks = root.trainer.callbacks  # type: ignore[attr-defined]
    except RuntimeError:  # not attached to a Trainer
        return True
    return any(isinstance(callback, RecomputationMonitor) for callback in callbacks)


def _routing_line(regions: list[str]) -> str:
    """The info line for the regions whose forward ran data-dependent ops, which ``keep_data_dependent`` guards."""
    named = ", ".join(regions[:6]) + (" ..." if len(regions) > 6 else "")
    return (
        f"lightning_ckpt_determinism: keep_data_dependent keeps the outputs of the data-dependent ops (topk, sort,"
        f" argmax, nonzero, bincount, item ...) that {len(regions)} region{'s' if len(regions) != 1 else ''} ran in"
        f" the first batch ({named}) and serves them to their recomputation, so that it routes as the forward did;"
        " floating outputs are kept up to the size of the region's largest input."
    )


def _summary(modules: dict[str, nn.Module]) -> str:
    counts = Counter(type(module).__name__ for module in modules.values())
    return ", ".join(f"{count} x {name}" for name, count in counts.items())


class SingleDeviceCheckpointingStrategy(ActivationCheckpointingMixin, SingleDeviceStrategy):
    """Lightning's single-device strategy with activation checkpointing of the configured submodules.

    Args:
        checkpointing: Which submodules to checkpoint and how; ``None`` (YAML ``null``) is rejected with an error.
        device: The device to train on; ``None`` (the default) follows the Trainer's accelerator and ``devices``, as
            Lightning's own ``SingleDeviceStrategy`` is chosen: ``cuda:0`` under ``accelerator="gpu"`` (or ``"auto"``
            on a CUDA machine), ``cuda:1`` with ``devices=[1]``, the CPU under ``accelerator="cpu"``. Before the
            Trainer connects it, the strategy reports the CPU. ``"cuda"`` without an index is the current CUDA device
            (``cuda:0`` before CUDA starts).
        **kwargs: The remaining arguments of :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, SingleDeviceCheckpointingStrategy
        >>> strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"]))
        >>> strategy.root_device
        device(type='cpu')
    """

    _monitor_support = StrategySupport

    def __init__(self, checkpointing: CheckpointingConfig | None, device: str | None = None, **kwargs: Any) -> None:
        super().__init__(checkpointing=checkpointing, device="cpu" if device is None else _indexed(device), **kwargs)
        self._device_given = device is not None

    # Lightning's Trainer gives a strategy with `parallel_devices` the devices it chose from `accelerator` and
    # `devices` when the strategy has none of its own: the first of them is the device, unless one was given.
    @property
    def parallel_devices(self) -> list[torch.device]:
        """The device given, or none before the Trainer chooses it (then the Trainer's choice)."""
        return [self.root_device] if self._device_given else []

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Any]) -> None:
        if devices and not self._device_given:
            self._root_device = torch.device(devices[0])


def _device_first_hint(strategy: type, given: object) -> str:
    """What to write where a device was given in ``checkpointing``'s place (the first argument), else nothing."""
    if not isinstance(given, (str, torch.device)):
        return ""
    try:
        device = str(torch.device(given))
    except (RuntimeError, ValueError):
        return ""
    if "device" not in inspect.signature(strategy).parameters:
        return f" {device!r} reads as a device: give devices to the Trainer (`accelerator`, `devices`)."
    return (
        f" {device!r} reads as a device, and `checkpointing` comes first: pass the device by name,"
        f" `{strategy.__name__}(checkpointing=CheckpointingConfig(...), device={device!r})`."
    )


def _indexed(device: str) -> torch.device:
    """``device`` with its index: ``"cuda"`` alone is the current CUDA device (the first before CUDA starts), which
    ``torch.cuda.set_device`` needs by number when Lightning sets the device up."""
    parsed = torch.device(device)
    if parsed.type != "cuda" or parsed.index is not None:
        return parsed
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)


class DDPCheckpointingStrategy(ActivationCheckpointingMixin, DDPStrategy):  # type: ignore[misc]
    """Lightning's DDP strategy with activation checkpointing applied before DDP wraps the model.

    Args:
        checkpointing: Which submodules to checkpoint and how; ``None`` (YAML ``null``) is rejected with an error.
        **kwargs: The arguments of :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, DDPCheckpointingStrategy
        >>> strategy = DDPCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
        >>> strategy.checkpointing.names
        ['model.blocks.*']
    """

    _monitor_support = DDPSupport

    def __init__(self, checkpointing: CheckpointingConfig | None, **kwargs: Any) -> None:
        super().__init__(checkpointing=checkpointing, **kwargs)


class FSDPCheckpointingStrategy(ActivationCheckpointingMixin, FSDPStrategy):
    """Lightning's FSDP strategy with this package's checkpointing applied after FSDP wraps the model.

    Lightning's own FSDP checkpointing replaces modules with a wrapper; this one keeps the modules and adds RNG
    replay, buffer protection and the recomputation check. FSDP needs CUDA in Lightning.

    Args:
        checkpointing: Which submodules to checkpoint and how; ``None`` (YAML ``null``) is rejected with an error.
        **kwargs: The arguments of :class:`~lightning.pytorch.strategies.FSDPStrategy`, except its own
            ``activation_checkpointing`` and ``activation_checkpointing_policy``.

    Raises:
        CheckpointingConfigError: If FSDP's own activation checkpointing is also requested.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, FSDPCheckpointingStrategy
        >>> strategy = FSDPCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"]))
        >>> strategy.checkpointing.classes
        ['Block']
    """

    _monitor_support = FSDPSupport
    _checkpoint_after_wrapping = True

    def __init__(self, checkpointing: CheckpointingConfig | None, **kwargs: Any) -> None:
        for own in ("activation_checkpointing", "activation_checkpointing_policy"):
            if kwargs.get(own) is not None:
                raise CheckpointingConfigError(
                    f"`{own}` is FSDP's own activation checkpointing; `FSDPCheckpointingStrategy` applies"
                    " `checkpointing` instead. Pass one of them, not both."
                )
        super().__init__(checkpointing=checkpointing, **kwargs)

    def setup_environment(self) -> None:
        """Refuse a CPU device in one line before any process group starts: FSDP1 wraps modules on CUDA only."""
        if self.root_device.type == "cpu":
            raise CheckpointingConfigError(
                "`FSDPCheckpointingStrategy` needs a CUDA accelerator (Lightning's FSDP shards on GPUs only), got"
                " CPU; shard on CPU with `ModelParallelCheckpointingStrategy(data_parallel_size=N,"
                ' tensor_parallel_size=1, process_group_backend="gloo")` and `fully_shard` in `configure_model`.'
            )
        super().setup_environment()


class ModelParallelCheckpointingStrategy(ActivationCheckpointingMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) with this package's checkpointing.

    The LightningModule shards itself in ``configure_model`` (``fully_shard`` on its blocks and root, with
    ``self.device_mesh["data_parallel"]``), which runs before the strategy's setup; checkpointing is applied at the
    end of the setup, to the sharded modules, which keep their names. FSDP2's hooks stay on the modules, so a
    checkpointed block is all-gathered before its forward and before its recomputation in backward.

    Args:
        checkpointing: Which submodules to checkpoint and how; ``None`` (YAML ``null``) is rejected with an error.
        **kwargs: The arguments of :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``data_parallel_size``, ``tensor_parallel_size``, ``process_group_backend``, ...).

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, ModelParallelCheckpointingStrategy
        >>> strategy = ModelParallelCheckpointingStrategy(
        ...     checkpointing=CheckpointingConfig(classes=["Block"]), data_parallel_size=2, tensor_parallel_size=1
        ... )
        >>> strategy.checkpointing.classes
        ['Block']
    """

    _monitor_support = StrategySupport

    def __init__(self, checkpointing: CheckpointingConfig | None, **kwargs: Any) -> None:
        super().__init__(checkpointing=checkpointing, **kwargs)
