"""Each entry of ``_torch_compat`` pinned to what the package relies on, on real torch objects of the installed torch.

A torch upgrade that changes one of these private APIs fails here, by name, before it fails somewhere downstream.
Every entry of the module's ``__all__`` has a test (``@pins``), and every entry names the torch versions it exists in.
"""

import ast
import functools
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils.checkpoint import (
    CheckpointError,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_debug_enabled,
)

from lightning_ckpt_determinism import _torch_compat as compat
from tests.helpers import fsdp1_unit_on_the_cpu, one_process_group

COMPAT_SOURCE = Path(compat.__file__)
PINNED: set[str] = set()


def pins(*entries: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a test as the one pinning ``entries`` of ``_torch_compat``."""

    def mark(test: Callable[..., None]) -> Callable[..., None]:
        PINNED.update(entries)
        return test

    return mark


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Compile from scratch, so that no other test's cache entries or recompile count decide what runs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def registered_check() -> Iterator[Callable[[Callable[[torch.Tensor], Any]], str]]:
    """Register a ``determinism_check`` extractor under a test-only name, removed afterwards."""
    name = "test_torch_compat_check"

    def register(extractor: Callable[[torch.Tensor], Any]) -> str:
        compat.determinism_checks()[name] = extractor
        return name

    yield register
    compat.determinism_checks().pop(name, None)


class _RecordingMode(compat.TorchDispatchMode):
    """Records each call a dispatch mode receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def ops(self) -> list[str]:
        return [str(func) for func, _, _ in self.calls]


class _Block(nn.Module):
    """A module of the tests' own: on 2.13 ``nn.Linear(...).compile()`` compiles nothing at its call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def _recording_backend(calls: list[str], name: str) -> Callable[..., Any]:
    """A dynamo backend that runs the graph as traced and records its name at each compile."""

    def backend(graph: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        calls.append(name)
        return graph.forward

    return backend


@pins("TorchDispatchMode", "OpOverload", "OpOverloadPacket")
def test_a_dispatch_mode_receives_op_overloads_with_their_packet_tags_and_schema() -> None:
    x = torch.ones(2, 2)
    with _RecordingMode() as mode:
        torch.mm(x, x)
    [(func, args, kwargs)] = mode.calls
    assert isinstance(func, compat.OpOverload)
    assert func is torch.ops.aten.mm.default
    assert repr(func) == "<OpOverload(op='aten.mm', overload='default')>"  # the doctest of `resolve_ops` shows it
    assert isinstance(func.overloadpacket, compat.OpOverloadPacket)
    assert str(func.overloadpacket) == "aten.mm"
    assert func.overloadpacket.__name__ == "mm"
    assert [argument.name for argument in func._schema.arguments] == ["self", "mat2"]
    assert args == (x, x) and kwargs == {}
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.bernoulli.p.tags
    assert torch.Tag.nondeterministic_seeded not in func.tags
    packet = torch.ops.aten.addmm
    assert isinstance(packet, compat.OpOverloadPacket)
    assert "default" in packet.overloads()
    assert packet.default is torch.ops.aten.addmm.default


@pins("RECORD_FUNCTION_ENTER", "RECORD_FUNCTION_EXIT")
def test_a_dispatch_mode_sees_a_record_function_scope_open_with_its_name_and_close() -> None:
    with _RecordingMode() as mode, torch.profiler.record_function("FSDP::pre_forward"):
        torch.ones(1)
    [enter, ones, close] = mode.calls
    assert (enter[0], enter[1]) == (compat.RECORD_FUNCTION_ENTER, ("FSDP::pre_forward",))
    assert ones[0] is torch.ops.aten.ones.default
    assert close[0] is compat.RECORD_FUNCTION_EXIT


@pins("written_tensors")
def test_written_tensors_are_the_arguments_the_schema_marks_written() -> None:
    a, b, out = torch.ones(2), torch.ones(2), torch.empty(2)
    with _RecordingMode() as mode:
        torch.add(a, b)
        a.add_(b)
        torch.add(a, b, out=out)
        torch._foreach_add_([a, b], 1.0)
    written = [compat.written_tensors(func, args, kwargs) for func, args, kwargs in mode.calls]
    assert mode.ops() == ["aten.add.Tensor", "aten.add_.Tensor", "aten.add.out", "aten._foreach_add_.Scalar"]
    assert [[id(tensor) for tensor in tensors] for tensors in written] == [[], [id(a)], [id(out)], [id(a), id(b)]]


@pins("returned_views")
def test_returned_views_are_the_returns_the_schema_marks_aliased_and_not_written() -> None:
    aten = torch.ops.aten
    assert compat.returned_views(aten.view.default) == [True]
    assert compat.returned_views(aten.split.Tensor) == [True]  # one list return
    assert compat.returned_views(aten.add.Tensor) == [False]
    assert compat.returned_views(aten.add_.Tensor) == [False]  # aliased, but written: not a view
    assert compat.returned_views(aten.max.dim) == [False, False]


@pins("in_place_overload")
def test_an_in_place_overload_writes_a_positional_tensor_and_returns_only_what_it_wrote() -> None:
    aten = torch.ops.aten
    assert compat.in_place_overload(aten.relu_.default)
    assert compat.in_place_overload(aten._foreach_mul_.Scalar)  # writes a list of tensors, returns nothing
    assert compat.in_place_overload(aten._fused_moving_avg_obs_fq_helper.default) is False  # returns new tensors
    assert compat.in_place_overload(aten.add_.t) is None  # writes an int list
    assert compat.in_place_overload(aten.topk.values) is None  # an `out=` form: keyword-only `out` tensors
    assert compat.in_place_overload(aten.div.out_mode) is None
    assert compat.in_place_overload(aten.relu.default) is None


@pins("writes_its_arguments")
def test_writes_its_arguments_is_an_in_place_or_out_op_by_its_schema() -> None:
    aten = torch.ops.aten
    assert compat.writes_its_arguments(aten.add_.Tensor)
    assert compat.writes_its_arguments(aten.add.out)
    assert compat.writes_its_arguments(aten.bernoulli_.float)
    assert not compat.writes_its_arguments(aten.add.Tensor)
    assert not compat.writes_its_arguments(aten.view.default)
    assert not compat.writes_its_arguments(aten.native_dropout.default)


@pins("returns_what_it_wrote")
def test_returns_what_it_wrote_is_an_out_or_in_place_form_by_its_schema() -> None:
    aten = torch.ops.aten
    assert compat.returns_what_it_wrote(aten.mm.out)
    assert compat.returns_what_it_wrote(aten.sort.values)  # keyword-only `values` and `indices`, returned
    assert compat.returns_what_it_wrote(aten.relu_.default)
    assert compat.returns_what_it_wrote(aten._foreach_mul_.Scalar)  # writes a list of tensors, returns nothing
    assert not compat.returns_what_it_wrote(aten._fused_moving_avg_obs_fq_helper.default)  # returns new tensors
    assert not compat.returns_what_it_wrote(aten.mm.default)


@pins("returns_alias")
def test_returns_alias_is_any_return_the_schema_marks_aliased_written_or_not() -> None:
    aten = torch.ops.aten
    assert compat.returns_alias(aten.view.default)
    assert compat.returns_alias(aten.t.default)
    assert compat.returns_alias(aten.add_.Tensor)
    assert compat.returns_alias(aten.add.out)
    assert not compat.returns_alias(aten.add.Tensor)
    assert not compat.returns_alias(aten.native_layer_norm.default)


@pins("current_graph_task_id")
def test_the_graph_task_id_is_minus_one_outside_backward_and_one_per_backward_inside() -> None:
    x = torch.ones(2, requires_grad=True)
    inside: list[int] = []
    for _ in range(2):
        y = x * 2
        y.register_hook(lambda grad: inside.append(compat.current_graph_task_id()))
        y.sum().backward()
    assert compat.current_graph_task_id() == -1
    assert len(inside) == 2 and min(inside) >= 0
    assert inside[0] != inside[1]
    # A backward run inside a forward (a gradient penalty) has an id of its own while it runs.
    y = x * 3
    y.register_hook(lambda grad: inside.append(compat.current_graph_task_id()))
    torch.autograd.grad(y.sum(), x, create_graph=True)
    assert inside[2] >= 0 and inside[2] not in inside[:2]
    assert compat.current_graph_task_id() == -1


@pins("autograd_nodes_made")
def test_the_nodes_made_count_each_op_recorded_for_backward_and_nothing_else() -> None:
    x = torch.ones(2, requires_grad=True)
    start = compat.autograd_nodes_made()
    y = torch.tanh(x * 2).sum()
    assert compat.autograd_nodes_made() - start == 3  # mul, tanh, sum
    start = compat.autograd_nodes_made()
    with torch.no_grad():
        _ = torch.tanh(x * 2)
    _ = torch.ones(2) * 2  # no tensor that requires a gradient
    y.backward()
    assert compat.autograd_nodes_made() - start == 0


@pins("waited")
def test_a_collective_result_not_waited_for_is_waited_for_once_and_read_as_its_inner_tensor() -> None:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    values = torch.arange(3.0)
    pending = AsyncCollectiveTensor(values)
    assert not pending.completed
    done = compat.waited(pending)
    assert type(done) is torch.Tensor and done.tolist() == [0.0, 1.0, 2.0]
    assert pending.completed and compat.waited(pending) is values  # waited for once
    assert compat.waited(values) is values


@pins("checkpoint_saved_counter")
def test_the_saved_counter_counts_each_tensor_a_checkpointed_forward_saves_and_nothing_outside() -> None:
    counts: list[tuple[int, int] | None] = []
    found: list[bool] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        counter = compat.checkpoint_saved_counter()
        found.append(counter is not None)
        start = None if counter is None else counter()
        hidden = x.sin()  # saves x
        with torch.no_grad():
            x.cos()  # saves nothing
        out = hidden.exp() * x  # saves exp's output, then both factors of the product
        counts.append(None if counter is None or start is None else (start, counter()))
        return out

    x = torch.ones(3, requires_grad=True)
    assert compat.checkpoint_saved_counter() is None  # outside any checkpoint
    out = checkpoint(forward, x, use_reentrant=False)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.checkpoint_saved_counter() is None  # the hook on top is not a checkpoint's
    out.sum().backward()
    # The forward counted 4; its recomputation runs under torch's recomputation hook, which is no checkpoint's (and
    # stops early, after the fourth tensor).
    assert counts == [(0, 4)]
    assert found == [True, False]
    assert torch.allclose(x.grad, x.sin().exp() * (x.cos() * x + 1))


@pins("determinism_checks")
def test_the_registry_is_where_torchs_checkpoint_looks_up_a_determinism_check_name(registered_check: Any) -> None:
    seen: list[tuple[int, bool, int]] = []

    def extractor(tensor: torch.Tensor) -> int:
        seen.append((tensor.numel(), torch.is_grad_enabled(), compat.current_graph_task_id()))
        return len(seen)  # a value the recomputation never gives back: torch must say so

    name = registered_check(extractor)
    x = torch.ones(3, requires_grad=True)
    out = checkpoint(torch.sin, x, use_reentrant=False, determinism_check=name)
    assert seen == [(3, False, -1)]  # the forward's saved tensor, under no_grad, outside any backward
    with pytest.raises(CheckpointError, match="have different metadata than during the forward pass"):
        out.sum().backward()
    assert seen[1][:2] == (3, False) and seen[1][2] >= 0  # the recomputed tensor, inside the backward
    assert "default" in compat.determinism_checks() and "none" in compat.determinism_checks()


@pins("SAVED_VALUE_COMPARED_ON_THE_LEFT")
def test_torch_compares_with_the_value_kept_at_the_forward_on_the_left(registered_check: Any) -> None:
    ran: list[tuple[str, str]] = []

    class Side:
        def __init__(self, name: str) -> None:
            self.name = name

        def __ne__(self, other: object) -> bool:
            ran.append((self.name, other.name if isinstance(other, Side) else repr(other)))
            return False

        def __eq__(self, other: object) -> bool:
            return not self.__ne__(other)

        __hash__ = None  # type: ignore[assignment]

    phase = ["saved"]
    name = registered_check(lambda tensor: Side(phase[0]))
    x = torch.ones(3, requires_grad=True)
    out = checkpoint(torch.sin, x, use_reentrant=False, determinism_check=name)
    phase[0] = "recomputed"
    out.sum().backward()
    assert compat.SAVED_VALUE_COMPARED_ON_THE_LEFT is True
    assert ran == [("saved", "recomputed")]
    assert torch.equal(x.grad, torch.ones(3).cos())


@pins("StopRecomputationError")
def test_the_early_stop_is_raised_inside_recomputation_once_every_saved_tensor_is_back() -> None:
    caught: list[str] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        first = x.sin()  # saves x
        try:
            second = first.cos()  # saves `first`: the last saved tensor
        except compat.StopRecomputationError:
            caught.append("stopped")
            raise
        return second * 2

    x = torch.ones(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert caught == ["stopped"]
    assert issubclass(compat.StopRecomputationError, Exception)
    assert torch.allclose(x.grad, -2 * torch.ones(3).sin().sin() * torch.ones(3).cos())


@pins("disable_current_modes", "below_current_modes", "no_python_dispatch")
@pytest.mark.parametrize("switch", ["disable_current_modes", "below_current_modes", "no_python_dispatch"])
def test_ops_under_a_switch_skip_the_active_mode_the_mode_comes_back_and_without_one_they_run_as_they_are(
    switch: str,
) -> None:
    x = torch.ones(2)
    with _RecordingMode() as mode:
        x.sin()
        with getattr(compat, switch)():
            x.cos()
        x.exp()
    assert mode.ops() == ["aten.sin.default", "aten.exp.default"]
    with getattr(compat, switch)():
        assert torch.equal(x.cos(), torch.ones(2).cos())


@pins("statically_known_true")
def test_statically_known_true_holds_only_for_comparisons_true_for_every_size() -> None:
    size = ShapeEnv().create_unbacked_symint()
    assert compat.statically_known_true(3 <= 4) is True
    assert compat.statically_known_true(5 <= 4) is False
    assert compat.statically_known_true(size <= size) is True
    assert compat.statically_known_true(size <= 4) is False  # an output of unknown size does not fit


@pins("tree_leaves", "tree_map")
def test_pytree_helpers_walk_nested_outputs_in_order_and_keep_their_structure() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    nested = (a, [b, 3], {"c": c})
    assert [id(leaf) for leaf in compat.tree_leaves(nested)][:2] == [id(a), id(b)]
    assert compat.tree_leaves(nested)[2:] == [3, c]
    mapped = compat.tree_map(lambda leaf: leaf + 1 if isinstance(leaf, torch.Tensor) else leaf, nested)
    assert isinstance(mapped, tuple) and isinstance(mapped[1], list) and isinstance(mapped[2], dict)
    assert [float(mapped[0]), float(mapped[1][0]), mapped[1][1], float(mapped[2]["c"])] == [1.0, 2.0, 3, 3.0]


@pins("checkpoint_debug_enabled")
def test_checkpoint_debug_mode_is_read_globally_and_then_refuses_a_context_fn() -> None:
    x = torch.ones(2, requires_grad=True)
    assert compat.checkpoint_debug_enabled() is False
    with set_checkpoint_debug_enabled(True):
        assert compat.checkpoint_debug_enabled() is True
        with pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
            checkpoint(torch.sin, x, use_reentrant=False, context_fn=lambda: (nullcontext(), nullcontext()))
    assert compat.checkpoint_debug_enabled() is False


@pins("reentrant_backward_code")
def test_the_reentrant_backward_code_runs_the_function_again_with_grad_enabled() -> None:
    code = compat.reentrant_backward_code()
    seen: list[tuple[bool, bool]] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        frame: FrameType | None = sys._getframe()
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        seen.append((frame is not None, torch.is_grad_enabled()))
        return x.sin()

    checkpoint(region, torch.ones(2, requires_grad=True), use_reentrant=True).sum().backward()
    # Its forward runs the function under no_grad; its backward, again, with grad enabled.
    assert seen == [(False, False), (True, True)]


@pins("checkpoint_codes")
def test_checkpoint_codes_find_each_kind_of_checkpoint_call() -> None:
    codes = compat.checkpoint_codes()
    assert len(codes) == 3

    def above(frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code in codes:
                return True
            frame = frame.f_back
        return False

    found: list[bool] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        found.append(above(sys._getframe()))
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    checkpoint(region, x, use_reentrant=False)
    checkpoint(region, x, use_reentrant=True)
    region(x)
    assert found == [True, True, False]

    # The composable `checkpoint(module)` enters the non-reentrant generator from a hook: seen at its call.
    module = composable_checkpoint(nn.Linear(2, 2))
    entered: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            entered.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        module(x)
    finally:
        sys.setprofile(None)
    assert entered == {"_checkpoint_without_reentrant_generator"}


@pins("functorch_config")
def test_the_functorch_config_holds_the_partitioner_settings_and_patches_them_for_a_block() -> None:
    config = compat.functorch_config
    # Defaults may come from the environment (`TORCHINDUCTOR_AUTOGRAD_CACHE`): the block puts back whatever was set.
    before = (config.activation_memory_budget, config.enable_autograd_cache)
    assert isinstance(before[0], float) and isinstance(before[1], bool)
    with config.patch(activation_memory_budget=0.5, enable_autograd_cache=False):
        assert (config.activation_memory_budget, config.enable_autograd_cache) == (0.5, False)
    assert (config.activation_memory_budget, config.enable_autograd_cache) == before


@pins("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state")
def test_rng_functionalization_saves_a_state_and_replays_it_from_where_the_scan_reads_it() -> None:
    rand = torch.ops.aten.rand.default
    state, drawn = compat.run_and_save_rng_state(rand, [4], device=torch.device("cpu"))
    assert torch.equal(compat.run_with_rng_state(state, rand, [4], device=torch.device("cpu")), drawn)

    def replay(x: torch.Tensor) -> torch.Tensor:
        saved, _ = compat.run_and_save_rng_state(rand, [4], device=x.device)
        return compat.run_with_rng_state(saved, rand, [4], device=x.device)

    def graphsafe(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return compat.graphsafe_run_with_rng_state(rand, [4], device=x.device, rng_state=state)

    nodes = {node.target: node for node in make_fx(replay)(torch.ones(1)).graph.nodes}
    graph = make_fx(graphsafe, tracing_mode="fake")(torch.ones(1), torch.get_rng_state()).graph
    state_placeholder = [node for node in graph.nodes if node.op == "placeholder"][1]
    # The graph scan reads the state a replaying op draws from here.
    assert nodes[compat.run_with_rng_state].args[0].args == (nodes[compat.run_and_save_rng_state], 0)
    [graphsafe_node] = [node for node in graph.nodes if node.target is compat.graphsafe_run_with_rng_state]
    assert graphsafe_node.kwargs["rng_state"] is state_placeholder


@pins(
    "OptimizedModule",
    "OptimizeContext",
    "innermost_backend",
    "compiled_inner",
    "dynamo_context",
    "dynamo_context_key",
    "set_dynamo_context",
    "compile_options",
)
def test_a_compiled_module_carries_its_original_module_and_a_context_naming_its_backend(fresh_dynamo: None) -> None:
    calls: list[str] = []
    first, second = _recording_backend(calls, "first"), _recording_backend(calls, "second")
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend=first, fullgraph=True)
    assert isinstance(compiled, compat.OptimizedModule)
    assert compat.compiled_inner(compiled) is model
    context = compat.dynamo_context(compiled)
    assert isinstance(context, compat.OptimizeContext)
    assert compat.dynamo_context_key(compiled) is context
    assert compat.dynamo_context_key(model) is model
    assert compat.dynamo_context(model) is None
    assert compat.compile_options(context) == (True, None)
    assert compat.compile_options(compat.dynamo_context(torch.compile(model, backend=first, dynamic=False))) == (
        False,
        False,
    )
    assert compat.innermost_backend(context.callback).compiler_fn is first
    x = torch.ones(1, 2)
    compiled(x)
    # The graph scan swaps the context of a compiled module: its next call compiles anew, and swapping back reuses
    # what the first context compiled.
    compat.set_dynamo_context(compiled, compat.dynamo_context_key(torch.compile(model, backend=second)))
    compiled(x)
    compat.set_dynamo_context(compiled, context)
    compiled(x)
    assert calls == ["first", "second"]


@pins("compiled_call", "set_compiled_call", "is_compiled_module", "module_call")
def test_module_compile_installs_a_compiled_call_that_the_module_runs_and_that_can_be_swapped(
    fresh_dynamo: None,
) -> None:
    calls: list[str] = []
    backend = _recording_backend(calls, "compiled")
    model = _Block()
    assert compat.compiled_call(model) is None
    assert compat.is_compiled_module(model) is False
    model.compile(backend=backend)
    call = compat.compiled_call(model)
    assert callable(call)
    assert compat.is_compiled_module(model) is True
    assert isinstance(compat.dynamo_context(call), compat.OptimizeContext)  # the graph scan reads it there
    assert compat.module_call(model)(torch.ones(1, 2)).shape == (1, 2)  # the uncompiled call: no backend runs
    x = torch.ones(1, 2)
    model(x)
    assert calls == ["compiled"]
    compat.set_compiled_call(model, lambda *args, **kwargs: "replaced")
    assert model(x) == "replaced"
    compat.set_compiled_call(model, call)
    assert compat.compiled_call(model) is call
    wrapper = torch.compile(nn.Linear(2, 2), backend=backend)
    assert compat.is_compiled_module(wrapper) is True
    assert compat.is_compiled_module(compat.compiled_inner(wrapper)) is False


@pins("aot_backends")
def test_aot_backends_are_the_ones_a_named_backend_resolves_to_and_take_a_backward_compiler(
    fresh_dynamo: None,
) -> None:
    aot_autograd, aot_eager, boxed_nop = compat.aot_backends()
    named = compat.innermost_backend(torch.compile(nn.Linear(2, 2), backend="aot_eager").dynamo_ctx.callback)
    assert named.compiler_fn is aot_eager
    partitioner = compat.innermost_backend(
        torch.compile(nn.Linear(2, 2), backend="aot_eager_default_partitioner").dynamo_ctx.callback
    )
    assert isinstance(partitioner.compiler_fn, aot_autograd)
    assert partitioner.compiler_fn.kwargs["fw_compiler"] is boxed_nop
    backward_graphs: list[fx.GraphModule] = []

    def scanned(graph: fx.GraphModule, example_inputs: list[Any]) -> Any:
        backward_graphs.append(graph)
        return boxed_nop(graph, example_inputs)

    x = torch.ones(3, requires_grad=True)
    compiled = torch.compile(lambda x: x.sin(), backend=functools.partial(aot_eager, bw_compiler=scanned))
    compiled(x).sum().backward()
    assert len(backward_graphs) == 1
    assert torch.equal(x.grad, torch.ones(3).cos())


@pins("inductor_compilers")
def test_inductor_compiles_through_an_inner_compile_told_which_graph_is_the_backward(fresh_dynamo: None) -> None:
    compile_fx, compile_fx_inner = compat.inductor_compilers()
    named = compat.innermost_backend(torch.compile(nn.Linear(2, 2), backend="inductor").dynamo_ctx.callback)
    assert named.compiler_name == "inductor"
    assert isinstance(named.config, dict)
    backward: list[bool] = []

    def inner_compile(graph: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        backward.append(kwargs.get("is_backward", False))
        return compile_fx_inner(graph, example_inputs, **kwargs)

    def backend(graph: fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(graph, list(example_inputs), inner_compile=inner_compile, config_patches=named.config)

    x = torch.ones(3, requires_grad=True)
    # A graph served from AOTAutograd's cache would skip the inner compile.
    with compat.functorch_config.patch(enable_autograd_cache=False):
        torch.compile(lambda x: x.sin(), backend=backend)(x).sum().backward()
    assert backward == [False, True]
    assert torch.allclose(x.grad, torch.ones(3).cos())


@pins("fsdp1_flat_parameters", "is_fsdp1_parameter_view")
def test_fsdp1_flat_parameters_are_one_per_unit_and_their_views_are_told_apart(tmp_path: Path) -> None:
    assert list(compat.fsdp1_flat_parameters(nn.Linear(2, 2))) == []
    with one_process_group(tmp_path):
        inner = fsdp1_unit_on_the_cpu(nn.Linear(2, 3))
        model = fsdp1_unit_on_the_cpu(nn.Sequential(inner, nn.Linear(3, 1)))
        flats = list(compat.fsdp1_flat_parameters(model))
        assert [flat.numel() for flat in flats] == [4, 9]  # the outer unit's Linear(3, 1), then Linear(2, 3)
        assert all(isinstance(flat, nn.Parameter) for flat in flats)
        # FSDP1 sets such views on the modules as their parameters inside its forward.
        assert compat.is_fsdp1_parameter_view(flats[1][:6].view(2, 3))
        assert not compat.is_fsdp1_parameter_view(flats[1])
        assert not compat.is_fsdp1_parameter_view(nn.Parameter(torch.ones(4))[:2])


@pins("comm_hook_states")
def test_comm_hook_states_are_those_registered_on_a_ddp_module(tmp_path: Path) -> None:
    assert compat.comm_hook_states(nn.Linear(2, 2)) == []
    with one_process_group(tmp_path):
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        assert compat.comm_hook_states(model) == []
        state = powerSGD_hook.PowerSGDState(process_group=None)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        assert compat.comm_hook_states(model) == [state]


@pins("hook_dicts", "hook_handles_made")
def test_hook_dicts_hold_every_kind_of_module_hook_by_its_handle_id() -> None:
    layer = nn.Linear(2, 2)
    assert len(compat.hook_dicts(vars(layer))) == 11 and not any(compat.hook_dicts(vars(layer)))
    made = compat.hook_handles_made()
    handles = [
        layer.register_forward_pre_hook(lambda *args: None),
        layer.register_forward_pre_hook(lambda *args, **kwargs: None, with_kwargs=True),
        layer.register_forward_hook(lambda *args: None, always_call=True),
        layer.register_full_backward_pre_hook(lambda *args: None),
        layer.register_full_backward_hook(lambda *args: None),
        layer.register_state_dict_post_hook(lambda *args: None),
        layer.register_state_dict_pre_hook(lambda *args: None),
        layer.register_load_state_dict_pre_hook(lambda *args: None),
        layer.register_load_state_dict_post_hook(lambda *args: None),
    ]
    assert [handle.id for handle in handles] == list(range(made, made + len(handles)))
    assert compat.hook_handles_made() == made + len(handles)
    held = {key for hooks in compat.hook_dicts(vars(layer)) for key in hooks}
    assert held == {handle.id for handle in handles}
    for handle in handles:
        handle.remove()
    assert not any(compat.hook_dicts(vars(layer)))


@pins("version_counter", "view_base", "own_buffers")
def test_version_counters_view_bases_and_own_buffers_are_what_torch_keeps() -> None:
    tensor = torch.zeros(3)
    assert compat.version_counter(tensor) == 0
    view = tensor[1:]
    view.add_(1)  # a write through a view bumps the counter both share
    assert compat.version_counter(tensor) == compat.version_counter(view) == 1
    assert compat.view_base(view) is tensor
    assert compat.view_base(tensor) is None
    norm = nn.BatchNorm1d(2)
    block = nn.Sequential(norm)
    assert list(compat.own_buffers(norm)) == ["running_mean", "running_var", "num_batches_tracked"]
    assert compat.own_buffers(block) == {}
    replacement = torch.ones(2)
    compat.own_buffers(norm)["running_mean"] = replacement  # the dict itself: the module reads the swap
    assert norm.running_mean is replacement


@pins("child_modules")
def test_child_modules_are_each_modules_registered_children_in_order() -> None:
    norm, linear = nn.BatchNorm1d(2), nn.Linear(2, 2)
    block = nn.Sequential(norm, linear)
    block.register_module("absent", None)
    assert compat.child_modules(map(vars, block.modules())) == (norm, linear, None)
    block[1] = replacement = nn.Linear(2, 2)
    assert compat.child_modules(map(vars, block.modules())) == (norm, replacement, None)


@pins("buffer_version_counter")
def test_an_inference_tensor_has_no_version_counter_and_reads_minus_one() -> None:
    with torch.inference_mode():
        cache = torch.zeros(3)
    with pytest.raises(RuntimeError, match="Inference tensors do not track version counter"):
        compat.version_counter(cache)
    assert compat.buffer_version_counter(cache) == -1
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        cache.add_(1)  # nothing outside inference mode writes it: its -1 stays true
    tensor = torch.zeros(3)
    tensor[1:].add_(1)
    assert compat.buffer_version_counter(tensor) == compat.version_counter(tensor) == 1


@pins("own_parameters")
def test_own_parameters_are_the_dict_getattr_reads() -> None:
    linear = nn.Linear(2, 2)
    assert list(compat.own_parameters(linear)) == ["weight", "bias"]
    assert compat.own_parameters(nn.Sequential(linear)) == {}
    replacement = nn.Parameter(torch.ones(2, 2))
    compat.own_parameters(linear)["weight"] = replacement  # the dict itself: the module reads the swap
    assert linear.weight is replacement


@pins("RECOMPILE_LOGGER", "hit_recompile_limit")
def test_dynamo_reports_a_recompile_limit_through_its_logger_in_the_text_matched(
    fresh_dynamo: None, caplog: pytest.LogCaptureFixture
) -> None:
    def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger=compat.RECOMPILE_LOGGER):
        for factor in (1.0, 2.0, 3.0):
            compiled(torch.ones(2), factor)
    records = [record for record in caplog.records if record.name == compat.RECOMPILE_LOGGER]
    assert records and compat.hit_recompile_limit(records[0].getMessage())
    assert not compat.hit_recompile_limit("skipping: frame has no tensors")


@pins("module_path_steps")
def test_module_paths_in_a_graphs_module_stack_split_into_attribute_index_and_key_steps(fresh_dynamo: None) -> None:
    paths: list[str] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        for node in graph.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                paths.append(str(list(stack.values())[-1][0]))
        return graph.forward

    model = nn.Sequential(nn.ModuleDict({"inner": nn.Linear(2, 2)}))
    model.forward = lambda x: model[0]["inner"](x)  # type: ignore[method-assign]
    torch.compile(model, backend=backend)(torch.ones(1, 2))
    steps = compat.module_path_steps(paths[0])
    assert steps is not None
    module: Any = model
    for attribute, index, key in steps:
        if attribute in ("_modules", "_parameters", "_buffers"):
            continue
        module = module[int(index)] if index else getattr(module, attribute or key)
    assert module is model[0]["inner"]
    assert compat.module_path_steps("G['weight']") is None


def _backward_error(forward_ops: int, recompute_ops: int, *, widen: bool = False) -> CheckpointError:
    """The ``CheckpointError`` torch raises when a checkpointed function recomputes otherwise than its forward ran."""
    calls = []

    def function(x: torch.Tensor) -> torch.Tensor:
        again = bool(calls)
        calls.append(None)
        if again and widen:
            x = torch.cat([x, x])
        for _ in range(recompute_ops if again else forward_ops):
            x = x.sin()
        return x

    x = torch.ones(3, requires_grad=True)
    out = checkpoint(function, x, use_reentrant=False)
    with pytest.raises(CheckpointError) as raised:
        out.sum().backward()
    return raised.value


@pins("is_metadata_mismatch")
def test_torchs_metadata_error_is_recognised() -> None:
    error = _backward_error(2, 2, widen=True)
    assert "different metadata" in str(error)
    assert compat.is_metadata_mismatch(error)


def test_torchs_other_checkpoint_error_and_other_errors_are_not() -> None:
    error = _backward_error(3, 1)
    assert "A different number of tensors was saved" in str(error)
    assert not compat.is_metadata_mismatch(error)
    assert not compat.is_metadata_mismatch(RuntimeError("different metadata"))


@pins("is_kept_output_mutation", "KEPT_OUTPUT_MUTATED")
def test_torchs_refusal_of_a_kept_output_written_in_place_is_recognised() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(x, x)
        return y.relu_().sum()

    contexts = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    x = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError) as raised:
        checkpoint(function, x, use_reentrant=False, context_fn=contexts).backward()
    assert str(raised.value).startswith(compat.KEPT_OUTPUT_MUTATED)
    assert compat.is_kept_output_mutation(raised.value)
    assert not compat.is_kept_output_mutation(ValueError(compat.KEPT_OUTPUT_MUTATED))


@pins("KeptOutputsServedAgain")
def test_selective_checkpointings_kept_outputs_are_served_to_a_second_backward_through_the_copy() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, x).tanh().sum()

    x = torch.randn(3, 3, requires_grad=True)
    function(x).backward(retain_graph=False)
    expected = x.grad.clone() * 2  # ground truth: two backwards without checkpointing
    for served_again in (False, True):
        x.grad = None
        forward, recompute = create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
        pair = (forward, compat.KeptOutputsServedAgain(recompute) if served_again else recompute)
        loss = checkpoint(function, x, use_reentrant=False, context_fn=lambda pair=pair: pair)
        loss.backward(retain_graph=True)
        if not served_again:  # torch's own context serves its cache once
            with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
                loss.backward()
            continue
        loss.backward()
        assert torch.equal(x.grad, expected)


@pins("random_only_through_dropout_p")
def test_an_op_random_through_its_dropout_p_alone_is_told_from_one_that_draws() -> None:
    aten = torch.ops.aten
    assert torch.Tag.nondeterministic_seeded in aten._scaled_dot_product_flash_attention_for_cpu.default.tags
    assert compat.random_only_through_dropout_p(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not compat.random_only_through_dropout_p(aten.bernoulli.default)
    assert not compat.random_only_through_dropout_p(aten.native_dropout.default)


@pins("at_backward_end")
def test_a_callback_queued_inside_a_backward_runs_once_it_has_ended() -> None:
    order: list[str] = []
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 3).sum()

    def reached(grad: torch.Tensor) -> None:
        order.append("reached")
        compat.at_backward_end(lambda: order.append(f"ended, grad {weight.grad.tolist()}"))

    loss.register_hook(reached)
    loss.backward()
    assert order == ["reached", "ended, grad [3.0, 3.0]"]
    loss = (weight * 3).sum()
    loss.backward()  # queued for one backward only
    assert order == ["reached", "ended, grad [3.0, 3.0]"]


def test_every_entry_has_a_test_pinned_to_it() -> None:
    assert sorted(set(compat.__all__) - PINNED) == []
    assert sorted(PINNED - set(compat.__all__)) == []


def _documentation(source: str) -> dict[str, str]:
    """What documents each name bound at the top of ``source``: a function's or class's docstring, the comment block
    above the statement (or above its group of statements without a blank line), the string after an assignment, and
    for an alias of an imported name, what documents that import."""
    lines = source.splitlines()
    body = ast.parse(source).body
    text: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for index, node in enumerate(body):
        above = []
        for line in reversed(lines[: node.lineno - 1]):
            if not line.strip():
                break
            if line.lstrip().startswith("#"):
                above.append(line)
        comment = "\n".join(reversed(above))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            text[node.name] = ast.get_docstring(node) or ""
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                text[alias.asname or alias.name] = comment
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if not isinstance(target, ast.Name):
                continue
            after = body[index + 1] if index + 1 < len(body) else None
            string = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            text[target.id] = f"{comment}\n{string}"
            if isinstance(node.value, ast.Name):
                aliases[target.id] = node.value.id
    for name, target in aliases.items():
        text[name] += "\n" + text.get(target, "")
    return text


def test_every_entry_names_the_torch_versions_it_exists_in() -> None:
    documentation = _documentation(COMPAT_SOURCE.read_text())
    versions = re.compile(r">= ?\d+\.\d+|checked on \d+\.\d+")
    assert [name for name in compat.__all__ if not versions.search(documentation.get(name, ""))] == []


@pins("saved_tensors_hooks_codes", "is_checkpoint_hooks")
def test_saved_tensor_hooks_are_told_from_checkpoints_own() -> None:
    entered, exited = compat.saved_tensors_hooks_codes()
    seen: list[bool] = []
    left: list[bool] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is entered:
            seen.append(compat.is_checkpoint_hooks(frame.f_locals["self"]))
        if event == "call" and frame.f_code is exited:
            left.append(compat.is_checkpoint_hooks(frame.f_locals["self"]))

    x = torch.ones(2, requires_grad=True)
    sys.setprofile(profile)
    try:
        with torch.autograd.graph.save_on_cpu():
            y = x.sin()
        checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    finally:
        sys.setprofile(None)
    y.sum().backward()
    # `save_on_cpu`, then the checkpoint's forward hooks and its recomputation's, each left.
    assert seen == left == [False, True, True]


@pins("under_transform")
def test_tensors_under_a_transform_or_an_open_dual_level_are_told_apart() -> None:
    from torch.autograd import forward_ad

    plain = torch.ones(2)
    assert not compat.under_transform(plain)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.ones(2), torch.ones(2))
        assert compat.under_transform(dual) and compat.under_transform(plain)  # the open level covers every tensor
    seen = []
    torch.func.vmap(lambda row: seen.append(compat.under_transform(row)) or row)(torch.ones(3, 2))
    assert seen == [True] and not compat.under_transform(plain)


@pins("saved_tensors_hooks_enabled")
def test_saved_tensor_hooks_disabled_by_torch_func_grad_are_seen() -> None:
    seen: list[bool] = []
    assert compat.saved_tensors_hooks_enabled()
    torch.func.grad(lambda x: seen.append(compat.saved_tensors_hooks_enabled()) or x.sum())(torch.ones(2))
    with torch.autograd.graph.disable_saved_tensors_hooks("a user's own"):
        seen.append(compat.saved_tensors_hooks_enabled())
    assert seen == [False, False] and compat.saved_tensors_hooks_enabled()
