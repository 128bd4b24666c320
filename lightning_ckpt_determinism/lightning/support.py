"""What the monitor needs of a Lightning strategy, asked of the strategy itself.

A strategy says what :class:`~lightning_ckpt_determinism.RecomputationMonitor` needs of it through a
:class:`StrategySupport`: the tensors whose ``.grad`` the step fills, whether the next backward writes into the live
gradients' storage, and how a two-pass check takes gradients. The package's strategies declare theirs
(``ActivationCheckpointingMixin.monitor_support``); Lightning's stock strategies, with checkpointing applied in
``configure_model``, get theirs from :func:`stock_support`. Under a strategy that has none the monitor refuses to
start (:func:`unmonitored`).
"""

import contextlib
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies import Strategy as LightningStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_ckpt_determinism._torch_compat import fsdp1_flat_parameters
from lightning_ckpt_determinism.checkpointing.modules import region_name
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.lightning.step import loss_of, training_step_loss

__all__ = ["DDPSupport", "FSDPSupport", "StrategySupport", "stock_support", "support_of", "unmonitored"]


class StrategySupport:
    """What the monitor needs of a strategy whose gradients land on the module's own parameters (a single device,
    ``ModelParallelStrategy``'s FSDP2 and tensor parallelism). Subclass it for a strategy that holds gradients
    elsewhere or takes them another way.

    Args:
        strategy: The strategy, as the Trainer holds it.

    Example::

        >>> support = StrategySupport(SingleDeviceStrategy("cpu"))
        >>> support.two_pass_gradients(), support.writes_into_bucket_views(), support.two_pass_unavailable()
        ('backward', False, None)
    """

    def __init__(self, strategy: LightningStrategy) -> None:
        self.strategy = strategy

    def gradient_holders(self, pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
        """The tensors whose ``.grad`` the step fills, by name: the model's (:meth:`model_gradient_holders`), then
        the tensors the Trainer's optimizers train that are not among them (a tensor that requires grad held as a
        plain attribute), named ``<optimizer tensor i>``: a check sets their gradients aside and compares them too.

        Args:
            pl_module: The LightningModule the strategy trains.
        """
        holders = self.model_gradient_holders(pl_module)
        known = {id(tensor) for _, tensor in holders}
        for optimizer in pl_module.trainer.optimizers:
            for group in optimizer.param_groups:
                for tensor in group["params"]:
                    if tensor.requires_grad and id(tensor) not in known:
                        known.add(id(tensor))
                        holders.append((f"<optimizer tensor {len(holders)}>", tensor))
        return holders

    def model_gradient_holders(self, pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
        """The model's tensors whose ``.grad`` the step fills, by name: its trainable parameters.

        Args:
            pl_module: The LightningModule the strategy trains.
        """
        return [(region_name(name), param) for name, param in pl_module.named_parameters() if param.requires_grad]

    def writes_into_bucket_views(self) -> bool:
        """Whether the next backward writes into the live gradients' storage, so that setting them aside copies."""
        return False

    def two_pass_gradients(self) -> Literal["autograd", "backward"]:
        """How the two-pass check takes gradients on the bare module: ``backward()``, which sharded parameters and
        reentrant checkpointing need."""
        return "backward"

    def two_pass_unavailable(self) -> str | None:
        """Why the two-pass check (attribution, a ``loss_fn`` under automatic optimization) cannot run under this
        strategy, or ``None`` where it can."""
        return None

    def two_pass_loss(self, pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> torch.Tensor:
        """The loss of one pass of the two-pass check: the LightningModule's own ``training_step`` on the bare module,
        so that each rank compares its own gradients and no DDP reducer hook fires.

        Args:
            pl_module: The LightningModule the strategy trains.
            args: The step's positional arguments, as captured.
            kwargs: Its keyword arguments.
        """
        return training_step_loss(pl_module, *args, **kwargs)

    def check_unavailable(self) -> str | None:
        """Why no gradient check can run under this strategy without changing training, or ``None`` where it can:
        the monitor then runs its sentinel alone, and says so once."""
        return None

    def check_running(self) -> contextlib.AbstractContextManager[None]:
        """The block the monitor runs each check's passes in: the strategy's ``measurement_paused()`` where it has one
        (:class:`~lightning_ckpt_determinism.lightning.strategies.ActivationCheckpointingMixin`: a ``memory_budget``
        measuring the first batch counts none of the check's forwards), else nothing."""
        paused = getattr(self.strategy, "measurement_paused", None)
        return paused() if callable(paused) else contextlib.nullcontext()


class DDPSupport(StrategySupport):
    """:class:`StrategySupport` under DDP, which may hold gradients in its buckets and expect some of them.

    Args:
        strategy: The strategy, as the Trainer holds it.

    Example::

        >>> DDPSupport(DDPStrategy()).two_pass_gradients()  # no model wrapped yet
        'backward'
    """

    def writes_into_bucket_views(self) -> bool:
        """Whether DDP wrapped the model with ``gradient_as_bucket_view``: its next backward writes into the live
        gradients' storage."""
        model = self.strategy.model
        return isinstance(model, DistributedDataParallel) and bool(model.gradient_as_bucket_view)

    def two_pass_gradients(self) -> Literal["autograd", "backward"]:
        """``torch.autograd.grad`` under DDP with ``find_unused_parameters=True``, whose reducer a ``backward()``
        outside DDP's forward leaves expecting gradients the next step does not give (its backward then fails);
        ``backward()`` otherwise."""
        model = self.strategy.model
        unused = isinstance(model, DistributedDataParallel) and bool(model.find_unused_parameters)
        return "autograd" if unused else "backward"


class FSDPSupport(StrategySupport):
    """:class:`StrategySupport` under FSDP1, which accumulates into its flat parameters' gradients when it keeps the
    original parameters (``use_orig_params=True``), and whose parameters are views of its flat parameters (or their
    shards) outside its root wrapper's forward: the two-pass check runs the step through that wrapper.

    Args:
        strategy: The strategy, as the Trainer holds it.

    Example::

        >>> support = FSDPSupport(FSDPStrategy())
        >>> support.writes_into_bucket_views(), support.two_pass_unavailable(), support.check_unavailable()
        (False, None, None)
    """

    def two_pass_loss(self, pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> torch.Tensor:
        """The loss of ``training_step`` run through FSDP1's root wrapper (``strategy.training_step``), which gathers
        the parameters for each pass; the passes' backwards reduce the gradients over ranks, every rank running them
        alike.

        Args:
            pl_module: The LightningModule the strategy trains (the wrapper runs its ``training_step``).
            args: The step's positional arguments, as captured.
            kwargs: Its keyword arguments.
        """
        return loss_of(self.strategy.training_step(*args, **kwargs))

    def model_gradient_holders(self, pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
        """The module's trainable parameters, then FSDP1's flat parameters that are not among them.

        Args:
            pl_module: The LightningModule the strategy trains.
        """
        holders = super().model_gradient_holders(pl_module)
        if self.strategy.model is not None:
            known = {id(param) for _, param in holders}
            for index, flat in enumerate(fsdp1_flat_parameters(self.strategy.model)):
                if id(flat) not in known and flat.requires_grad:
                    holders.append((f"<FSDP flat parameter {index}>", flat))
        return holders


# Lightning's stock strategies the monitor is tested under (and their subclasses), most specific first.
_STOCK: tuple[tuple[type[LightningStrategy], type[StrategySupport]], ...] = (
    (FSDPStrategy, FSDPSupport),
    (DDPStrategy, DDPSupport),
    (ModelParallelStrategy, StrategySupport),
    (SingleDeviceStrategy, StrategySupport),
)


def stock_support(strategy: LightningStrategy) -> StrategySupport | None:
    """The support of one of Lightning's stock strategies (or a subclass), or ``None`` for any other strategy.

    Args:
        strategy: The strategy, as the Trainer holds it.

    Example::

        >>> type(stock_support(DDPStrategy())).__name__
        'DDPSupport'
    """
    for stock, support in _STOCK:
        if isinstance(strategy, stock):
            return support(strategy)
    return None


def support_of(strategy: Any) -> StrategySupport | None:
    """What ``strategy`` says the monitor needs of it: its own ``monitor_support()`` when it has one, else that of the
    stock strategy it is; ``None`` when it is neither, and the monitor does not run.

    Args:
        strategy: The strategy, as the Trainer holds it.

    Example::

        >>> type(support_of(SingleDeviceStrategy("cpu"))).__name__
        'StrategySupport'
    """
    declared = getattr(strategy, "monitor_support", None)
    return declared() if callable(declared) else stock_support(strategy)


def unmonitored(
    support: StrategySupport | None, strategy: Any, pl_module: "pl.LightningModule", syntax: str = "python"
) -> str | None:
    """Why the monitor can check nothing in this fit (a strategy without support, a model without a checkpointed
    module at fit start), as the one-line error it raises, or ``None`` when it can check.

    Args:
        support: What :func:`support_of` says of ``strategy``.
        strategy: The Trainer's strategy.
        pl_module: The LightningModule.
        syntax: ``"yaml"`` to write the fix as YAML does (under ``CheckpointingCLI``), else ``"python"``.

    Example::

        >>> unmonitored(None, object(), None)[:57]
        '`RecomputationMonitor` cannot check under object: it runs'
    """
    if support is None:
        return (
            f"`RecomputationMonitor` cannot check under {type(strategy).__name__}: it runs under single-device, DDP,"
            " FSDP and ModelParallel strategies and their subclasses. Use one of those (e.g."
            " `DDPCheckpointingStrategy(checkpointing=CheckpointingConfig(...))`), give the strategy a"
            " `monitor_support()` that returns a `StrategySupport`, or remove the monitor."
        )
    if not checkpointed_modules(pl_module):
        nothing = (
            f"`RecomputationMonitor` has nothing to check: no module of {type(pl_module).__name__} is checkpointed at"
            f" fit start under {type(strategy).__name__}. Add a checkpointing strategy (e.g."
        )
        if syntax == "yaml":
            return (
                f"{nothing} `strategy: single_device_checkpointing` or `ddp_checkpointing`, which checkpoint"
                " `classes: auto`, or `class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy` with"
                " `init_args: {checkpointing: {classes: [YourBlock]}}`) under `trainer`, or remove the monitor."
            )
        return (
            f'{nothing} `strategy="single_device_checkpointing"` or `"ddp_checkpointing"`, which checkpoint'
            ' `classes="auto"`, or `DDPCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[YourBlock]))`;'
            " `SingleDevice`, `FSDP` and `ModelParallel` alike) or call `apply_activation_checkpointing` in"
            " `configure_model`, or remove the monitor."
        )
    return None
