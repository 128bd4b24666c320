"""Routing that cannot flip: ``keep_data_dependent`` keeps data-dependent outputs from the forward.

The models are :mod:`examples.moe`'s: a deterministic mixture of experts, and one whose router logits drift by a few
ulps in recomputation only, with ties at the top-k boundary that the drift breaks the other way.
"""

import copy
import gc
import json
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import fx, nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.utils import counters
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from examples import train
from examples.moe import DriftingRouterMoEBlock, MoEBlock, MoEModule
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    apply_activation_checkpointing,
    check_recomputation,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
)
from lightning_ckpt_determinism.audit import main
from lightning_ckpt_determinism.checkpointing.routing import is_data_dependent
from lightning_ckpt_determinism.verify.cause import respelt
from lightning_ckpt_determinism.verify.compiled import reference_pass
from tests.helpers import OpCounter, PartsBlock, gradients_of

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
DIM = 16
BLOCKS = ["blocks.0", "blocks.1"]
aten = torch.ops.aten


def moe(drifting: bool = False, keep: bool | None = True, blocks: int = 2, **config: Any) -> MoEModule:
    """A seeded :class:`MoEModule`, its blocks checkpointed with ``keep_data_dependent=keep`` (``None``: not)."""
    torch.manual_seed(0)
    model = MoEModule(blocks=blocks, dim=DIM, drifting_router=drifting)
    if keep is not None:
        apply_activation_checkpointing(
            model, CheckpointingConfig(classes=["MoEBlock"], keep_data_dependent=keep, **config)
        )
    return model


def tokens(count: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(count, DIM, generator=generator), torch.randn(count, 1, generator=generator)


def gradients(model: nn.Module, twice: str | None = None) -> dict[str, torch.Tensor]:
    """Gradients of an MSE step on :func:`tokens` (see :func:`gradients_of` for ``twice``)."""
    return gradients_of(model, *tokens(), twice)


def unequal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in first if not torch.equal(first[name], second[name])]


def largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max(float((first[name] - second[name]).abs().max()) for name in first)


def mse_check(model: nn.Module, **options: Any) -> Any:
    x, y = tokens()
    return check_recomputation(model, lambda: F.mse_loss(model(x), y), **options)


# The rule.

RULE = [
    # torch's tags
    (aten.nonzero.default, (torch.ones(3),), True),
    (aten.bincount.default, (torch.ones(3, dtype=torch.long),), True),
    (aten._unique2.default, (torch.ones(3),), True),
    (aten.masked_select.default, (torch.ones(3), torch.ones(3, dtype=torch.bool)), True),
    (aten.repeat_interleave.Tensor, (torch.ones(3, dtype=torch.long),), True),
    (aten._local_scalar_dense.default, (torch.ones(()),), True),
    # the fixed list, which torch leaves untagged
    (aten.topk.default, (torch.ones(3), 2), True),
    (aten.sort.stable, (torch.ones(3),), True),
    (aten.kthvalue.default, (torch.ones(3), 2), True),
    (aten.argmax.default, (torch.ones(3),), True),
    (aten.argmin.default, (torch.ones(3),), True),
    (aten.max.dim, (torch.ones(3), 0), True),
    (aten.min.dim, (torch.ones(3), 0), True),
    (aten.searchsorted.Tensor, (torch.ones(3), torch.ones(2)), True),
    (aten.histc.default, (torch.ones(3),), True),
    # a boolean mask decides the shape of indexing, integer indices do not
    (aten.index.Tensor, (torch.ones(3), [torch.ones(3, dtype=torch.bool)]), True),
    (aten.index.Tensor, (torch.ones(3), [torch.zeros(2, dtype=torch.long)]), False),
    # full reductions and ordinary ops
    (aten.max.default, (torch.ones(3),), False),
    (aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), False),
]


@pytest.mark.parametrize(("op", "args", "expected"), RULE, ids=[f"{op}-{expected}" for op, _, expected in RULE])
def test_the_rule_is_torchs_tags_plus_a_fixed_list(op: Any, args: tuple[Any, ...], expected: bool) -> None:
    assert is_data_dependent(op, args) is expected


# Deterministic routing: exact, with and without the guard.


@pytest.mark.parametrize("keep", [True, False])
def test_deterministic_moe_gradients_equal_no_checkpointing_bit_for_bit(keep: bool) -> None:
    expected = gradients(moe(keep=None))
    assert unequal(expected, gradients(moe(keep=keep))) == []


class _RoutingBytes(TorchDispatchMode):
    """Sums the bytes of every data-dependent op's tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_data_dependent(func, args):
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _live_bytes_after_forward(model: nn.Module) -> int:
    """The bytes of the distinct storages of every tensor Python holds after a forward (the guard's kept outputs among
    them), counted from the garbage collector's objects: the guard makes its copies below every dispatch mode."""
    gc.collect()
    before = _python_tensor_storages()
    out = model(tokens()[0])
    gc.collect()
    after = _python_tensor_storages()
    del out
    return sum(size for storage, size in after.items() if storage not in before)


def _python_tensor_storages() -> dict[int, int]:
    storages = {}
    for candidate in gc.get_objects():
        # Plain tensors only: fake tensors an earlier compiled test left behind have no memory to read.
        if type(candidate) is torch.Tensor and not candidate.is_meta and candidate.layout == torch.strided:
            storage = candidate.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def test_the_guard_keeps_no_more_memory_than_the_routing_outputs() -> None:
    with _RoutingBytes() as routing:
        moe(keep=None)(tokens()[0])
    plain = _live_bytes_after_forward(moe(keep=False))
    guarded = _live_bytes_after_forward(moe(keep=True))
    assert 0 < guarded - plain <= routing.bytes


class _SortingBlock(nn.Module):
    """Sorts a hidden layer four times as wide as its input (too large to keep) and routes by a small top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ordered, _ = self.up(x).sort(dim=-1)
        _, chosen = x.topk(2, dim=-1)
        return x + self.down(ordered[:, :DIM]) * chosen.float().mean()


def test_floating_outputs_larger_than_the_region_input_are_recomputed_and_listed_so() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_SortingBlock(), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    report = mse_check(model, attribution=True)
    assert report.grad_divergence == 0.0
    assert report.regions[0].data_dependent_ops == {"aten.sort.default": False, "aten.topk.default": True}


class _GatherAndMaskBlock(nn.Module):
    """Gathers rows by integer indices and selects rows by a boolean mask: both calls are ``aten.index.Tensor``,
    and only the mask's is data-dependent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        return hidden[rows].square().sum() + (3 * hidden[mask]).sum()


@pytest.mark.parametrize("masked_rows", [3, 2], ids=["same-shape", "other-shape"])
def test_an_integer_index_is_not_served_a_kept_boolean_masks_rows(masked_rows: int) -> None:
    x, _ = tokens(8)
    rows = torch.tensor([0, 1, 2])
    mask = torch.arange(8) >= 8 - masked_rows
    grads = []
    for keep in (None, True):
        torch.manual_seed(0)
        block = _GatherAndMaskBlock()
        if keep is not None:
            checkpoint_module(block, "block", CheckpointingConfig(names=["block"], keep_data_dependent=keep))
        block(x, rows, mask).backward()
        grads.append(block.linear.weight.grad)
    assert torch.equal(grads[0], grads[1])


# The drifting router: ties broken one way in the forward, the other way in recomputation.


def test_with_the_guard_a_drifting_router_keeps_its_routing_and_differs_by_ulps_only() -> None:
    model = moe(drifting=True)
    wrappers = [module.forward for module in checkpointed_modules(model).values()]
    assert [wrapper.data_dependent for wrapper in wrappers] == [None, None]
    report = mse_check(model, attribution=True)
    # The check's checkpointed pass was each region's first checkpointed forward: already guarded.
    assert [wrapper.data_dependent for wrapper in wrappers] == [True, True]
    assert report.error is None
    assert 0.0 < report.grad_divergence < 1e-5
    for region in report.regions:
        assert region.cause == "nondeterministic_kernel"
        assert region.first_divergent_op == ("lckd_examples.recompute_drift.default", 8)
        assert region.data_dependent_ops == {"aten.topk.default": True, "aten.nonzero.default": True}
        assert "keep_data_dependent" not in (region.hint or "")


class _TupleCalled(nn.Module):
    """Calls its drifting MoE block on the first tensor of a tuple: the region's input comes nested."""

    def __init__(self) -> None:
        super().__init__()
        self.block = DriftingRouterMoEBlock(DIM)

    def forward(self, inputs: tuple[torch.Tensor]) -> torch.Tensor:
        return self.block(inputs[0])


def test_a_region_given_its_tokens_in_a_tuple_keeps_its_routing() -> None:
    # The size rule's limit read top-level tensors only: 0 here, so `topk` was recomputed, its routing flipped under
    # drift, and the hint blamed the op's size (32 floating values against 1,024 input elements).
    x, y = tokens()
    torch.manual_seed(0)
    model = nn.ModuleList([_TupleCalled(), nn.Linear(DIM, 1)])
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    report = check_recomputation(model, lambda: F.mse_loss(model[1](model[0]((x,))), y), attribution=True)
    assert report.error is None
    assert 0.0 < report.grad_divergence < 1e-5  # the drift's ulps, no routing flip
    assert report.regions[0].data_dependent_ops == {"aten.topk.default": True, "aten.nonzero.default": True}


class _OutFormRouter(nn.Module):
    """Routes each token to one expert with `torch.argmax(..., out=index)` into a preallocated tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        index = torch.zeros(x.shape[0], 1, dtype=torch.long)
        torch.argmax(logits.detach(), dim=-1, keepdim=True, out=index)
        return x * logits.softmax(-1).gather(-1, index)


def test_an_out_form_of_a_routing_op_is_served_into_its_out_tensor() -> None:
    # The guard served a copy of the kept output in place of running the op, so the `out` tensor kept its zeros in
    # recomputation: gradients off the plain twin's by up to 0.2, with the guard on by default.
    x, y = tokens()
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(_OutFormRouter(), nn.Linear(DIM, 1))
        if checkpointed:
            apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
        grads.append(gradients_of(model, x, y))
    assert unequal(*grads) == []
    assert model[0].forward.data_dependent is True  # the guard ran, and served the argmax


def test_without_the_guard_the_routing_flips_and_attribution_names_the_region() -> None:
    report = mse_check(moe(drifting=True, keep=False), attribution=True)
    assert report.diverged
    # Tokens went to other experts: torch's metadata error, or a routing-sized difference of the gradients.
    assert (report.error or "").startswith("CheckpointError") or report.grad_divergence > 1e-3
    named = [region for region in report.regions if region.cause is not None]
    assert [region.name for region in named] == ["blocks.1"]
    assert named[0].cause == "nondeterministic_kernel"
    # The report's hint writes the setting as Python does; a YAML-driven run shows it as YAML does.
    assert named[0].hint is not None and "`keep_data_dependent=True` in the `CheckpointingConfig`" in named[0].hint
    assert "`keep_data_dependent: true` under `trainer.strategy.init_args.checkpointing`" in respelt(
        named[0].hint, "yaml"
    )
    assert named[0].data_dependent_ops == {"aten.topk.default": False, "aten.nonzero.default": False}


@pytest.mark.parametrize("twice", ["gradient_penalty", "retain_graph"])
def test_a_guarded_region_recomputed_twice_keeps_its_routing(twice: str) -> None:
    assert unequal(gradients(moe(keep=None), twice), gradients(moe(keep=True), twice)) == []
    # Both recomputations of the drifting router get the forward's routing; without the guard they would not.
    drifting = largest_difference(gradients(moe(drifting=True, keep=None), twice), gradients(moe(drifting=True), twice))
    assert drifting < 1e-5


def _backward_ops(model: nn.Module) -> Counter[str]:
    x, y = tokens()
    loss = F.mse_loss(model(x), y)
    with OpCounter() as ops:
        loss.backward()
    return ops.counts


def test_the_guard_and_save_ops_keep_the_union_of_both() -> None:
    plain = _backward_ops(moe(keep=False))
    both = _backward_ops(moe(keep=True, save_ops=["aten.addmm"]))
    assert (plain["aten.topk"], plain["aten.nonzero"]) == (2, 8)
    assert (both["aten.topk"], both["aten.nonzero"]) == (0, 0)
    # The router has no bias: its matmul is an mm, recomputed; the experts' addmm are saved.
    assert plain["aten.addmm"] > both["aten.addmm"] == 0
    assert both["aten.mm"] > 0


def test_the_guard_is_absent_without_checkpointing() -> None:
    model = moe()
    wrappers = [module.forward for module in checkpointed_modules(model).values()]
    x, y = tokens()
    for plainly in (checkpointing_disabled, reference_pass):
        with plainly(), OpCounter() as ops:
            F.mse_loss(model(x), y).backward()
        # The regions ran their plain forward: nothing recomputed, nothing kept, nothing decided.
        assert ops.counts["aten.topk"] == 2
        assert [wrapper.data_dependent for wrapper in wrappers] == [None, None]


def test_a_region_without_data_dependent_ops_runs_without_the_guard_after_its_first_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MoEBlock(DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0", "1"]))
    gradients(model)
    assert [module.forward.data_dependent for module in checkpointed_modules(model).values()] == [True, False]


# The shipped MoE configs.


@pytest.fixture
def _no_exported_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI seeds through `seed_everything`, which exports the seed to the environment.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


@pytest.mark.usefixtures("_no_exported_seed")
def test_the_moe_config_audits_clean_and_lists_what_it_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--config", str(CONFIGS / "moe_blocks.yaml")]) == 0
    out = capsys.readouterr().out
    for block in BLOCKS:
        assert f"data-dependent ops in {block}: aten.topk.default (kept), aten.nonzero.default (kept)" in out
    assert out.splitlines()[-1] == "result: none of the 2 checkpointed regions diverged"


@pytest.mark.usefixtures("_no_exported_seed")
def test_the_broken_routing_config_flips_and_its_audit_says_what_keeps_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = CONFIGS / "broken_routing.yaml"
    lines = path.read_text().splitlines()
    assert lines[0] == "# python -m lightning_ckpt_determinism audit --config examples/configs/broken_routing.yaml"
    assert lines[2].startswith("# Broken ")
    report = tmp_path / "routing.json"
    assert main(["audit", "--config", str(path), "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "result: 1 of 2 checkpointed regions diverged: blocks.1"
    assert "error: CheckpointError: torch.utils.checkpoint: Recomputed values" in out
    regions = json.loads(report.read_text())["regions"]
    assert [(region["name"], region["verdict"], region["cause"]) for region in regions] == [
        ("blocks.0", "unchecked", None),
        ("blocks.1", "diverged", "nondeterministic_kernel"),
    ]
    assert "`keep_data_dependent: true` under `trainer.strategy.init_args.checkpointing`" in regions[1]["hint"]
    assert regions[1]["data_dependent_ops"] == {"aten.topk.default": False, "aten.nonzero.default": False}


@pytest.mark.usefixtures("_no_exported_seed")
def test_the_moe_config_trains_with_the_monitor_at_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("sys.argv", ["examples/train.py"])
    argv = [
        "fit",
        "--config",
        str(CONFIGS / "moe_blocks.yaml"),
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
    ]
    cli = train.main(argv)
    assert cli.trainer.global_step == 2
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RecomputationMonitor)]
    # The monitor checks the first step of the fit.
    assert monitor.last_report is not None
    assert (monitor.last_report.grad_divergence, monitor.last_report.diverged) == (0.0, False)


# torch.compile, with the dynamo settings MoE code needs.


@pytest.fixture
def moe_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        yield
    torch._dynamo.reset()


def _compiled_step(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """One step of ``model`` compiled with ``aot_eager``: its gradients, the graph breaks dynamo counted and the
    ``topk`` calls in its compiled backward graphs (the router's, when recomputation runs it again)."""
    torch._dynamo.reset()
    counters.clear()
    topk_in_backward = 0

    def backward(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        nonlocal topk_in_backward
        topk_in_backward += sum(node.target is aten.topk.default for node in graph.graph.nodes)
        return boxed_nop(graph, inputs)

    grads = gradients(torch.compile(model, backend=partial(aot_eager, bw_compiler=backward)))
    return grads, sum(counters["graph_break"].values()), topk_in_backward


@pytest.mark.usefixtures("moe_dynamo")
def test_compiled_the_guard_saves_the_routing_with_no_more_graph_breaks() -> None:
    expected, plain_breaks, _ = _compiled_step(moe(drifting=True, keep=None, blocks=1))
    kept, kept_breaks, kept_topk = _compiled_step(moe(drifting=True, blocks=1))
    assert kept_breaks == plain_breaks
    # The router's top-k is saved (`MUST_SAVE`), not recomputed: the drift changes the gradients by ulps only.
    assert kept_topk == 0
    assert largest_difference(expected, kept) < 1e-5
    _, _, recomputed_topk = _compiled_step(moe(keep=False, blocks=1))
    assert recomputed_topk == 1


class _TupleFeeding(nn.Module):
    """Hands its tokens to a :class:`_TupleCalled` region inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.region = _TupleCalled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.region((x,))


@pytest.mark.usefixtures("moe_dynamo")
def test_compiled_a_region_given_its_tokens_in_a_tuple_keeps_its_routing() -> None:
    # The compiled size rule read top-level inputs only: its limit was 0 here, so the router's `topk` was recomputed.
    torch.manual_seed(0)
    model = nn.Sequential(_TupleFeeding(), nn.Linear(DIM, 1))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0.region"]))
    expected, _, _ = _compiled_step(plain)
    kept, _, kept_topk = _compiled_step(model)
    assert kept_topk == 0
    assert largest_difference(expected, kept) < 1e-5


def test_recomputation_reads_the_forwards_item() -> None:
    seen: list[int] = []

    class _CountingBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(DIM, DIM)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(int(self.steps))
            self.steps.add_(1)
            return x + torch.tanh(self.linear(x))

    model = nn.Sequential(_CountingBlock(), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], protect_buffers=False))
    gradients(model)
    # The counter was 1 when the region was recomputed; `.item()` is served the forward's 0.
    assert seen == [0, 0]


class WarmupRouterBlock(DriftingRouterMoEBlock):
    """A drifting router that is dense for its first step (every expert, weighted by the router), top-k after."""

    dense = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dense:
            return super().forward(x)
        tokens = self.norm(x)
        weights = self.router_logits(tokens).softmax(-1)
        return x + sum(weights[:, index, None] * expert(tokens) for index, expert in enumerate(self.experts))


def test_a_region_that_routes_only_after_its_first_step_is_guarded_once_a_check_sees_it_route() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(WarmupRouterBlock(DIM), WarmupRouterBlock(DIM), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["WarmupRouterBlock"]))
    x, y = tokens()
    F.mse_loss(model(x), y).backward()  # the dense first step: no data-dependent op, so no guard
    for block in model[:2]:
        block.dense = False
    assert [block.forward.data_dependent for block in model[:2]] == [False, False]
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert report.diverged
    hints = [region.hint or "" for region in report.regions]
    assert any("`keep_data_dependent` is on, but this region's first checkpointed forward" in hint for hint in hints)
    # The check saw the regions route: their guard is on from now on, and the drifting router keeps its routing.
    assert [block.forward.data_dependent for block in model[:2]] == [True, True]
    guarded = check_recomputation(model, lambda: F.mse_loss(model(x), y))
    assert guarded.error is None and guarded.grad_divergence < 1e-5


class TopRowsRouter(nn.Module):
    """Sends the rows whose score is positive through its expert (`nonzero`: a data-dependent op)."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.expert = nn.Linear(DIM, 1), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (self.score(x).squeeze(1) > 0).nonzero().squeeze(1)
        return x.index_add(0, rows, self.expert(x[rows]))


def test_a_router_swapped_into_a_region_after_its_first_call_keeps_its_routing_as_one_there_from_the_start() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PartsBlock(DIM))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    model(torch.randn(6, DIM, requires_grad=True)).sum().backward()  # the region learns it does not route
    model[0].parts[1] = TopRowsRouter()
    for seed in range(2):
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        loss = model(x).square().mean()
        with OpCounter() as ops:
            loss.backward()
        assert ops.counts["aten.nonzero"] == 0, seed  # kept from the forward, never routed again in backward
