"""Tests for `lightning_ckpt_determinism.checkpointing.determinism_check`: the package's extractor does what torch's
does where nothing observes, counts a call's tensors alike whatever runs inside its forward, and hands an observer's
plan the tensors it names at the forward and their recomputations at the comparison."""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from lightning_ckpt_determinism import CheckpointingConfig, checkpoint_module, recomputation_sentinel
from lightning_ckpt_determinism._torch_compat import determinism_checks
from lightning_ckpt_determinism.checkpointing import wrapper as wrapper_module
from lightning_ckpt_determinism.checkpointing.determinism_check import (
    DETERMINISM_CHECKS,
    SavedPlan,
    recomputed_tensor,
)
from lightning_ckpt_determinism.checkpointing.wrapper import observing_saved_tensors


class Shrinks(nn.Module):
    """Takes the first ``sizes[0]`` rows at each call, popping the size (in place, so recomputation reads the next)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: self.sizes.pop(0)].sin().cos()


def _error_of(module: nn.Module, hand_written: bool) -> str:
    x = torch.randn(4, 3, requires_grad=True)
    out = checkpoint(module, x, use_reentrant=False) if hand_written else module(x)
    with pytest.raises(CheckpointError) as caught:
        out.sum().backward()
    return str(caught.value)


def test_a_metadata_difference_raises_torchs_own_error_word_for_word() -> None:
    # One clean call first: the region learns its profile, and the next one takes the path of a call nothing probes.
    region = Shrinks([4, 4, 4, 3])
    checkpoint_module(region, "region", CheckpointingConfig(classes=["Shrinks"]))
    region(torch.randn(4, 3, requires_grad=True)).sum().backward()
    by_package = _error_of(region, hand_written=False)
    by_torch = _error_of(Shrinks([4, 3]), hand_written=True)
    assert "saved metadata: {'shape': torch.Size([4, 3])" in by_torch
    assert by_package == by_torch


class Block(nn.Module):
    """A linear layer, a GELU and a LayerNorm: 8 saved tensors a call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(nn.functional.gelu(self.linear(x)))


class ExtractorCalls:
    """How many tensors torch's own ``"default"`` extractor and the package's are given at each step: each registry
    entry is wrapped by a counter (after the regions are wrapped, which registers the package's names)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"torch": 0, "package": 0}
        self.by_step: dict[str, list[int]] = {"torch": [], "package": []}
        registry = determinism_checks()
        for who, name in (("torch", "default"), ("package", DETERMINISM_CHECKS["default"])):
            monkeypatch.setitem(registry, name, self._counting(who, registry[name]))

    def _counting(self, who: str, extract: Any) -> Any:
        def counted(tensor: torch.Tensor) -> Any:
            self.calls[who] += 1
            return extract(tensor)

        return counted

    def step_ended(self) -> None:
        for who, count in self.calls.items():
            self.by_step[who].append(count - sum(self.by_step[who]))


def _trained_beside_a_twin(
    monkeypatch: pytest.MonkeyPatch, module_class: type[nn.Module], steps: int = 3
) -> tuple[ExtractorCalls, list[int], list[Any]]:
    """Train a checkpointed ``module_class`` beside a plain twin (same weights, same batches), asserting equal
    gradients at every step; give the tensors each extractor got, the region's count and its profile, by step."""
    torch.manual_seed(0)
    plain, region = module_class(), module_class()
    region.load_state_dict(plain.state_dict())
    checkpoint_module(region, "region", CheckpointingConfig(classes=[module_class.__name__]))
    wrapper = region.__dict__["forward"]
    extractors = ExtractorCalls(monkeypatch)
    saved, profiles = [], []
    for step in range(steps):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step), requires_grad=True)
        region(x).sum().backward()
        plain_x = x.detach().requires_grad_()
        plain(plain_x).sum().backward()
        assert torch.equal(x.grad, plain_x.grad)
        extractors.step_ended()
        saved.append(wrapper.saved)
        profiles.append(wrapper.profile)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(region.parameters(), plain.parameters(), strict=True))
    return extractors, saved, profiles


def test_a_call_nothing_learns_from_nor_reads_costs_torchs_own_extractor_and_still_finds_its_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extractors, saved, profiles = _trained_beside_a_twin(monkeypatch, Block)
    # The first call learns (the package's extractor, its 8 tensors at the forward and each again at the comparison);
    # the next ones pass torch's own name, and torch's frame counts the 8 they save: the learned path.
    assert extractors.by_step == {"package": [16, 0, 0], "torch": [0, 16, 16]}
    assert saved == [8, 8, 8]
    assert profiles[0] is not None and profiles[0].saved == 8
    assert profiles[1] is profiles[2] is profiles[0]


def test_the_calls_of_a_paused_sentinel_cost_torchs_own_extractor_and_the_watched_ones_are_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    checkpoint_module(model, "0", CheckpointingConfig(classes=["Block"]))
    extractors = ExtractorCalls(monkeypatch)
    compared = []
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for step in range(4):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step), requires_grad=True)
            with sentinel.paused() if step in (1, 2) else nullcontext():
                model(x).sum().backward()
            compared.append(sentinel.end_step().compared)
            sentinel.next_step()
            extractors.step_ended()
    # Step 0 learns and is read, steps 1 and 2 run paused as if no sentinel were there, step 3 is read again.
    assert extractors.by_step == {"package": [32, 0, 0, 32], "torch": [0, 32, 32, 0]}
    assert compared[1] == compared[2] == 0 and compared[0] == compared[3] > 0


def test_where_torchs_frame_cannot_be_counted_every_call_counts_with_the_package_extractor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wrapper_module, "checkpoint_saved_counter", lambda: None)
    extractors, saved, profiles = _trained_beside_a_twin(monkeypatch, Block)
    assert extractors.by_step == {"package": [16, 16, 16], "torch": [0, 0, 0]}
    assert saved == [8, 8, 8]
    assert profiles[0] is not None and profiles[1] is profiles[2] is profiles[0]


class GradientInForward(nn.Module):
    """Takes a gradient inside its forward, with ``create_graph=True`` (a gradient penalty inside a region), and saves
    more tensors after it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        (slope,) = torch.autograd.grad(hidden.sum(), x, create_graph=True)
        return (hidden * slope).exp()


def test_a_backward_inside_a_forward_leaves_the_calls_count_as_its_first_call_learned_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extractors, counts, profiles = _trained_beside_a_twin(monkeypatch, GradientInForward)
    # The first call learned the count; the later ones (not probed) count alike, so they take its profile. torch's
    # frame also counts what the backward inside the forward saved, so every call counts with the package's extractor.
    assert counts[0] == counts[1] == counts[2] == profiles[0].saved
    assert profiles[1] is profiles[2] is profiles[0]
    assert extractors.by_step["torch"] == [0, 0, 0]


class ReadsTheSecond:
    """A saved-tensor observer whose plan handles the second tensor of each call only: it keeps that tensor's value
    and, at the comparison, the recomputed tensor it is compared with."""

    def __init__(self) -> None:
        self.handed: list[tuple[int, bool, torch.Tensor]] = []
        self.recomputed: list[torch.Tensor] = []
        self.watching = True

    def region_forward(self, region: str, module: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def region_recompute(self, region: str, module: nn.Module, exposed_buffers: Any) -> AbstractContextManager[None]:
        return nullcontext()

    def extractor(self) -> SavedPlan:
        return SavedPlan(self._keep, positions=frozenset({1}))

    def _keep(self, tensor: torch.Tensor, position: int, strict: bool) -> "Kept":
        self.handed.append((position, strict, tensor.detach().clone()))
        return Kept(self)


class Kept:
    """What ``ReadsTheSecond`` keeps: at the comparison it gets the recomputed tensor, and finds it equal."""

    def __init__(self, observer: ReadsTheSecond) -> None:
        self.observer = observer

    def __ne__(self, other: object) -> bool:
        tensor = recomputed_tensor(other)
        assert tensor is not None
        self.observer.recomputed.append(tensor.detach().clone())
        return False

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]


class Chain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos().exp()


def test_an_observers_plan_gets_the_tensors_it_names_and_their_recomputations() -> None:
    region = Chain()
    checkpoint_module(region, "region", CheckpointingConfig(classes=["Chain"]))
    x = torch.randn(2, 3, requires_grad=True)
    region(x).sum().backward()  # the region's first call, which learns its profile
    observer = ReadsTheSecond()
    with observing_saved_tensors(observer, region):  # type: ignore[arg-type]
        y = x.detach().requires_grad_()
        region(y).sum().backward()
    # `sin` saves x, `cos` saves sin(x), `exp` saves its result: the plan names the second only.
    assert [(position, strict) for position, strict, _ in observer.handed] == [(1, True)]
    assert torch.equal(observer.handed[0][2], y.detach().sin())
    assert len(observer.recomputed) == 1 and torch.equal(observer.recomputed[0], y.detach().sin())
    assert torch.equal(y.grad, x.grad)
