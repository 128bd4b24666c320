"""A memory budget: which of the matched modules to checkpoint, measured on the model, with the least recomputation.

:func:`plan_activation_checkpointing` runs one step with every candidate (every module the config matches) checkpointed,
measures each with :class:`~lightning_ckpt_determinism.checkpointing.measure.ActivationMeter` (bytes kept with and
without checkpointing, recompute FLOPs and cost), and chooses exactly: the set to checkpoint keeps the candidates'
total within the budget with the least recompute cost, in the model ``budget_cost`` names: a roofline cost per op call
at fixed rates (the default) or at rates calibrated on the device, or the FLOP count alone
(:mod:`~lightning_ckpt_determinism.checkpointing.cost`). Identical blocks measure alike and form one group, whose choice
is how many of them to checkpoint (the first ones in module order); the groups are searched branch and bound, which is
exact and quick for the handful of distinct regions real models have. A tie in cost (with ``budget_cost="flops"``,
regions made only of elementwise ops and norms cost 0) goes to fewer checkpointed modules, then to fewer bytes kept. A
candidate whose checkpointing would keep more than it saves stays plain.

With ``budget_granularity="op"`` the meter also measures each op call of each candidate (bytes it allocates, recompute
cost), and the choice is, per candidate, plain or checkpointed keeping a chosen set of its op outputs, exactly, with the
least recompute cost (:mod:`~lightning_ckpt_determinism.checkpointing.op_choice`); :attr:`CheckpointingPlan.saved_ops`
lists the kept calls and :meth:`CheckpointingPlan.apply` hands them to each region's selective-checkpointing policy.

The plan holds for batches like the measured one: bytes scale with the batch, so a larger batch keeps more.
"""

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from lightning_ckpt_determinism._text import aligned
from lightning_ckpt_determinism.checkpointing.calibration import rates_for
from lightning_ckpt_determinism.checkpointing.measure import ActivationMeter, RegionFigures
from lightning_ckpt_determinism.checkpointing.op_choice import choose_kept_ops
from lightning_ckpt_determinism.checkpointing.selection import checkpoint_selected, select_modules
from lightning_ckpt_determinism.checkpointing.wrapper import (
    checkpointing_config,
    is_checkpointed,
    keep_op_calls,
    remove_activation_checkpointing,
)
from lightning_ckpt_determinism.config import CheckpointingConfig, parse_memory_budget, resolve_ops
from lightning_ckpt_determinism.errors import CheckpointingConfigError, LightningCkptDeterminismWarning

__all__ = [
    "CheckpointingPlan",
    "check_budget_device",
    "check_plannable",
    "format_bytes",
    "measure_candidates",
    "plan_activation_checkpointing",
    "plan_from_figures",
]


@dataclass(frozen=True)
class CheckpointingPlan:
    """Which of a config's candidates to checkpoint under its ``memory_budget``, and the figures it was chosen from.

    Attributes:
        config: The config planned for; :meth:`apply` checkpoints with its other fields.
        candidates: Each candidate's figures, in module order.
        checkpointed: The names of the candidates to checkpoint, in module order.
        kept_bytes: What the candidates keep for backward under the plan.
        budget_bytes: The budget, in bytes.
        recomputed_flops_share: The share of the FLOPs that checkpointing every candidate recomputes which the plan
            recomputes (0 when they count none).
        saved_ops: At ``budget_granularity="op"``, each checkpointed module that ran with the op calls whose outputs
            it keeps: (position among its op calls, overload); empty at module granularity.
        recompute_share: The share of the candidates' recompute cost that the plan recomputes, in the cost model
            ``config.budget_cost`` names (roofline by default; recomputed FLOPs for ``"flops"``).
        slack_bytes: 0 when the plan is proved optimal; else it costs at most the optimum at the budget lowered by
            this many bytes (an op-granularity search too large to run exactly, see
            :mod:`~lightning_ckpt_determinism.checkpointing.op_choice`).

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> from lightning_ckpt_determinism.checkpointing.budget_plan import RegionFigures, plan_from_figures
        >>> config = CheckpointingConfig(classes=["Linear"], memory_budget=100)
        >>> figures = [RegionFigures("0", 80, 10, 5, 1, cost=50), RegionFigures("1", 80, 10, 1, 1, cost=10)]
        >>> plan = plan_from_figures(figures, config)
        >>> plan.checkpointed, plan.kept_bytes
        (['1'], 90)
    """

    config: CheckpointingConfig
    candidates: tuple[RegionFigures, ...]
    checkpointed: list[str]
    kept_bytes: int
    budget_bytes: int
    recomputed_flops_share: float
    saved_ops: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    recompute_share: float = 0.0
    slack_bytes: int = 0

    def apply(self, model: nn.Module) -> list[str]:
        """Checkpoint exactly :attr:`checkpointed` among the config's candidates of ``model``, with the config's other
        fields, each keeping the op calls :attr:`saved_ops` lists for it; candidates checkpointed before and not
        planned are made plain again, and planned ones checkpointed before keeping other op outputs are checkpointed
        again with this config.

        Args:
            model: The model planned for (or a twin with the same module names).

        Returns:
            The names of the checkpointed candidates.

        Example::

            >>> from lightning_ckpt_determinism.checkpointing.budget_plan import RegionFigures, plan_from_figures
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            >>> config = CheckpointingConfig(classes=["Linear"], memory_budget=12)
            >>> plan = plan_from_figures([RegionFigures("0", 8, 8, 1, 1), RegionFigures("1", 8, 4, 1, 1)], config)
            >>> plan.apply(model)
            ['1']
        """
        candidates = select_modules(model, self.config)
        for name, module in candidates.items():
            if (name not in self.checkpointed and is_checkpointed(module)) or _other_config(module, self.config):
                remove_activation_checkpointing(module)
        chosen = {name: module for name, module in candidates.items() if name in self.checkpointed}
        checkpoint_selected(model, chosen, self.config)
        for name, module in chosen.items():
            keep_op_calls(module, self.saved_ops.get(name, ()), self.measured_ops(name))
        return list(chosen)

    def measured_ops(self, name: str) -> list[str]:
        """The overloads of candidate ``name``'s op calls in its measured forward, in order (empty at module
        granularity, or for a name that is no candidate): what :attr:`saved_ops`' positions count.

        Args:
            name: A candidate's name.

        Example::

            >>> from lightning_ckpt_determinism.checkpointing.budget_plan import RegionFigures, plan_from_figures
            >>> config = CheckpointingConfig(classes=["Linear"], memory_budget=12)
            >>> plan_from_figures([RegionFigures("0", 8, 8, 1, 1)], config).measured_ops("0")
            []
        """
        return next((list(op.op for op in entry.ops) for entry in self.candidates if entry.name == name), [])

    def summary(self) -> str:
        """The plan in one line.

        Example::

            >>> from lightning_ckpt_determinism.checkpointing.budget_plan import RegionFigures, plan_from_figures
            >>> config = CheckpointingConfig(classes=["Linear"], memory_budget=2048)
            >>> plan = plan_from_figures([RegionFigures("0", 4096, 1024, 10, 1, cost=8192)], config)
            >>> print(plan.summary())  # doctest: +NORMALIZE_WHITESPACE
            memory budget 2.0 KiB: checkpointing 1 of 1 modules (0), keeping 1.0 KiB of 4.0 KiB,
            recomputing 100% of their recompute cost
        """
        plain = sum(figures.plain_bytes for figures in self.candidates)
        names = ", ".join(self.checkpointed) or "none"
        if self.config.budget_granularity == "op":
            kept = sum(map(len, self.saved_ops.values()))
            recomputing = f"{self.recompute_share:.0%} of their recompute cost (keeping {kept} op outputs in them)"
        elif self.config.budget_cost == "flops":
            recomputing = f"{self.recomputed_flops_share:.0%} of their recompute FLOPs"
        else:
            recomputing = f"{self.recompute_share:.0%} of their recompute cost"
        return (
            f"memory budget {format_bytes(self.budget_bytes)}: checkpointing {len(self.checkpointed)} of"
            f" {len(self.candidates)} modules ({names}), keeping {format_bytes(self.kept_bytes)} of"
            f" {format_bytes(plain)}, recomputing {recomputing}"
        )

    def __str__(self) -> str:
        rows = [("module", "plain", "checkpointed", "recompute FLOPs", "plan")]
        for figures in self.candidates:
            if figures.calls == 0:
                choice = "checkpoint (did not run)"
            else:
                choice = "checkpoint" if figures.name in self.checkpointed else "plain"
                if figures.name in self.saved_ops:
                    kept = len(self.saved_ops[figures.name])
                    choice += f", keeping {kept} op{'s' * (kept != 1)}"
            rows.append(
                (
                    figures.name,
                    format_bytes(figures.plain_bytes),
                    format_bytes(figures.checkpointed_bytes),
                    f"{figures.flops:,}",
                    choice,
                )
            )
        return "\n".join([self.summary(), *aligned(rows)])


def plan_activation_checkpointing(
    model: nn.Module, config: CheckpointingConfig, closure: Callable[[], object]
) -> CheckpointingPlan:
    """Measure every module ``config`` matches in one step of ``closure`` and plan which to checkpoint within
    ``config.memory_budget``, with the least recomputation in the cost model ``config.budget_cost`` names.

    ``closure`` runs once, with every candidate checkpointed (those checkpointed already stay so, the others are
    checkpointed for the step and made plain again afterwards); its own effects (gradients, buffers, random streams)
    stay, as after a training step. Per candidate it measures the activation bytes it keeps without checkpointing,
    the bytes it keeps checkpointed (its inputs, and what ``save_ops`` and ``keep_data_dependent`` keep) and its
    recompute FLOPs (``torch.utils.flop_counter``'s, of the op calls its recomputation runs again: matrix products,
    convolutions and CUDA's fused attention; elementwise ops, norms, softmax and attention on the CPU count 0) and its
    recompute cost (a roofline cost per op call, or
    its FLOPs), see :mod:`~lightning_ckpt_determinism.checkpointing.measure`. With ``budget_cost="calibrated"`` the
    rates are measured on the model's device in the dtype of its first floating parameter
    (:mod:`~lightning_ckpt_determinism.checkpointing.calibration`), in this process alone: ranks that plan with this
    function in a hand-written distributed loop may measure different rates (the strategies agree on them). A
    candidate that did not run stays checkpointed. A budget
    that cannot be met plans to checkpoint every candidate and warns once with the least figure achievable.

    Args:
        model: The model; ``config``'s names are relative to it.
        config: What may be checkpointed and how, with its ``memory_budget``.
        closure: One forward and backward of a real batch, e.g. ``lambda: loss_fn(model(x), y).backward()``.

    Returns:
        The plan; :meth:`CheckpointingPlan.apply` checkpoints it.

    Raises:
        CheckpointingConfigError: If ``config.memory_budget`` is ``None`` or ``"auto"`` (which reads the free memory
            a training step leaves after its first optimizer step: give it to a checkpointing strategy), the config
            matches no module, a module it matches is checkpointed already keeping other op outputs, or ``closure``
            ran none of them with gradients.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, plan_activation_checkpointing
        >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
        >>> config = CheckpointingConfig(classes=["Sequential"], memory_budget=0.75)
        >>> x = torch.randn(4, 8)
        >>> plan = plan_activation_checkpointing(model, config, lambda: model(x).sum().backward())
        >>> plan.checkpointed
        ['0', '1']
        >>> plan.apply(model)
        ['0', '1']
    """
    check_plannable(config, next(model.parameters(), torch.empty(0)).device)
    figures = measure_candidates(model, config, closure)
    if not any(entry.calls for entry in figures):
        raise CheckpointingConfigError(
            f"`closure` ran none of the {len(figures)} modules the config matches with gradients, so nothing was"
            " measured: give one training forward and backward (`lambda: loss_fn(model(x), y).backward()`), outside"
            " `torch.no_grad()` and `torch.inference_mode()`."
        )
    return plan_from_figures(figures, config)


def check_plannable(config: CheckpointingConfig, device: torch.device) -> None:
    """Refuse a config that cannot be planned outside a strategy's fit: no ``memory_budget``, or ``"auto"``.

    Args:
        config: The config.
        device: Where the model is.

    Raises:
        CheckpointingConfigError: In one line naming the field and what to give instead.

    Example::

        >>> check_plannable(CheckpointingConfig(classes=["Block"], memory_budget="1GB"), torch.device("cpu"))
    """
    if config.memory_budget is None:
        raise CheckpointingConfigError(
            "`memory_budget` is None: `plan_activation_checkpointing` plans within a budget; give one such as"
            " '512MiB' or 0.5."
        )
    check_budget_device(config, device)
    if config.memory_budget == "auto":
        raise CheckpointingConfigError(
            "`memory_budget`='auto' is planned by a checkpointing strategy, after the first optimizer step has"
            " allocated its state; here give bytes ('512MiB') or a fraction (0.5) instead."
        )


def measure_candidates(
    model: nn.Module, config: CheckpointingConfig, closure: Callable[[], object], *, ops: bool | None = None
) -> list[RegionFigures]:
    """The figures of every module ``config`` matches, measured in one step of ``closure`` with every one of them
    checkpointed (those checkpointed already stay so, the others are made plain again afterwards). A compiled model
    runs that step uncompiled (``torch.compiler.set_stance("force_eager")``), as a checkpointing strategy measures it:
    the compiler recomputes its regions out of the meter's sight.

    Args:
        model: The model; ``config``'s names are relative to it.
        config: What may be checkpointed and how.
        closure: One forward and backward of a real batch.
        ops: Whether to measure each op call too; by default where ``config.budget_granularity`` is ``"op"``.

    Returns:
        Each candidate's figures, in module order.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> step = lambda: model(torch.ones(2, 4)).sum().backward()
        >>> figures = measure_candidates(model, CheckpointingConfig(names=["1"]), step, ops=True)
        >>> [(entry.name, entry.plain_bytes, [op.op for op in entry.ops]) for entry in figures]
        [('1', 32, ['aten.tanh.default'])]
    """
    candidates = select_modules(model, config)
    other = [name for name, module in candidates.items() if _other_config(module, config)]
    if other:
        raise CheckpointingConfigError(
            f"`memory_budget`: {', '.join(f'`{name}`' for name in other)} checkpointed already, keeping other op"
            " outputs (`save_ops`, `keep_data_dependent`) than this config would: call"
            " `remove_activation_checkpointing(model)` first, or plan with the `save_ops` and `keep_data_dependent`"
            " they were checkpointed with."
        )
    parameter = next((p for p in model.parameters() if p.is_floating_point()), torch.empty(0))
    rates = rates_for(config, parameter.device, parameter.dtype)
    added = {name: module for name, module in candidates.items() if not is_checkpointed(module)}
    checkpoint_selected(model, added, config)
    try:
        meter = ActivationMeter(
            model,
            candidates,
            config.save_ops,
            keep_data_dependent=config.keep_data_dependent,
            ops=config.budget_granularity == "op" if ops is None else ops,
            rates=rates,
        )
        with torch.compiler.set_stance("force_eager"), meter.measuring():
            closure()
    finally:
        for module in added.values():
            remove_activation_checkpointing(module)
    return meter.figures()


def _other_config(module: nn.Module, config: CheckpointingConfig) -> bool:
    """Whether ``module`` is checkpointed keeping other op outputs than ``config`` keeps (other ``save_ops`` or
    ``keep_data_dependent``), which the plan's figures would not be."""
    own = checkpointing_config(module)
    if own is None:
        return False
    return own.keep_data_dependent != config.keep_data_dependent or set(resolve_ops(own.save_ops)) != set(
        resolve_ops(config.save_ops)
    )


def check_budget_device(config: CheckpointingConfig, device: torch.device) -> None:
    """Refuse ``memory_budget="auto"`` off CUDA: it reads the free memory of a CUDA device.

    Args:
        config: The config.
        device: Where the model trains.

    Raises:
        CheckpointingConfigError: For ``"auto"``, in one line naming the device.

    Example::

        >>> check_budget_device(CheckpointingConfig(classes=["Block"], memory_budget="1GB"), torch.device("cpu"))
    """
    if config.memory_budget == "auto" and device.type != "cuda":
        raise CheckpointingConfigError(
            f"`memory_budget`='auto' needs a CUDA device, the model is on {device}; give bytes ('512MiB') or a"
            " fraction (0.5) instead."
        )


def plan_from_figures(
    figures: Sequence[RegionFigures], config: CheckpointingConfig, auto_bytes: int | None = None
) -> CheckpointingPlan:
    """The plan for measured ``figures`` within ``config.memory_budget`` (a fraction is of the plain bytes of the
    candidates that ran); warns once when the budget cannot be met.

    Args:
        figures: Each candidate's figures, in module order (reduced over ranks under a distributed strategy).
        config: The config with its ``memory_budget`` in bytes or as a fraction.
        auto_bytes: What ``memory_budget="auto"`` comes to, worked out by the caller from the device's free memory.

    Example::

        >>> config = CheckpointingConfig(classes=["Block"], memory_budget="50%")
        >>> plan_from_figures([RegionFigures("a", 100, 10, 1, 1)], config).budget_bytes
        50
    """
    budget = parse_memory_budget(config.memory_budget)
    plain = sum(entry.plain_bytes for entry in figures)
    if isinstance(budget, float):
        budget_bytes = math.floor(budget * plain)
    elif isinstance(budget, int):
        budget_bytes = budget
    elif budget == "auto" and auto_bytes is not None:
        budget_bytes = auto_bytes
    else:
        raise CheckpointingConfigError(f"`memory_budget` must be bytes or a fraction here, got {budget!r}.")
    if config.budget_granularity == "op":
        return _op_plan(figures, config, budget_bytes, _percent_hint(budget))
    costs = [entry.flops if config.budget_cost == "flops" else entry.cost for entry in figures]
    chosen = choose_checkpointed(figures, budget_bytes, costs)
    if chosen is None:
        _warn_unmet(figures, budget_bytes, _percent_hint(budget))
        chosen = _least_keeping(figures)
    kept = sum(entry.checkpointed_bytes if entry.name in chosen else entry.plain_bytes for entry in figures)
    return CheckpointingPlan(
        config=config,
        candidates=tuple(figures),
        checkpointed=[entry.name for entry in figures if entry.name in chosen],
        kept_bytes=kept,
        budget_bytes=budget_bytes,
        recomputed_flops_share=_share([entry.flops for entry in figures], figures, chosen),
        recompute_share=_share(costs, figures, chosen),
    )


def _share(costs: Sequence[int], figures: Sequence[RegionFigures], chosen: set[str]) -> float:
    """The share of ``costs`` (one per candidate) that the chosen candidates recompute; 0 when they are all 0."""
    total = sum(costs)
    recomputed = sum(cost for cost, entry in zip(costs, figures, strict=True) if entry.name in chosen)
    return recomputed / total if total else 0.0


def _percent_hint(budget: object) -> str:
    """For an int budget that reads like a fraction or a percentage (1 to 100 bytes), how to write what it likely
    meant (``1`` written for ``1.0``, everything kept plainly)."""
    if budget == 1 and isinstance(budget, int):
        return " An int is bytes: for all of what they keep plainly, write 1.0 or '100%'."
    if isinstance(budget, int) and 1 < budget <= 100:
        return f" An int is bytes: for {budget} % of what they keep plainly, write '{budget}%' or {budget / 100}."
    return ""


def _least_keeping(figures: Sequence[RegionFigures]) -> set[str]:
    """The plan that keeps the least, where no plan fits the budget: the candidates that keep less checkpointed
    than plainly, and those that did not run (nothing measured: checkpointed, as any plan has them)."""
    return {entry.name for entry in figures if not entry.calls or entry.checkpointed_bytes < entry.plain_bytes}


def _warn_unmet(figures: Sequence[RegionFigures], budget_bytes: int, hint: str = "") -> None:
    least = sum(min(entry.plain_bytes, entry.checkpointed_bytes) for entry in figures)
    warnings.warn(
        f"lightning_ckpt_determinism: `memory_budget` of {budget_bytes} byte{'s' * (budget_bytes != 1)}"
        f" ({format_bytes(budget_bytes)}) cannot be met: the matched modules keep at least {least} bytes"
        f" ({format_bytes(least)}) for backward. Checkpointing those that keep less so, which keeps that.{hint}",
        LightningCkptDeterminismWarning,
        stacklevel=3,
    )


def _op_plan(
    figures: Sequence[RegionFigures], config: CheckpointingConfig, budget_bytes: int, hint: str
) -> CheckpointingPlan:
    """The op-granularity plan (see :mod:`~lightning_ckpt_determinism.checkpointing.op_choice`)."""
    choice = choose_kept_ops(figures, budget_bytes)
    if choice is None:
        _warn_unmet(figures, budget_bytes, hint)
        least = _least_keeping(figures)
        kept: dict[str, tuple[int, ...]] = {entry.name: () for entry in figures if entry.name in least}
        kept_bytes = sum(entry.checkpointed_bytes if entry.name in least else entry.plain_bytes for entry in figures)
        cost = sum(entry.cost for entry in figures if entry.name in least)
        slack = 0
    else:
        kept, kept_bytes, cost, slack = choice.kept, choice.kept_bytes, choice.cost, choice.slack_bytes
    total_cost = sum(entry.cost for entry in figures)
    flops = sum(entry.flops for entry in figures)
    recomputed_flops = 0
    saved_ops: dict[str, tuple[tuple[int, str], ...]] = {}
    for entry in figures:
        if entry.name in kept:
            calls = set(kept[entry.name])
            saved = [op for op in entry.ops if op.index in calls]
            saved_ops[entry.name] = tuple((op.index, op.op) for op in saved)
            recomputed_flops += max(0, entry.flops - sum(op.flops for op in saved))
    return CheckpointingPlan(
        config=config,
        candidates=tuple(figures),
        checkpointed=list(kept),
        kept_bytes=kept_bytes,
        budget_bytes=budget_bytes,
        recomputed_flops_share=recomputed_flops / flops if flops else 0.0,
        saved_ops=saved_ops,
        recompute_share=cost / total_cost if total_cost else 0.0,
        slack_bytes=slack,
    )


def choose_checkpointed(
    figures: Sequence[RegionFigures], budget_bytes: int, costs: Sequence[int] | None = None
) -> set[str] | None:
    """The candidates to checkpoint so that the total kept is at most ``budget_bytes`` with the least recompute
    cost (then the fewest modules, then the fewest bytes); ``None`` when no choice fits.

    Candidates that did not run are always checkpointed. Candidates with equal figures form a group of which the
    first k in order are checkpointed; the search over the groups' k is exhaustive with bounds, so the choice is exact.

    Args:
        figures: Each candidate's figures, in module order.
        budget_bytes: The most the candidates may keep.
        costs: Each candidate's recompute cost, in order; their recompute FLOPs by default.

    Example::

        >>> figures = [RegionFigures("big", 100, 10, 1, 1), RegionFigures("small", 20, 10, 50, 1)]
        >>> sorted(choose_checkpointed(figures, 40))
        ['big']
    """
    forced = {entry.name for entry in figures if entry.calls == 0}
    groups: dict[tuple[int, int, int], list[str]] = {}
    if costs is None:
        costs = [entry.flops for entry in figures]
    for entry, cost in zip(figures, costs, strict=True):
        if entry.calls and entry.saving > 0:
            groups.setdefault((entry.saving, cost, entry.checkpointed_bytes), []).append(entry.name)
    need = sum(entry.plain_bytes for entry in figures) - budget_bytes
    # Cheapest recompute per byte saved first, compared exactly (a float ratio misorders costs over 2**53): the
    # search's bound counts on that order.
    order = sorted(groups, key=lambda key: (Fraction(key[1]) / Fraction(key[0]), -key[0]))
    counts = _least_recompute([(key[0], key[1], len(groups[key])) for key in order], need)
    if counts is None:
        return None
    chosen = set(forced)
    for key, count in zip(order, counts, strict=True):
        chosen.update(groups[key][:count])
    return chosen


def _least_recompute(groups: list[tuple[int, int, int]], need: int) -> list[int] | None:
    """How many of each group (bytes saved, recompute cost, size) to checkpoint to save at least ``need`` bytes,
    ordered by (cost, count, -saved); ``None`` if even all of them save less. ``groups`` come cheapest recompute per
    byte saved first, so that the least cost of what is still missing, were modules divisible, is the greedy one
    (:func:`_exceeds_the_least_cost`): a branch that cannot beat the best choice so far is cut with it."""
    reachable = [0] * (len(groups) + 1)
    for index in range(len(groups) - 1, -1, -1):
        saving, _, size = groups[index]
        reachable[index] = reachable[index + 1] + saving * size
    if reachable[0] < need:
        return None
    best: tuple[tuple[int, int, int], list[int]] | None = None
    counts = [0] * len(groups)

    def visit(index: int, saved: int, flops: int, chosen: int) -> None:
        nonlocal best
        if saved >= need:
            key = (flops, chosen, -saved)
            if best is None or key < best[0]:
                best = (key, list(counts))
            return
        if saved + reachable[index] < need or (best is not None and (flops, chosen) >= best[0][:2]):
            return
        if best is not None and _exceeds_the_least_cost(groups[index:], need - saved, best[0][0] - flops):
            return
        saving, cost, size = groups[index]
        for count in range(size, -1, -1):
            counts[index] = count
            visit(index + 1, saved + count * saving, flops + count * cost, chosen + count)
        counts[index] = 0

    visit(0, 0, 0, 0)
    assert best is not None  # checkpointing every group saves `need`: some choice fits
    return best[1]


def _exceeds_the_least_cost(groups: list[tuple[int, int, int]], missing: int, allowed: int) -> bool:
    """Whether saving ``missing`` more bytes from ``groups`` (cheapest per byte first) costs more than ``allowed``
    even with modules divisible: that fractional cost bounds every whole choice from below. Compared in integers, so
    that a choice costing exactly ``allowed`` (which may win on its count) is never cut."""
    spent = 0
    for saving, cost, size in groups:
        if saving * size >= missing:
            # The last group in part: spent + cost * missing / saving > allowed.
            return (spent - allowed) * saving + cost * missing > 0
        spent += cost * size
        missing -= saving * size
        if spent > allowed:
            return True
    return False  # unreachable from the caller: what is missing is reachable


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(num_bytes: int) -> str:
    """Bytes in binary units, one decimal.

    Args:
        num_bytes: A size in bytes.

    Example::

        >>> format_bytes(512), format_bytes(3 * 2**20 // 2), format_bytes(10**30)
        ('512 B', '1.5 MiB', '867361737988.4 EiB')
    """
    exponent = min(len(_BINARY_UNITS), int(math.log(abs(num_bytes), 1024))) if num_bytes else 0
    if exponent == 0:
        return f"{num_bytes} B"
    return f"{num_bytes / 1024**exponent:.1f} {_BINARY_UNITS[exponent - 1]}"
