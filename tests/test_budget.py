"""Tests for `plan_activation_checkpointing`: the plan equals a brute-force optimum over the test's own measurement."""

import copy
import dataclasses
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    CheckpointingPlan,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    checkpointed_modules,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.budget_plan import choose_checkpointed
from lightning_ckpt_determinism.checkpointing.measure import RegionFigures, _held_tensors
from tests.helpers import Stack, recomputation

DIM = 32
ROWS = 16


class CheapBlock(nn.Module):
    """Keeps much for few FLOPs: one matmul, then a chain of elementwise ops that each keep their input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        for _ in range(4):
            h = torch.sin(h)
        return h


class CostlyBlock(nn.Module):
    """Keeps little for many FLOPs: three chained matmuls, keeping only the two products between them."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = x @ weight
        return x


class WideBlock(nn.Module):
    """In between: a matmul to a wider hidden layer and back, with a tanh between."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


CONFIG = {"classes": ["CheapBlock", "CostlyBlock", "WideBlock"]}


def _mixed(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack([CheapBlock(), CostlyBlock(), CheapBlock(), WideBlock(), CostlyBlock(), CheapBlock()], dim=DIM)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, DIM, generator=generator), torch.randn(ROWS, 1, generator=generator)


def _closure(model: nn.Module) -> None:
    x, y = _batch()
    F.mse_loss(model(x), y).backward()


def _plan(model: nn.Module, budget: object) -> CheckpointingPlan:
    config = CheckpointingConfig(**CONFIG, memory_budget=budget)  # type: ignore[arg-type]
    return plan_activation_checkpointing(model, config, lambda: _closure(model))


def _own_measurement(model: Stack) -> dict[str, tuple[int, int, int]]:
    """Per block, measured by the test itself on the plain model: (bytes autograd saves in its forward, as distinct
    storages without parameters; bytes of its input; the FLOPs torch's own checkpoint of it recomputes)."""
    state = {tensor.untyped_storage().data_ptr() for tensor in model.parameters()}
    figures: dict[str, tuple[int, int, int]] = {}
    x = model.inp(_batch()[0])
    for index, block in enumerate(model.blocks):
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in state:
                storages[pointer] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(x)
        inputs = x.untyped_storage().nbytes()
        figures[f"blocks.{index}"] = (sum(storages.values()), inputs, recomputation(block, x)[1])
        x = out
    return figures


def _brute_force(figures: dict[str, tuple[int, int, int]], budget: int) -> tuple[tuple[int, int, int], list[set[str]]]:
    """The least (FLOPs recomputed, modules checkpointed, bytes kept) within ``budget`` over every subset, and every
    subset reaching it."""
    names = list(figures)
    best: tuple[int, int, int] | None = None
    optima: list[set[str]] = []
    for mask in itertools.product((False, True), repeat=len(names)):
        chosen = {name for name, on in zip(names, mask, strict=True) if on}
        kept = sum(figures[name][1] if name in chosen else figures[name][0] for name in names)
        if kept > budget:
            continue
        key = (sum(figures[name][2] for name in chosen), len(chosen), kept)
        if best is None or key < best:
            best, optima = key, [chosen]
        elif key == best:
            optima.append(chosen)
    assert best is not None
    return best, optima


def _least_by_dynamic_programming(figures: list[RegionFigures], budget: int) -> tuple[int, int] | None:
    """The least (recompute cost, modules checkpointed) that keeps at most ``budget``, by dynamic programming over the
    bytes still to save (an independent reference for figures of a few hundred bytes)."""
    need = max(0, sum(entry.plain_bytes for entry in figures) - budget)
    least: list[tuple[int, int] | None] = [(0, 0)] + [None] * need
    for entry in figures:
        for saved in range(need, -1, -1):
            before = least[saved]
            if before is not None:
                after = min(need, saved + entry.saving)
                found = (before[0] + entry.cost, before[1] + 1)
                least[after] = found if least[after] is None else min(least[after], found)  # type: ignore[type-var]
    return least[need]


@pytest.mark.parametrize("seed", range(6))
def test_the_module_choice_is_exact_and_quick_for_many_distinct_candidates(seed: int) -> None:
    # Forty candidates, each with figures of its own and about the same recompute per byte saved (experts given
    # different numbers of tokens): the search must stay exact without trying every subset.
    generator = torch.Generator().manual_seed(seed)
    figures = []
    for index in range(40):
        plain, kept = 200 + int(torch.randint(0, 100, (1,), generator=generator)), 10
        cost = (plain - kept) * 50 + int(torch.randint(-20, 20, (1,), generator=generator))
        figures.append(RegionFigures(f"experts.{index}", plain, kept, cost, 1, cost))
    total = sum(entry.plain_bytes for entry in figures)
    for fraction in (0.2, 0.5, 0.8):
        budget = int(fraction * total)
        chosen = choose_checkpointed(figures, budget, [entry.cost for entry in figures])
        assert chosen is not None
        kept = sum(entry.checkpointed_bytes if entry.name in chosen else entry.plain_bytes for entry in figures)
        assert kept <= budget
        cost = sum(entry.cost for entry in figures if entry.name in chosen)
        assert (cost, len(chosen)) == _least_by_dynamic_programming(figures, budget)


def test_the_measurement_equals_the_tests_own() -> None:
    model = _mixed()
    own = _own_measurement(_mixed())
    plan = _plan(model, 1.0)
    measured = {entry.name: (entry.plain_bytes, entry.checkpointed_bytes, entry.flops) for entry in plan.candidates}
    assert measured == own
    assert [entry.calls for entry in plan.candidates] == [1] * 6
    # The blocks differ as the test means them to: cheap ones keep much for few FLOPs, costly ones the opposite.
    assert own["blocks.0"][0] - own["blocks.0"][1] > own["blocks.1"][0] - own["blocks.1"][1] > 0
    assert own["blocks.0"][2] < own["blocks.1"][2]


@pytest.mark.parametrize("fraction", [0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0])
def test_the_plan_is_the_brute_force_optimum_of_the_tests_own_measurement(fraction: float) -> None:
    # The test's own measurement counts FLOPs: `budget_cost="flops"` (the roofline's is in tests/test_budget_cost.py).
    own = _own_measurement(_mixed())
    plain = sum(entry[0] for entry in own.values())
    budget = int(fraction * plain)
    (flops, count, kept), optima = _brute_force(own, budget)
    model = _mixed()
    plan = plan_activation_checkpointing(
        model, CheckpointingConfig(**CONFIG, memory_budget=budget, budget_cost="flops"), lambda: _closure(model)
    )
    assert set(plan.checkpointed) in optima
    assert plan.kept_bytes == kept <= plan.budget_bytes == budget
    total = sum(entry[2] for entry in own.values())
    assert plan.recomputed_flops_share == pytest.approx(flops / total)
    assert len(plan.checkpointed) == count
    # The model is left as it was found.
    assert checkpointed_modules(model) == {}


def test_budgets_in_units_and_fractions_plan_alike() -> None:
    own = _own_measurement(_mixed())
    plain = sum(entry[0] for entry in own.values())
    plans = {}
    for budget in (plain // 2, f"{plain / 2 / 1024}KiB", 0.5, "50%"):
        model = _mixed()
        plans[budget] = plan_activation_checkpointing(
            model, CheckpointingConfig(**CONFIG, memory_budget=budget), lambda model=model: _closure(model)
        )
    assert {plan.budget_bytes for plan in plans.values()} == {plain // 2}
    assert len({tuple(plan.checkpointed) for plan in plans.values()}) == 1
    assert plans[0.5].checkpointed


def test_identical_blocks_checkpoint_the_first_k() -> None:
    torch.manual_seed(0)
    model = Stack([CheapBlock() for _ in range(5)], dim=DIM)
    own = _own_measurement(model)
    saving = own["blocks.0"][0] - own["blocks.0"][1]
    plain = sum(entry[0] for entry in own.values())
    plan = plan_activation_checkpointing(
        model, CheckpointingConfig(classes=["CheapBlock"], memory_budget=plain - 2 * saving), lambda: _closure(model)
    )
    assert plan.checkpointed == ["blocks.0", "blocks.1"]


def test_an_unmeetable_budget_checkpoints_everything_and_warns_once_with_the_least_figure() -> None:
    own = _own_measurement(_mixed())
    least = sum(min(entry[0], entry[1]) for entry in own.values())
    model = _mixed()
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        plan = plan_activation_checkpointing(
            model, CheckpointingConfig(**CONFIG, memory_budget=least - 1), lambda: _closure(model)
        )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"lightning_ckpt_determinism: `memory_budget` of {least - 1} bytes (")
    assert f"cannot be met: the matched modules keep at least {least} bytes ({least / 1024:.1f} KiB)" in message
    assert plan.checkpointed == [f"blocks.{index}" for index in range(6)]


@pytest.mark.parametrize("granularity", ["module", "op"])
def test_an_int_budget_that_reads_like_a_percentage_says_how_to_write_one(granularity: str) -> None:
    model = _mixed()
    config = CheckpointingConfig(**CONFIG, memory_budget=50, budget_granularity=granularity)
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        plan = plan_activation_checkpointing(model, config, lambda: _closure(model))
    (message,) = [str(warning.message) for warning in caught]
    assert message.startswith("lightning_ckpt_determinism: `memory_budget` of 50 bytes (")
    assert message.endswith(" An int is bytes: for 50 % of what they keep plainly, write '50%' or 0.5.")
    assert plan.budget_bytes == 50
    # The percentage it names plans as the fraction it spells.
    halved = plan_activation_checkpointing(
        model, CheckpointingConfig(**CONFIG, memory_budget="50%"), lambda: _closure(model)
    )
    assert halved.budget_bytes == sum(entry.plain_bytes for entry in halved.candidates) // 2


def test_an_int_budget_of_one_says_how_to_write_everything() -> None:
    model = _mixed()
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        plan = plan_activation_checkpointing(
            model, CheckpointingConfig(**CONFIG, memory_budget=1), lambda: _closure(model)
        )
    (message,) = [str(warning.message) for warning in caught]
    assert message.startswith("lightning_ckpt_determinism: `memory_budget` of 1 byte (")
    assert message.endswith(" An int is bytes: for all of what they keep plainly, write 1.0 or '100%'.")
    assert plan.budget_bytes == 1
    # What it likely meant keeps every module plain.
    meant = plan_activation_checkpointing(
        model, CheckpointingConfig(**CONFIG, memory_budget=1.0), lambda: _closure(model)
    )
    assert meant.checkpointed == []


def test_a_candidate_that_did_not_run_stays_checkpointed() -> None:
    model = _mixed()
    skipped = model.blocks[2]
    model.blocks = nn.ModuleList([block for block in model.blocks if block is not skipped])
    model.add_module("unused", skipped)
    plan = _plan(model, 1.0)
    unused = [entry for entry in plan.candidates if entry.name == "unused"]
    assert [(entry.calls, entry.plain_bytes, entry.flops) for entry in unused] == [(0, 0, 0)]
    assert plan.checkpointed == ["unused"]
    assert "checkpoint (did not run)" in str(plan)


def test_a_candidate_checkpointed_before_stays_so() -> None:
    model = _mixed()
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.1"]))
    _plan(model, 1.0)
    assert list(checkpointed_modules(model)) == ["blocks.1"]


def test_plan_apply_checkpoints_exactly_the_plan_and_gradients_equal_a_plain_twins() -> None:
    model, twin = _mixed(), _mixed()
    config = CheckpointingConfig(**CONFIG, memory_budget=0.6, preserve_host_rng=True)
    plan = plan_activation_checkpointing(model, config, lambda: _closure(model))
    model.zero_grad(set_to_none=True)
    assert 0 < len(plan.checkpointed) < 6
    assert plan.apply(model) == plan.checkpointed
    assert list(checkpointed_modules(model)) == plan.checkpointed
    assert all(module.forward.config == config for module in checkpointed_modules(model).values())
    _closure(model)
    _closure(twin)
    for (name, parameter), twin_parameter in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(parameter.grad, twin_parameter.grad), name
    # Applying another plan makes the modules it leaves out plain again.
    everything = CheckpointingPlan(**{**vars(plan), "checkpointed": []})
    assert everything.apply(model) == []
    assert checkpointed_modules(model) == {}


def test_the_plan_is_a_table_and_a_line() -> None:
    model = _mixed()
    plan = _plan(model, 0.6)
    lines = str(plan).splitlines()
    assert lines[0] == plan.summary()
    assert lines[1].split() == ["module", "plain", "checkpointed", "recompute", "FLOPs", "plan"]
    assert [line.split()[0] for line in lines[2:]] == [f"blocks.{index}" for index in range(6)]
    assert [line.split()[-1] for line in lines[2:]] == [
        "checkpoint" if f"blocks.{index}" in plan.checkpointed else "plain" for index in range(6)
    ]
    assert plan.summary().startswith(f"memory budget {plan.budget_bytes / 1024:.1f} KiB: checkpointing")


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (None, r"^`memory_budget` is None: `plan_activation_checkpointing` plans within a budget"),
        ("auto", r"^`memory_budget`='auto' needs a CUDA device, the model is on cpu; give bytes \('512MiB'\)"),
    ],
)
def test_planning_without_a_budget_or_with_auto_off_cuda_is_a_one_line_error(budget: object, message: str) -> None:
    model = _mixed()
    with pytest.raises(CheckpointingConfigError, match=message) as raised:
        plan_activation_checkpointing(
            model,
            CheckpointingConfig(**CONFIG, memory_budget=budget),
            lambda: _closure(model),  # type: ignore[arg-type]
        )
    assert "\n" not in str(raised.value)
    assert checkpointed_modules(model) == {}


@pytest.mark.parametrize("without", [torch.no_grad, torch.inference_mode])
def test_a_closure_without_gradients_is_refused_not_planned_from_nothing(without: Callable[[], Any]) -> None:
    model = _mixed()
    x, y = _batch()
    config = CheckpointingConfig(**CONFIG, memory_budget=0.5)  # type: ignore[arg-type]

    def evaluate() -> None:
        with without():
            F.mse_loss(model(x), y)

    with pytest.raises(CheckpointingConfigError) as raised:
        plan_activation_checkpointing(model, config, evaluate)
    assert str(raised.value).startswith("`closure` ran none of the 6 modules the config matches with gradients, so")
    assert checkpointed_modules(model) == {}
    assert plan_activation_checkpointing(model, config, lambda: _closure(model)).checkpointed


def test_save_ops_and_kept_routing_count_as_kept_when_checkpointed() -> None:
    plain = _mixed()
    kept = plan_activation_checkpointing(
        plain, CheckpointingConfig(**CONFIG, memory_budget=1.0, save_ops=["aten.mm"]), lambda: _closure(plain)
    )
    without = plan_activation_checkpointing(
        plain, CheckpointingConfig(**CONFIG, memory_budget=1.0), lambda: _closure(plain)
    )
    by_name = {entry.name: entry for entry in without.candidates}
    costly = next(entry for entry in kept.candidates if entry.name == "blocks.1")
    # Three products of ROWS x DIM floats are kept besides the input.
    assert costly.checkpointed_bytes == by_name["blocks.1"].checkpointed_bytes + 3 * ROWS * DIM * 4
    # And served from the cache, never run again: their FLOPs are not recomputed, as torch's backward counts them.
    held = nn.Sequential(copy.deepcopy(plain.blocks[1]))
    apply_activation_checkpointing(held, CheckpointingConfig(names=["0"], save_ops=["aten.mm"]))
    block_input = plain.blocks[0](plain.inp(_batch()[0])).detach()
    assert costly.flops == recomputation(plain.blocks[1], block_input, held)[1] == 0
    assert by_name["blocks.1"].flops == 2 * (2 * ROWS * DIM * DIM)  # without: two of its three products run again


@dataclasses.dataclass
class Bias:
    """An object a block receives that holds a tensor (an attention-bias object), not a pytree."""

    table: torch.Tensor


@dataclasses.dataclass(slots=True)
class SlottedBias:
    """A bias object with ``__slots__``, no ``__dict__``."""

    table: torch.Tensor


class NestedBias:
    """A bias object that holds the tensor through another object."""

    def __init__(self, table: torch.Tensor) -> None:
        self.inner = Bias(table)

    @property
    def table(self) -> torch.Tensor:
        return self.inner.table


class BiasedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, bias: Bias | SlottedBias | NestedBias) -> torch.Tensor:
        return torch.tanh(self.linear(x) + bias.table)


class BiasedStack(nn.Module):
    """Two blocks, each given a fresh bias that nothing else holds (a view of a wider table): a weak reference to each
    table tells whether the step holds it after the forward."""

    def __init__(self, holder: type[Bias | SlottedBias | NestedBias] = Bias) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BiasedBlock(), BiasedBlock()])
        self.holder = holder
        self.tables: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tables = []
        for block in self.blocks:
            table = torch.ones(ROWS, 2 * DIM)
            self.tables.append(weakref.ref(table))
            x = block(x, self.holder(table[:, :DIM]))
            del table
        return x


@pytest.mark.parametrize("holder", [Bias, SlottedBias, NestedBias])
def test_tensors_an_input_object_holds_count_as_kept_when_checkpointed_as_the_step_holds_them(
    holder: type[Bias | SlottedBias | NestedBias],
) -> None:
    torch.manual_seed(0)
    model = BiasedStack(holder)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    plain_graph = model(x).grad_fn
    # Plain, nothing holds them after the forward: an addition saves no operand.
    assert plain_graph is not None
    assert [table() for table in model.tables] == [None, None]
    config = CheckpointingConfig(classes=["BiasedBlock"], memory_budget=1.0)
    plan = plan_activation_checkpointing(model, config, lambda: model(x).sum().backward())
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["BiasedBlock"]))
    graph = model(x).grad_fn  # the step's graph, alive as until its backward
    held = [table() for table in model.tables]
    # Checkpointed, torch holds each block's inputs for the recomputation, and so the bias and the table behind it.
    assert all(table is not None for table in held)
    block_input = x.untyped_storage().nbytes()  # each block's input is ROWS x DIM floats, as x
    assert [entry.checkpointed_bytes for entry in plan.candidates] == [
        block_input + table.untyped_storage().nbytes() for table in held
    ]
    assert graph is not None


def test_a_candidate_keeping_other_op_outputs_is_refused_by_planning_and_checkpointed_again_by_apply() -> None:
    kept = CheckpointingConfig(**CONFIG, save_ops=["aten.addmm"])  # type: ignore[arg-type]
    model = _mixed()
    apply_activation_checkpointing(model, kept)
    with pytest.raises(
        CheckpointingConfigError,
        match=r"`memory_budget`: `blocks.0`, .* checkpointed already, keeping other op outputs .* call"
        r" `remove_activation_checkpointing\(model\)` first",
    ):
        _plan(model, 0.5)
    assert all(module.forward.config == kept for module in checkpointed_modules(model).values())  # left as it was
    fresh = _mixed()
    plan = _plan(fresh, 0.5)
    assert plan.apply(model) == plan.checkpointed
    # A plan's modules keep what the plan measured: its config, not the one they were checkpointed with before.
    assert list(checkpointed_modules(model)) == plan.checkpointed
    assert all(module.forward.config == plan.config for module in checkpointed_modules(model).values())


@pytest.mark.parametrize("whole", [True, False], ids=["model compiled", "each block compiled"])
def test_a_compiled_model_is_planned_from_its_eager_measurement(whole: bool) -> None:
    # The compiler recomputes compiled regions out of the meter's sight: the measured step runs uncompiled, and the
    # plan is the eager model's (it was a 0-byte plan of candidates that "did not run").
    eager = _plan(_mixed(), 0.5)
    model = _mixed()
    torch._dynamo.reset()
    try:
        if whole:
            model.compile(backend="aot_eager")
        else:
            for block in model.blocks:
                block.compile(backend="aot_eager")
        compiled = _plan(model, 0.5)
    finally:
        torch._dynamo.reset()
    assert compiled.candidates == eager.candidates and compiled.checkpointed == eager.checkpointed
    assert [entry.calls for entry in compiled.candidates] == [1] * 6


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ExpertsOnViews(nn.Module):
    """Four experts, each given its own rows of one activation as a view (as `torch.split` of sorted tokens does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList([Expert() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        rows = len(x) // len(self.experts)
        return torch.cat([expert(hidden[rows * i : rows * (i + 1)]) for i, expert in enumerate(self.experts)])


def test_an_activation_experts_get_views_of_is_counted_once_as_the_step_keeps_it_once() -> None:
    torch.manual_seed(0)
    model = ExpertsOnViews()
    plan = plan_activation_checkpointing(
        model, CheckpointingConfig(classes=["Expert"], memory_budget=1.0), lambda: model(_batch()[0]).sum().backward()
    )
    shared = ROWS * DIM * 4  # the activation behind every expert's input view, kept checkpointed or not
    own = (ROWS // 4) * 2 * DIM * 4  # each expert's ReLU output, which its second layer saves
    # Plain, each expert saves its input view (the whole storage behind it) and its ReLU output; checkpointed, torch
    # holds the input view. The storage behind the views is one, held by every expert: counted at the first only.
    assert [(entry.plain_bytes, entry.checkpointed_bytes) for entry in plan.candidates] == [
        (shared + own, shared),
        *[(own, 0)] * 3,
    ]
    assert plan.kept_bytes == shared + 4 * own  # what the step keeps without checkpointing, the storage once
    # The step's own saved storages, without checkpointing: the batch (the first layer's input) besides those.
    saved: dict[int, int] = {}
    weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    batch = _batch()[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(batch)
    assert sum(saved.values()) == batch.untyped_storage().nbytes() + plan.kept_bytes


def _least_by_brute_force(figures: list[RegionFigures], budget: int) -> tuple[int, int, int]:
    """The least (cost, count, -bytes saved) over every subset that keeps at most ``budget``."""
    need = sum(entry.plain_bytes for entry in figures) - budget
    return min(
        (sum(entry.cost for entry in chosen), len(chosen), -sum(entry.saving for entry in chosen))
        for count in range(len(figures) + 1)
        for chosen in itertools.combinations(figures, count)
        if sum(entry.saving for entry in chosen) >= need
    )


def test_the_module_choice_is_exact_where_costs_per_byte_differ_below_a_floats_precision() -> None:
    # Costs near 2**56 per GiB saved: ratios a float division ties or misorders (the search's bound needs their order).
    rows = [
        (2**30, 2**56 - 1),
        (2**30 + 64, 2**56 + 2**32 + 5),
        (2**30 + 2, 2**56 + 2**27 + 3),
        (2**30 + 64, 2**56 + 2**32 + 4),
    ]
    cases = [(rows, 2 * 2**30 + 66)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        drawn = [
            (
                2**30 + int(torch.randint(0, 128, (1,), generator=generator)),
                2**56 + int(torch.randint(0, 2**33, (1,), generator=generator)),
            )
            for _ in range(5)
        ]
        cases.append((drawn, int(torch.randint(2**30, 4 * 2**30, (1,), generator=generator))))
    for drawn, budget in cases:
        figures = [RegionFigures(f"m{index}", saving, 0, cost, 1, cost) for index, (saving, cost) in enumerate(drawn)]
        chosen = choose_checkpointed(figures, budget, [entry.cost for entry in figures])
        assert chosen is not None
        picked = [entry for entry in figures if entry.name in chosen]
        found = (sum(entry.cost for entry in picked), len(picked), -sum(entry.saving for entry in picked))
        assert found == _least_by_brute_force(figures, budget)


def test_figures_given_with_float_costs_plan_as_their_exact_values_do() -> None:
    figures = [RegionFigures("a", 100, 10, 1.5, 1, 1.5), RegionFigures("b", 100, 10, 2.5, 1, 2.5)]  # type: ignore[arg-type]
    assert choose_checkpointed(figures, 20, [1.5, 2.5]) == {"a", "b"}  # type: ignore[list-item]
    assert choose_checkpointed(figures, 150, [1.5, 2.5]) == {"a"}  # type: ignore[list-item]


class RaisesOnEveryAttribute:
    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        raise KeyError(name)


class HoldsAnOddObject:
    def __init__(self, table: torch.Tensor) -> None:
        self.odd = RaisesOnEveryAttribute()
        self.table = table


def test_an_input_object_holding_one_whose_attributes_raise_is_measured_by_what_it_does_hold() -> None:
    table = torch.ones(ROWS, DIM)
    assert [held is table for held in _held_tensors((HoldsAnOddObject(table), nn.functional))] == [True]
