"""Scenarios adapted from torch's own checkpoint tests (``TestCheckpoint``, ``TestAutograd``, ``TestNestedCheckpoint``,
``TestSelectiveActivationCheckpoint``), each run four ways: without checkpointing, with torch's ``checkpoint``, with
the package, and with the package under the exact sentinel. The package behaves as torch's checkpoint does, and
both as no checkpointing does."""

import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    GraphExecGroup,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
)

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from tests.helpers import BufferCounter

WAYS = ["torch", "package", "package+sentinel"]
DIM = 8


class Wrapped(nn.Module):
    """``region`` checkpointed the way ``way`` says (nothing for ``"none"``); a closure-free forward."""

    def __init__(self, region: nn.Module, way: str, **config: Any) -> None:
        super().__init__()
        self.region = region
        self.way = way
        if way.startswith("package"):
            apply_activation_checkpointing(self, CheckpointingConfig(names=["region"], **config))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.way == "torch":
            return checkpoint(self.region, *args, use_reentrant=False, **kwargs)
        return self.region(*args, **kwargs)


@contextmanager
def watched(model: nn.Module, way: str) -> Iterator[None]:
    """The exact sentinel around ``model`` for ``"package+sentinel"``, asserting it found nothing."""
    if way != "package+sentinel":
        yield
        return
    with recomputation_sentinel(model, mode="exact") as sentinel:
        yield
    assert sentinel.report().mismatches == 0


def twins(make: Callable[[], nn.Module], way: str, **config: Any) -> tuple[nn.Module, nn.Module]:
    """A plain model and the same weights checkpointed ``way``."""
    torch.manual_seed(0)
    plain = Wrapped(make(), "none")
    other = Wrapped(make(), way, **config)
    other.load_state_dict(plain.state_dict())
    return plain, other


def grads(model: nn.Module, loss: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)
    targets = [*model.parameters(), *inputs]
    return list(torch.autograd.grad(loss(), targets))


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.tanh(self.up(x))))


class Keywords(nn.Module):
    """Takes keyword arguments, one of them named ``cache`` (a plain module: it must get it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.linear(x)) * scale
        return out if cache is None else out + cache


class NonTensorOutputs(nn.Module):
    """Returns a tensor, a number, ``None`` and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, None, str]:
        return torch.tanh(self.linear(x)), 3, None, "tag"


class CheckpointsInside(nn.Module):
    """Checkpoints a part of itself with torch's ``checkpoint``: nested checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MLP()
        self.outer = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.outer(checkpoint(self.inner, x, use_reentrant=False)))


def inputs() -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(2), requires_grad=True)


@pytest.mark.parametrize("way", WAYS)
def test_gradients_of_parameters_and_inputs_equal_no_checkpointing(way: str) -> None:
    plain, other = twins(MLP, way)
    x = inputs()
    expected = grads(plain, lambda: plain(x).square().sum(), x)
    with watched(other, way):
        assert same(expected, grads(other, lambda: other(x).square().sum(), x))


@pytest.mark.parametrize("way", WAYS)
def test_debug_mode_runs_and_gives_the_same_gradients(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's debug mode logs every op through records only its own handler can format; its `capture_logs` stops
    # them from reaching the root logger, where pytest's capture would try to, but not after pytest's logging plugin
    # has set up the next test.
    monkeypatch.setattr(logging.getLogger("LoggingTensor"), "propagate", False)
    plain, other = twins(MLP, way)
    x = inputs()
    expected = grads(plain, lambda: plain(x).square().sum(), x)
    with set_checkpoint_debug_enabled(True), watched(other, way):
        assert same(expected, grads(other, lambda: other(x).square().sum(), x))


@pytest.mark.parametrize("way", WAYS)
def test_keyword_arguments_reach_the_forward_even_one_named_cache(way: str) -> None:
    plain, other = twins(Keywords, way)
    x, scale, cache = inputs(), torch.full((DIM,), 0.5), torch.ones(4, DIM)
    expected = grads(plain, lambda: plain(x, scale=scale, cache=cache).sum(), x)
    with watched(other, way):
        got = grads(other, lambda: other(x, scale=scale, cache=cache).sum(), x)
    assert same(expected, got)


@pytest.mark.parametrize("way", WAYS)
def test_non_tensor_outputs_pass_through(way: str) -> None:
    plain, other = twins(NonTensorOutputs, way)
    x = inputs()
    with watched(other, way):
        _, number, nothing, tag = other(x)
        assert (number, nothing, tag) == (3, None, "tag")
        assert same(grads(plain, lambda: plain(x)[0].sum(), x), grads(other, lambda: other(x)[0].sum(), x))


@pytest.mark.parametrize("way", WAYS)
def test_a_checkpoint_nested_inside_a_region(way: str) -> None:
    plain, other = twins(CheckpointsInside, way)
    x = inputs()
    expected = grads(plain, lambda: plain(x).square().sum(), x)
    # The package warns of the checkpoint inside its region (it recomputes the inner part twice), and stays exact.
    nested = (
        pytest.warns(LightningCkptDeterminismWarning, match="have another activation checkpointing inside them")
        if way.startswith("package")
        else nullcontext()
    )
    with nested, watched(other, way):
        assert same(expected, grads(other, lambda: other(x).square().sum(), x))


class TwoBranches(nn.Module):
    """Two independent branches, one per input: two backward calls each need only one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(DIM, DIM)
        self.right = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.left(x)), torch.sin(self.right(y))


@pytest.mark.parametrize("way", WAYS)
def test_two_backwards_in_one_graph_exec_group_share_one_recomputation(way: str) -> None:
    plain, other = twins(TwoBranches, way)
    results = []
    for model in (plain, other):
        x, y = inputs(), inputs()
        with watched(model, way) if model is other else nullcontext():
            left, right = model(x, y)
            with GraphExecGroup():
                results.append([*torch.autograd.grad(left.sum(), [x]), *torch.autograd.grad(right.sum(), [y])])
    assert same(*results)


@pytest.mark.parametrize("way", WAYS)
def test_recomputing_to_the_end_gives_the_same_gradients(way: str) -> None:
    plain, other = twins(MLP, way)
    x = inputs()
    expected = grads(plain, lambda: plain(x).square().sum(), x)
    with set_checkpoint_early_stop(False), watched(other, way):
        assert same(expected, grads(other, lambda: other(x).square().sum(), x))


def _saves_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("way", ["package", "package+sentinel"])
def test_save_ops_equal_torchs_selective_checkpointing_policy(way: str) -> None:
    torch.manual_seed(0)
    region = MLP()
    x = inputs()
    by_torch = Wrapped(region, "none")

    def selective(x: torch.Tensor) -> torch.Tensor:
        context = lambda: create_selective_checkpoint_contexts(_saves_matmuls)  # noqa: E731
        return checkpoint(region, x, use_reentrant=False, context_fn=context)

    expected = grads(by_torch, lambda: selective(x).square().sum(), x)
    _, other = twins(MLP, way, save_ops=["aten.addmm"])
    other.load_state_dict(by_torch.state_dict())
    with watched(other, way):
        assert same(expected, grads(other, lambda: other(x).square().sum(), x))


@pytest.mark.parametrize("way", WAYS)
def test_a_buffer_saved_by_a_function_is_the_buffer_itself(way: str) -> None:
    plain, other = twins(BufferCounter, way)
    for model in (plain, other):
        with watched(model, way) if model is other else nullcontext():
            model(inputs()).sum().backward()
    # The backward's increment lands on the buffer, once, as without checkpointing.
    assert plain.region.counter.tolist() == other.region.counter.tolist() == [1.0, 1.0, 1.0]


class GradInForward(nn.Module):
    """Takes a gradient inside its forward, with ``create_graph=True`` (a gradient penalty inside a region)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        (slope,) = torch.autograd.grad(hidden.sum(), x, create_graph=True)
        return hidden * slope


@pytest.mark.parametrize("way", WAYS)
def test_the_graph_of_a_dropped_output_is_freed(way: str) -> None:
    _, other = twins(GradInForward, way)
    held: list[weakref.ref[torch.Tensor]] = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            outputs = out if isinstance(out, tuple) else (out,)
            held.extend(weakref.ref(tensor) for tensor in outputs if isinstance(tensor, torch.Tensor))
            return out

    with watched(other, way):
        x = inputs()
        with Track():
            out = other(x)
        del out
        gc.collect()
        assert [ref for ref in held if ref() is not None] == []


class OpLog(TorchDispatchMode):
    """Counts the ops it sees, by name: a user's dispatch mode around the whole step."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


class RoutedWithNorm(nn.Module):
    """A top-2 route (kept by the routing guard) and a BatchNorm (its buffers replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.linear(x))
        _, chosen = hidden.topk(2, dim=-1)
        return hidden * (1 + chosen.float().mean())


@pytest.mark.parametrize("way", ["package", "package+sentinel"])
def test_a_users_dispatch_mode_sees_the_ops_torchs_checkpoint_runs_and_no_more(way: str) -> None:
    logs = {}
    for name in ("torch", way):
        _, model = twins(RoutedWithNorm, name)
        model(inputs()).sum().backward()  # the region's first call, which the package probes
        stack = ExitStack()
        if name == "package+sentinel":
            stack.enter_context(watched(model, name))
        with stack, OpLog() as log:
            model(inputs()).sum().backward()
        logs[name] = log.ops
    # The package adds no op a user's mode would see (buffers replayed, digests taken, routing kept below every
    # mode); it runs one fewer: the route it serves from the forward instead of recomputing it.
    fewer = {op: count - logs[way].get(op, 0) for op, count in logs["torch"].items() if logs[way].get(op, 0) != count}
    assert set(logs[way]) <= set(logs["torch"])
    assert fewer == {"aten.topk.default": 1}
