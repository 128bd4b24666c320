"""Tests for `budget_granularity="op"`: the op plan equals a brute-force optimum over the test's own measurement of
every op call, stays within its budget, never costs more as the budget grows, and trains bit-identically."""

import copy
import itertools
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingPlan,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.budget_plan import plan_from_figures
from lightning_ckpt_determinism.checkpointing.measure import OpFigures, RegionFigures
from lightning_ckpt_determinism.checkpointing.op_choice import choose_kept_ops
from lightning_ckpt_determinism.checkpointing.wrapper import keep_op_calls
from tests.helpers import OpCounter, Stack, recomputation
from tests.test_budget import CONFIG, DIM, ROWS, CheapBlock, CostlyBlock, WideBlock, _batch, _closure

# The cost model's documented ratio of FLOP rate to bandwidth: 100 TFLOP/s over 2 TB/s.
FLOPS_PER_BYTE = 50


def _small(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack([CheapBlock(), CostlyBlock(), CheapBlock(), WideBlock()], dim=DIM)


def _plan(model: nn.Module, budget: object, granularity: str = "op", cost: str = "roofline") -> CheckpointingPlan:
    config = CheckpointingConfig(
        **CONFIG,  # type: ignore[arg-type]
        memory_budget=budget,  # type: ignore[arg-type]
        budget_granularity=granularity,  # type: ignore[arg-type]
        budget_cost=cost,  # type: ignore[arg-type]
    )
    return plan_activation_checkpointing(model, config, lambda: _closure(model))


class _Ops(TorchDispatchMode):
    """The test's own record of a plain forward's op calls: (overload, bytes of fresh storages, roofline cost at
    ``flops_per_byte``, or the FLOPs alone when it is ``None``)."""

    def __init__(self, state: set[int], flops_per_byte: float | None = FLOPS_PER_BYTE) -> None:
        super().__init__()
        self.state = state
        self.flops_per_byte = flops_per_byte
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default:
            return out
        outputs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        pointers = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in outputs}
        arguments = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        inputs = {tensor.untyped_storage().data_ptr() for tensor in arguments}
        fresh = not func.is_view and not func._schema.is_mutable and not (pointers.keys() & (inputs | self.state))
        tensors = [leaf for leaf in tree_leaves((args, kwargs, out)) if isinstance(leaf, torch.Tensor)]
        moved = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        flops = 0
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2:]
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if self.flops_per_byte is None:
            cost = flops
        else:
            view = func._schema.returns and func.is_view
            cost = 0 if view else max(math.ceil(flops / self.flops_per_byte), moved)
        self.calls.append((str(func), sum(pointers.values()) if fresh else 0, cost))
        return out


def _own_measurement(
    model: Stack, flops_per_byte: float | None = FLOPS_PER_BYTE
) -> dict[str, tuple[int, int, list[tuple[str, int, int]]]]:
    """Per block, on the plain model: (bytes autograd saves, bytes of its input, its op calls, costed at
    ``flops_per_byte`` or by FLOPs alone; those torch's own checkpoint of it does not run again cost nothing)."""
    state = {tensor.untyped_storage().data_ptr() for tensor in model.parameters()}
    figures = {}
    x = model.inp(_batch()[0])
    for index, block in enumerate(model.blocks):
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in state:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        ops = _Ops(state, flops_per_byte)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), ops:
            out = block(x)
        rerun, _ = recomputation(block, x)
        calls = [(op, size, cost if at < rerun else 0) for at, (op, size, cost) in enumerate(ops.calls)]
        figures[f"blocks.{index}"] = (sum(storages.values()), x.untyped_storage().nbytes(), calls)
        x = out
    return figures


def _options(plain: int, inputs: int, calls: list[tuple[str, int, int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Every option of one block: plain (index tuple ``(-1,)``), or checkpointed keeping any subset of its calls."""
    total = sum(cost for _, _, cost in calls)
    choosable = [index for index, (_, size, cost) in enumerate(calls) if size and cost]
    found = [(plain, 0, (-1,))]
    for count in range(len(choosable) + 1):
        for subset in itertools.combinations(choosable, count):
            found.append((inputs + sum(calls[i][1] for i in subset), total - sum(calls[i][2] for i in subset), subset))
    return found


def _brute_force(figures: dict[str, tuple[int, int, list[tuple[str, int, int]]]], budget: int) -> int | None:
    """The least recompute cost within ``budget`` over every combination of every block's options."""
    options = [_options(*entry) for entry in figures.values()]
    best = None
    for combination in itertools.product(*options):
        if sum(size for size, _, _ in combination) <= budget:
            cost = sum(cost for _, cost, _ in combination)
            best = cost if best is None else min(best, cost)
    return best


Figures = dict[str, tuple[int, int, list[tuple[str, int, int]]]]


def _cost_and_bytes(plan: CheckpointingPlan, figures: Figures) -> tuple[int, int]:
    """The plan's recompute cost and kept bytes, from the test's own figures."""
    cost = kept = 0
    for name, (plain, inputs, calls) in figures.items():
        if name not in plan.checkpointed:
            kept += plain
            continue
        saved = {index for index, _ in plan.saved_ops[name]}
        kept += inputs + sum(calls[index][1] for index in saved)
        cost += sum(call[2] for index, call in enumerate(calls) if index not in saved)
    return cost, kept


def test_the_op_measurement_equals_the_tests_own() -> None:
    own = _own_measurement(_small())
    plan = _plan(_small(), 1.0)
    for entry in plan.candidates:
        plain, inputs, calls = own[entry.name]
        assert (entry.plain_bytes, entry.checkpointed_bytes) == (plain, inputs)
        assert [(op.op, op.bytes, op.cost) for op in entry.ops] == calls
        assert [op.index for op in entry.ops] == list(range(len(calls)))
        assert entry.cost == sum(cost for _, _, cost in calls)


@pytest.mark.parametrize("fraction", [0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0])
def test_the_op_plan_is_the_brute_force_optimum_of_the_tests_own_measurement(fraction: float) -> None:
    own = _own_measurement(_small())
    plan = _plan(_small(), fraction)
    best = _brute_force(own, plan.budget_bytes)
    assert best is not None
    cost, kept = _cost_and_bytes(plan, own)
    assert cost == best
    assert kept == plan.kept_bytes <= plan.budget_bytes
    assert plan.slack_bytes == 0
    total = sum(call[2] for _, _, calls in own.values() for call in calls)
    assert plan.recompute_share == pytest.approx(cost / total)


def test_a_sweep_of_20_budgets_never_costs_more_as_the_budget_grows_and_never_beats_module_granularity() -> None:
    figures = _plan(_small(), 1.0).candidates
    least = sum(entry.checkpointed_bytes for entry in figures)
    plain = sum(entry.plain_bytes for entry in figures)
    costs = []
    for step in range(20):
        budget = least + (plain - least) * step // 19
        config = CheckpointingConfig(**CONFIG, memory_budget=budget, budget_granularity="op")
        plan = plan_from_figures(figures, config)
        assert plan.kept_bytes <= budget
        cost = round(plan.recompute_share * sum(entry.cost for entry in figures))
        costs.append(cost)
        # Module granularity's plan is one of op granularity's options: its cost in the same model is never lower.
        module_plan = plan_from_figures(figures, CheckpointingConfig(**CONFIG, memory_budget=budget))
        assert cost <= sum(entry.cost for entry in figures if entry.name in module_plan.checkpointed)
    inversions = sum(later > earlier for earlier, later in itertools.pairwise(costs))
    assert inversions == 0
    assert costs[0] > costs[-1] == 0


def test_of_equal_costs_the_op_plan_checkpoints_fewer_modules_as_module_granularity_does() -> None:
    # Under the FLOP count an elementwise region costs nothing to recompute; where everything fits plainly,
    # checkpointing it saves no cost and adds a region's overhead: it stays plain, as module granularity leaves it.
    free = RegionFigures("free", 100, 10, 0, 1, 0)
    costly = RegionFigures("costly", 200, 10, 64, 1, 64, (OpFigures(0, "aten.mm.default", 50, 64),))
    config = CheckpointingConfig(names=["free", "costly"], memory_budget=300)
    assert plan_from_figures([free, costly], config).checkpointed == []
    choice = choose_kept_ops([free, costly], 300)
    assert choice is not None and (choice.kept, choice.kept_bytes, choice.cost) == ({}, 300, 0)
    # Of one module checkpointed at no cost either way, the fewer bytes: `costly` keeping its product's output.
    choice = choose_kept_ops([free, costly], 250)
    assert choice is not None and (choice.kept, choice.kept_bytes, choice.cost) == ({"costly": (0,)}, 160, 0)


@pytest.mark.parametrize("granularity", ["module", "op"])
def test_an_unmeetable_budget_keeps_the_least_it_names_and_a_module_saving_nothing_stays_plain(
    granularity: str,
) -> None:
    # `scale` keeps its input checkpointed and saves nothing plainly: checkpointing it would keep 64 bytes for nothing.
    figures = [
        RegionFigures("block", 400, 64, 100, 1, 100, (OpFigures(0, "aten.mm.default", 128, 100),)),
        RegionFigures("scale", 0, 64, 0, 1, 0),
        RegionFigures("unused", 0, 0, 0, 0),  # did not run: checkpointed, as every plan has it
    ]
    config = CheckpointingConfig(names=["block", "scale", "unused"], memory_budget=10, budget_granularity=granularity)
    with pytest.warns(LightningCkptDeterminismWarning, match="keep at least 64 bytes") as caught:
        plan = plan_from_figures(figures, config)
    assert len(caught) == 1
    assert (plan.checkpointed, plan.kept_bytes) == (["block", "unused"], 64)


def test_identical_blocks_share_one_frontier_and_the_choice_is_exact_over_copies() -> None:
    ops = (OpFigures(0, "aten.mm.default", 30, 20), OpFigures(1, "aten.sin.default", 10, 12))
    figures = [RegionFigures(f"b{index}", 100, 10, 0, 1, 40, ops) for index in range(3)]
    # Budget 90: three checkpointed (30) plus 60 bytes of outputs. The three sins (30 bytes, 36 back) and one mm
    # (30 bytes, 20 back) save 56; two mm save 40, and two mm with one sin need 70 bytes.
    choice = choose_kept_ops(figures, 90)
    assert choice is not None
    assert (choice.kept_bytes, choice.cost) == (90, 3 * 40 - 56)
    assert sorted(choice.kept.values()) == [(0, 1), (1,), (1,)]
    assert choose_kept_ops(figures, 29) is None


def test_the_plan_applied_keeps_its_op_outputs_and_gradients_equal_a_plain_twins() -> None:
    model = _small()
    plan = _plan(model, 0.75)
    kept_sins = sum(op == "aten.sin.default" for calls in plan.saved_ops.values() for _, op in calls)
    assert kept_sins > 0
    assert plan.apply(model) == plan.checkpointed
    twin = _small()
    model.zero_grad(set_to_none=True)
    sins = _sins_recomputed(model)
    _closure(twin)
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad), name
    # The same regions keeping nothing recompute the kept sins too.
    for name in plan.checkpointed:
        keep_op_calls(model.get_submodule(name), ())
    model.zero_grad(set_to_none=True)
    assert _sins_recomputed(model) == sins + kept_sins


def _sins_recomputed(model: nn.Module) -> int:
    """How many `aten.sin` calls the backward of one step runs (recomputation; sin's own backward runs cos)."""
    x, y = _batch()
    loss = torch.nn.functional.mse_loss(model(x), y)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts["aten.sin"]


class _CacheAtFirstCall(nn.Module):
    """Builds a cache with three ops at its first call only, then two linear layers, the second's output written in
    place (`relu_`), and a third."""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.m, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(1).add_(1).mul_(0.5)
        return x + self.o(self.m(self.k(x).tanh()).relu_()) * self.cache


class _BranchLater(nn.Module):
    """A linear layer; from when `branch` is set, a scaled input through an extra linear layer first, its output
    written in place."""

    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.linear, self.extra = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.branch = False
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch:
            x = self.extra(x * 2 if self.scaled else x).relu_()
        return torch.sin(torch.sin(self.linear(x)))


@pytest.mark.parametrize("block", [_CacheAtFirstCall, _BranchLater], ids=["cache_at_first_call", "later_branch"])
def test_a_call_unlike_the_measured_one_keeps_nothing_from_where_it_differs_with_one_warning(
    block: type[nn.Module],
) -> None:
    # The plan measures a region's first call. Where later calls run fewer ops first (a cache built at the first call
    # only) or more (a branch taken later, its own `addmm` first), the op at a kept position was another `addmm`,
    # whose output `relu_` then wrote: kept by position or by occurrence, backward raised (a fit ended at its second
    # batch). Such a call now keeps nothing from its first op unlike the measured call's, and stays exact.
    torch.manual_seed(0)
    model = nn.Sequential(block(), block())
    twin = copy.deepcopy(model)
    x = torch.randn(8, DIM)
    config = CheckpointingConfig(names=["0", "1"], memory_budget=0.9, budget_granularity="op")
    plan = plan_activation_checkpointing(model, config, lambda: model(x).square().mean().backward())
    kept = [name for name, calls in plan.saved_ops.items() if calls]
    assert kept
    plan.apply(model)
    twin(x).square().mean().backward()  # the twin's first call builds its caches too
    for module in (*model, *twin):
        module.branch = True
    with pytest.warns(LightningCkptDeterminismWarning, match=r"where the measured call of its") as said:
        for step in range(2):
            model.zero_grad()
            twin.zero_grad()
            model(x + step).square().mean().backward()
            twin(x + step).square().mean().backward()
            for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(ours.grad, theirs.grad)
    assert len([w for w in said if issubclass(w.category, LightningCkptDeterminismWarning)]) == len(kept)


def test_a_branch_that_starts_as_the_measured_call_and_writes_a_kept_output_is_told_to_take_it_at_measuring() -> None:
    # Its first ops are the measured call's, a kept one among them, until `relu_` writes that output: torch cannot
    # undo that, and said to remove the op from `save_ops`, which the user never set.
    torch.manual_seed(0)
    model = nn.Sequential(_BranchLater(scaled=False))
    x = torch.randn(8, DIM)
    config = CheckpointingConfig(names=["0"], memory_budget=0.9, budget_granularity="op")
    plan = plan_activation_checkpointing(model, config, lambda: model(x).square().mean().backward())
    assert plan.saved_ops == {"0": ((1, "aten.addmm.default"),)}
    plan.apply(model)
    model[0].branch = True
    with pytest.raises(RuntimeError, match=r"then another path \(a branch taken after the measured batch\)"):
        model(x).square().mean().backward()


class _NormedMLP(nn.Module):
    """A layer norm, then two linear layers around a GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))).tanh()


def test_an_op_plan_with_save_ops_keeps_what_it_planned_at_every_step() -> None:
    # The policy did not count the `save_ops` calls the meter counted: from the first of them every call read as
    # unlike the measured one, kept none of the plan's outputs (a warning naming a `view` each fit) and recomputed them.
    torch.manual_seed(0)
    model = nn.Sequential(_NormedMLP(), _NormedMLP(), _NormedMLP())
    x = torch.randn(4, 8, DIM)
    config = CheckpointingConfig(
        classes=["_NormedMLP"], memory_budget=0.6, budget_granularity="op", save_ops=["aten.native_layer_norm"]
    )
    plan = plan_activation_checkpointing(model, config, lambda: model(x).square().mean().backward())
    kept_addmm = sum(op == "aten.addmm.default" for calls in plan.saved_ops.values() for _, op in calls)
    assert kept_addmm > 0
    plan.apply(model)
    for step in range(3):
        loss = model(x + step).square().mean()
        with OpCounter() as recomputed:
            loss.backward()
        assert recomputed.counts["aten.addmm"] == 2 * len(plan.checkpointed) - kept_addmm, step


def test_keep_op_calls_refuses_calls_the_measured_ops_do_not_hold() -> None:
    model = _small()
    plan = _plan(model, 0.85)
    plan.apply(model)
    name = plan.checkpointed[0]
    with pytest.raises(ValueError, match=r"the measured call does not run aten\.cos\.default as its op call 1"):
        keep_op_calls(model.get_submodule(name), [(1, "aten.cos.default")], plan.measured_ops(name))


def test_module_granularity_plans_keep_no_op_outputs_and_share_the_flop_model() -> None:
    plan = _plan(_small(), 0.6, "module", "flops")
    assert plan.saved_ops == {}
    assert plan.recompute_share == plan.recomputed_flops_share
    assert all(entry.ops == () for entry in plan.candidates)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        str(plan)


def test_the_op_plan_is_a_table_and_a_line() -> None:
    plan = _plan(_small(), 0.85)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == plan.summary()
    assert "of their recompute cost (keeping" in lines[0]
    assert lines[1].split() == ["module", "plain", "checkpointed", "recompute", "FLOPs", "plan"]
    for name, calls in plan.saved_ops.items():
        (row,) = [line for line in lines[2:] if line.startswith(name + " ")]
        assert row.endswith(f"checkpoint, keeping {len(calls)} op{'s' * (len(calls) != 1)}")


class _LiveStorages(TorchDispatchMode):
    """Weak references to every op output's storage (parameters left out), to sum those still alive later."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self._excluded = excluded
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in self._excluded:
                storage = leaf.untyped_storage()
                self._storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def held(self) -> int:
        return sum(size for ref, size in self._storages.values() if not ref.expired())


def _held_after_forward(model: nn.Module) -> int:
    """The bytes of op outputs the loss's graph holds alive after one forward."""
    x, y = _batch()
    with _LiveStorages({parameter.untyped_storage().data_ptr() for parameter in model.parameters()}) as live:
        loss = torch.nn.functional.mse_loss(model(x), y)
    held = live.held()
    del loss
    return held


@pytest.mark.parametrize("fraction", [0.4, 0.6, 0.7, 0.9])
def test_the_bytes_a_step_under_the_plan_holds_equal_the_planned_bytes(fraction: float) -> None:
    model = _small()
    plan = _plan(model, fraction)
    model.zero_grad(set_to_none=True)
    plan.apply(model)
    # Against every block checkpointed keeping nothing, which holds their checkpointed bytes and the rest alike.
    every = _small()
    apply_activation_checkpointing(every, CheckpointingConfig(**CONFIG))  # type: ignore[arg-type]
    least = sum(entry.checkpointed_bytes for entry in plan.candidates)
    assert _held_after_forward(model) - _held_after_forward(every) == plan.kept_bytes - least


class InPlaceBlock(nn.Module):
    """A linear layer whose output an in-place ReLU overwrites, and a dropout (on the CPU an ``empty_like`` that
    ``bernoulli_`` fills): op outputs written in place later in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.act, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(torch.sin(self.act(self.inp(x)))))


@pytest.mark.parametrize("fraction", [0.5, 0.8, 0.95, 0.98])
def test_an_op_output_written_in_place_later_is_never_kept_and_the_plan_trains_exactly(fraction: float) -> None:
    model, twin, plan = _planned_with_twin(InPlaceBlock, fraction)
    for name, calls in plan.saved_ops.items():
        ops = [op for _, op in calls]
        assert "aten.empty_like.default" not in ops, name
        # The first `addmm` of a block is the one the in-place ReLU overwrites.
        first_addmm = next(call for call in plan_op_calls(plan, name) if call.op == "aten.addmm.default")
        assert first_addmm.index not in [index for index, _ in calls], name
    for step in range(2):
        _assert_same_gradients(model, twin, seed=step)


class NoisyBlock(nn.Module):
    """Adds noise drawn in forward to a linear layer's output, then sines and a dropout: random ops whose output a plan
    could keep, with another random op after them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + torch.randn_like(x)
        return F.dropout(h.sin().sin().sin(), 0.5, training=self.training)


@pytest.mark.parametrize("budget", [0.3, 0.6, 0.9])
def test_a_random_ops_output_is_never_kept_and_the_plan_trains_exactly(budget: float) -> None:
    model, twin, plan = _planned_with_twin(NoisyBlock, budget)
    random = {"aten.randn_like.default", "aten.native_dropout.default", "aten.bernoulli_.float"}
    for name in plan.saved_ops:
        assert all(call.bytes == 0 for call in plan_op_calls(plan, name) if call.op in random), name
    _assert_same_gradients(model, twin, seed=1)


def _planned_with_twin(block: type[nn.Module], budget: float) -> tuple[nn.Module, nn.Module, CheckpointingPlan]:
    """A seeded stack of two ``block`` s under an op-granularity plan for ``budget``, its plain twin and the plan."""
    torch.manual_seed(0)
    model = Stack([block(), block()], dim=DIM)
    twin = copy.deepcopy(model)
    config = CheckpointingConfig(classes=[block.__name__], memory_budget=budget, budget_granularity="op")
    plan = plan_activation_checkpointing(model, config, lambda: _closure(model))
    plan.apply(model)
    return model, twin, plan


def _assert_same_gradients(model: nn.Module, twin: nn.Module, *, seed: int) -> None:
    """One closure of ``model`` and of its plain ``twin`` from the same seed gives them the same gradients, bit for
    bit."""
    for net in (model, twin):
        net.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        _closure(net)
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad), name


def plan_op_calls(plan: CheckpointingPlan, name: str) -> list[OpFigures]:
    return next(figures.ops for figures in plan.candidates if figures.name == name)


class QueryBlock(nn.Module):
    """A learned query its own linear layer projects (a leaf that requires grad, passed to a submodule), gating
    another projection of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, DIM))
        self.key, self.value = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.value(x) * self.key(self.query))


@pytest.mark.parametrize("budget", [0.5, 0.8])
def test_op_calls_are_counted_as_training_counts_them_when_a_parameter_is_a_submodules_input(budget: float) -> None:
    model, twin, plan = _planned_with_twin(QueryBlock, budget)
    x, ops = torch.randn(ROWS, DIM), _Ops(set())
    with ops:
        twin.blocks[0](x)
    assert [call.op for call in plan_op_calls(plan, "blocks.0")] == [op for op, _, _ in ops.calls]
    assert plan.saved_ops  # something is kept, at the positions training counts (a shift would warn, an error here)
    least = sum(entry.checkpointed_bytes for entry in plan.candidates)
    every = copy.deepcopy(twin)
    apply_activation_checkpointing(every, CheckpointingConfig(classes=["QueryBlock"]))
    assert _held_after_forward(model) - _held_after_forward(every) == plan.kept_bytes - least
    _assert_same_gradients(model, twin, seed=0)


class RReLUBlock(nn.Module):
    """Ends in an `nn.RReLU`, which saves its input and noise before it runs: torch's early stop would end the
    recomputation before it, and the package's recomputation runs to the region's end."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out, self.act = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.out(torch.tanh(self.inp(x))))


@pytest.mark.parametrize("block", [CheapBlock, WideBlock, RReLUBlock])
def test_the_op_calls_costed_are_those_the_regions_recomputation_runs_again(block: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = Stack([block()], dim=DIM)
    x = model.inp(_batch()[0]).detach()
    ops = _Ops({param.untyped_storage().data_ptr() for param in model.parameters()})
    with ops:
        model.blocks[0](x)
    held = nn.Sequential(copy.deepcopy(model.blocks[0]))
    apply_activation_checkpointing(held, CheckpointingConfig(names=["0"]))
    rerun, flops = recomputation(model.blocks[0], x, held)
    config = CheckpointingConfig(classes=[block.__name__], memory_budget=1.0, budget_granularity="op")
    (figures,) = plan_activation_checkpointing(model, config, lambda: _closure(model)).candidates
    costs = [(op, cost if at < rerun else 0) for at, (op, _, cost) in enumerate(ops.calls)]
    assert [(op.op, op.cost) for op in figures.ops] == costs
    assert figures.flops == flops
    # Early stop ends a recomputation before a last op that saves only its inputs (they are saved before it runs); the
    # package runs a region ending in RReLU to its end.
    assert rerun == len(costs) if block is RReLUBlock else rerun < len(costs)


class SharingBlock(nn.Module):
    """A block whose second layer is shared with the other blocks."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.own = nn.Linear(DIM, 2 * DIM)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shared(F.gelu(self.own(x)))


class SharingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(2 * DIM, DIM)
        self.blocks = nn.ModuleList([SharingBlock(shared), SharingBlock(shared)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _autocast_step(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(_batch()[0]).float().pow(2).mean()
    loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def test_regions_sharing_a_layer_under_autocasts_cache_are_planned_whole_and_train_as_the_plain_twin() -> None:
    # Autocast caches the shared weight's cast from the first block: the second block's forward casts it one time less
    # than its recomputation, so op outputs kept by position would be other ops in backward.
    torch.manual_seed(0)
    plain = SharingStack()
    model = copy.deepcopy(plain)
    config = CheckpointingConfig(classes=["SharingBlock"], memory_budget=0.6, budget_granularity="op")
    plan = plan_activation_checkpointing(model, config, lambda: _autocast_step(model))
    assert [entry.ops for entry in plan.candidates] == [(), ()]
    assert all(not kept for kept in plan.saved_ops.values())
    plan.apply(model)
    expected, got = _autocast_step(plain), _autocast_step(model)
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.parametrize("seed", range(4))
def test_the_op_choice_is_the_brute_force_optimum_on_drawn_figures(seed: int) -> None:
    # Three candidates of four op calls each, with drawn bytes and costs: every budget from the least to all plain.
    generator = torch.Generator().manual_seed(seed)

    def drawn(high: int) -> int:
        return int(torch.randint(1, high, (1,), generator=generator))

    own: Figures = {}
    figures = []
    for index in range(3):
        calls = [("aten.mm.default", drawn(60), drawn(40)) for _ in range(4)]
        inputs, plain = drawn(20), 20 + sum(size for _, size, _ in calls) + drawn(30)
        own[f"m{index}"] = (plain, inputs, calls)
        ops = tuple(OpFigures(at, op, size, cost) for at, (op, size, cost) in enumerate(calls))
        total = sum(cost for _, _, cost in calls)
        figures.append(RegionFigures(f"m{index}", plain, inputs, 0, 1, total, ops))
    least = sum(inputs for _, inputs, _ in own.values())
    for budget in range(least, sum(plain for plain, _, _ in own.values()) + 1, 7):
        choice = choose_kept_ops(figures, budget)
        assert choice is not None and choice.slack_bytes == 0 and choice.kept_bytes <= budget
        assert choice.cost == _brute_force(own, budget)
