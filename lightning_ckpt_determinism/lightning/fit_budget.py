"""A ``memory_budget`` under a strategy: the first training batch measures, the second one on runs the plan.

Every candidate the strategy checkpointed is measured while the first training batch runs
(:class:`~lightning_ckpt_determinism.checkpointing.measure.ActivationMeter`), in eager mode: a compiled model runs that
batch uncompiled (``torch.compiler.set_stance("force_eager")``, for that batch only), since the compiler recomputes its
regions out of the meter's sight, and compiles from the second batch on, with the plan in place, so the budget costs it
no recompile. When the second batch starts, each rank's figures are reduced by their maximum through the strategy, so
that every rank (DDP, FSDP, tensor parallelism) plans from the same figures and applies the same plan, before any
forward of that batch: the candidates the plan leaves plain are made plain. Rank zero logs the plan in one line, and
writes its table once as text to each of the Trainer's loggers that takes text (TensorBoard shows it in its text tab,
beside the metrics). With
``budget_cost="calibrated"``, each rank calibrates its device's two rates when the first batch starts, and the rates are
reduced to their minimum through the strategy before the batch is measured, so that the ranks' recompute costs, and so
their plans, agree. The plan holds for batches like the measured one: a later batch whose tensors are more than 10 %
larger (from which the regions' inputs are computed) is said once.
"""

import contextlib
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ckpt_determinism._torch_compat import tree_leaves
from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan, plan_from_figures
from lightning_ckpt_determinism.checkpointing.calibration import rates_for
from lightning_ckpt_determinism.checkpointing.cost import Rates
from lightning_ckpt_determinism.checkpointing.measure import ActivationMeter, OpFigures, RegionFigures
from lightning_ckpt_determinism.checkpointing.wrapper import keep_op_calls, remove_activation_checkpointing
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning
from lightning_ckpt_determinism.lightning.parallel import all_reduce
from lightning_ckpt_determinism.lightning.reference import MEMORY_MARGIN
from lightning_ckpt_determinism.verify.compiled import is_compiled

__all__ = ["PLAN_TAG", "BudgetedCheckpointing", "auto_budget", "log_plan_text"]

LARGER_BATCH = 1.1
"""How much larger than the measured batch a later batch may be before the plan's figures are said to be too small."""

PLAN_TAG = "lightning_ckpt_determinism/memory_budget_plan"
"""The tag under which rank zero logs the plan as text."""


class BudgetedCheckpointing:
    """Measures a strategy's checkpointed regions in the first training batch and applies the plan at the second.

    Args:
        config: The strategy's config, with its ``memory_budget``.

    Example::

        >>> budgeted = BudgetedCheckpointing(CheckpointingConfig(classes=["Block"], memory_budget="1GiB"))
        >>> budgeted.plan is None
        True
    """

    def __init__(self, config: CheckpointingConfig) -> None:
        self.config = config
        self.plan: CheckpointingPlan | None = None
        self._meter: ActivationMeter | None = None
        self._measuring = contextlib.ExitStack()
        self._measured_batch_bytes = 0
        self._said_larger = False
        # With "auto" on CUDA: the device's allocated bytes when the measured step started.
        self._step_start = 0

    def batch_started(
        self,
        strategy: Any,
        root: nn.Module,
        regions: Mapping[str, nn.Module],
        batch: Any = None,
        loggers: Sequence[Any] = (),
        step: int = 0,
    ) -> list[str]:
        """Start measuring at the first training batch; plan and apply at the second (on every rank alike).

        Args:
            strategy: The strategy, through which the figures are reduced over ranks.
            root: The LightningModule; its parameters and buffers are not activations.
            regions: The regions the strategy checkpointed, by name.
            batch: The batch starting, compared in size with the measured one.
            loggers: The Trainer's loggers, to which rank zero writes the plan as text (see :func:`log_plan_text`).
            step: The Trainer's global step, under which the plan is logged.

        Returns:
            The regions the plan made plain at this batch (none at other batches).
        """
        if self.plan is not None:
            self._compare_batch(batch)
            return []
        if not regions:
            return []
        if self._meter is None:
            config = self.config
            self._meter = ActivationMeter(
                root,
                regions,
                config.save_ops,
                keep_data_dependent=config.keep_data_dependent,
                ops=config.budget_granularity == "op",
                rates=_agreed_rates(strategy, root, config),
            )
            self._measured_batch_bytes = _tensor_bytes(batch)
            if config.memory_budget == "auto":
                # The measured step's peak, read at the next batch (the device's peak statistics restart here).
                device = strategy.root_device
                torch.cuda.reset_peak_memory_stats(device)
                self._step_start = torch.cuda.memory_allocated(device)
            self._measuring.enter_context(torch.compiler.set_stance("force_eager"))
            self._measuring.enter_context(self._meter.measuring())
            return []
        self._measuring.close()
        figures = self._meter.figures()
        auto = self._auto_bytes(strategy, figures) if self.config.memory_budget == "auto" else None
        self.plan = plan = self._planned(_reduced(strategy, figures), auto)
        plain = [name for name in regions if name not in plan.checkpointed]
        for name in plain:
            remove_activation_checkpointing(regions[name])
        for name in plan.checkpointed:
            if name in regions:
                keep_op_calls(regions[name], plan.saved_ops.get(name, ()), plan.measured_ops(name))
        rank_zero_info(f"lightning_ckpt_determinism: {plan.summary()}.")
        if strategy.is_global_zero:
            log_plan_text(loggers, plan, step)
        if any(plan.saved_ops.values()) and is_compiled(root):
            rank_zero_info(
                "lightning_ckpt_determinism: compiled regions keep none of the planned op outputs (a compiled graph"
                " holds no per-call policy): they are checkpointed whole, as at `budget_granularity`='module'."
            )
        return plain

    def _compare_batch(self, batch: Any) -> None:
        """Say once when a batch is more than 10 % larger than the measured one: its regions' inputs, and what they
        keep, are likely larger than the plan assumed."""
        if self._said_larger or not self._measured_batch_bytes:
            return
        size = _tensor_bytes(batch)
        if size > LARGER_BATCH * self._measured_batch_bytes:
            self._said_larger = True
            rank_zero_warn(
                f"lightning_ckpt_determinism: a training batch holds {size} bytes of tensors, more than"
                f" {LARGER_BATCH:.0%} of the {self._measured_batch_bytes} bytes of the batch the `memory_budget` plan"
                " was measured on: its regions may keep more than the plan says. Measure on the largest batch (order"
                " the data so it comes first), or lower `memory_budget`.",
                category=LightningCkptDeterminismWarning,
            )

    @property
    def started(self) -> bool:
        """Whether a training batch has started measuring (the plan may be made already)."""
        return self._meter is not None

    def stop(self) -> None:
        """Stop measuring (a fit that ended within its first batch); the plan stays readable."""
        self._measuring.close()

    def not_counting(self) -> contextlib.AbstractContextManager[None]:
        """A block whose forwards the measurement of the first batch does not count (a check's own passes of that
        step); nothing to pause before or after it."""
        if self._meter is None or self.plan is not None:
            return contextlib.nullcontext()
        return self._meter.not_counting()

    def _auto_bytes(self, strategy: Any, figures: list[RegionFigures]) -> int:
        """What ``"auto"`` comes to on this CUDA device, the least over ranks (see :func:`auto_budget`); read after
        the first optimizer step, which allocated the optimizer's state."""
        device = strategy.root_device
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        step_peak = torch.cuda.max_memory_allocated(device) - self._step_start
        local = auto_budget(int(free) + int(cached), step_peak, figures)
        least = all_reduce(strategy)(torch.tensor([-local], dtype=torch.int64, device=device), "max")
        return -int(least.item())

    def _planned(self, figures: list[RegionFigures], auto_bytes: int | None = None) -> CheckpointingPlan:
        # Every rank plans alike; the warning of an unmeetable budget is shown once, on rank zero.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            plan = plan_from_figures(figures, self.config, auto_bytes)
        for warning in caught:
            rank_zero_warn(str(warning.message), category=warning.category)
        return plan


def log_plan_text(loggers: Sequence[Any], plan: CheckpointingPlan, step: int = 0) -> list[Any]:
    """Write ``str(plan)`` as a Markdown code block (TensorBoard's text tab renders Markdown, so the table keeps its
    columns) under :data:`PLAN_TAG` to each logger whose ``experiment`` takes text (``add_text``, as TensorBoard's
    ``SummaryWriter``); loggers that take none are left out.

    Args:
        loggers: The Trainer's loggers.
        plan: The plan.
        step: The global step to log it at.

    Returns:
        The loggers written to.

    Example::

        >>> config = CheckpointingConfig(classes=["Block"], memory_budget=50)
        >>> log_plan_text([], plan_from_figures([RegionFigures("a", 100, 10, 1, 1)], config))
        []
    """
    text = "```\n" + str(plan) + "\n```"
    written = []
    for logger in loggers:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):
            add_text(PLAN_TAG, text, step)
            written.append(logger)
    return written


def auto_budget(
    free_bytes: int, step_peak_bytes: int, figures: Sequence[RegionFigures], margin: float = MEMORY_MARGIN
) -> int:
    """What ``memory_budget="auto"`` lets the candidates keep: the device's free memory with the margin of
    ``reference_regions="auto"`` (a share left unused), less what the measured step needed besides the candidates'
    kept bytes (the other activations, the gradients, one region's recomputation), which the next steps need too.

    Args:
        free_bytes: What the allocator can hand out after the first optimizer step (free and cached).
        step_peak_bytes: The measured step's peak allocation above what was allocated when it started.
        figures: The candidates' figures in that step, every one checkpointed.
        margin: The share of ``free_bytes`` left unused.

    Example::

        >>> figures = [RegionFigures("0", 300, 100, 1, 1), RegionFigures("1", 300, 100, 1, 1)]
        >>> auto_budget(free_bytes=2000, step_peak_bytes=700, figures=figures)  # 1500 usable, 500 needed besides
        1000
    """
    kept = sum(entry.checkpointed_bytes for entry in figures)
    others = max(0, step_peak_bytes - kept)
    return max(0, math.floor(free_bytes * (1.0 - margin)) - others)


def _agreed_rates(strategy: Any, root: nn.Module, config: CheckpointingConfig) -> Rates | None:
    """The rates ``config.budget_cost`` names; calibrated ones are each rank's own, reduced to the least over ranks
    (one collective on several processes), on every rank alike."""
    rates = rates_for(config, strategy.root_device, _compute_dtype(strategy, root))
    if config.budget_cost != "calibrated" or rates is None:
        return rates
    local = torch.tensor([-rates.flop_rate, -rates.bandwidth], dtype=torch.float64, device=strategy.root_device)
    least = all_reduce(strategy)(local, "max").tolist()
    return Rates(flop_rate=-least[0], bandwidth=-least[1])


def _compute_dtype(strategy: Any, root: nn.Module) -> torch.dtype:
    """The dtype matrix products run in: the precision plugin's 16-bit type under mixed or true 16-bit precision,
    else the dtype of the first floating parameter."""
    precision = str(getattr(getattr(strategy, "precision_plugin", None), "precision", ""))
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    parameter = next((p for p in root.parameters() if p.is_floating_point()), None)
    return parameter.dtype if parameter is not None else torch.float32


def _tensor_bytes(batch: Any) -> int:
    """The bytes of the tensors in a batch (nested in lists, tuples and dicts)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor))


def _reduced(strategy: Any, figures: list[RegionFigures]) -> list[RegionFigures]:
    """Each figure's maximum over ranks (one collective on several processes). Op calls are measured on each rank
    apart and are not reduced: a region keeps its op figures only where every rank measured the same number of
    calls (one more collective), and then each op's figures are their maximum over ranks too."""
    local = torch.tensor(
        [[entry.plain_bytes, entry.checkpointed_bytes, entry.flops, entry.calls, entry.cost] for entry in figures],
        dtype=torch.int64,
        device=strategy.root_device,
    )
    reduce = all_reduce(strategy)
    reduced = reduce(local, "max").tolist()
    ops = _reduced_ops(reduce, figures, strategy.root_device)
    return [
        RegionFigures(entry.name, int(plain), int(kept), int(flops), int(calls), int(cost), kept_ops)
        for entry, (plain, kept, flops, calls, cost), kept_ops in zip(figures, reduced, ops, strict=True)
    ]


def _reduced_ops(reduce: Any, figures: list[RegionFigures], device: torch.device) -> list[tuple[OpFigures, ...]]:
    """Each region's op figures, their maximum over ranks where every rank measured as many op calls; else none."""
    if not any(entry.ops for entry in figures):
        return [() for _ in figures]
    counts = torch.tensor([[len(entry.ops), -len(entry.ops)] for entry in figures], dtype=torch.int64, device=device)
    most, least = reduce(counts, "max").t().tolist()
    agreed = [entry.ops if high == -low else () for entry, high, low in zip(figures, most, least, strict=True)]
    flat = [[op.bytes, op.cost, op.flops] for ops in agreed for op in ops]
    if not flat:
        return [() for _ in figures]
    values = iter(reduce(torch.tensor(flat, dtype=torch.int64, device=device), "max").tolist())
    return [tuple(OpFigures(op.index, op.op, *map(int, next(values))) for op in ops) for ops in agreed]
