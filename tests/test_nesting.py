"""Another activation checkpointing inside or around a region is found at the region's first forward and warned."""

import sys
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    check_recomputation,
    checkpoint_module,
)
from lightning_ckpt_determinism.checkpointing.wrapper import recomputations_by_region
from tests.helpers import DIM, PartsBlock, PlainBlock, twins

PREFIX = "lightning_ckpt_determinism: checkpointed `{}` regions have another activation checkpointing {} them: "


class InlineCheckpointBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.linear, x, use_reentrant=False)


class WrappedLinearBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = checkpoint_wrapper(nn.Linear(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class ComposableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        composable_checkpoint(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class InlineCheckpointNormBlock(nn.Module):
    """A block whose own `checkpoint` call holds a BatchNorm: torch recomputes the norm, updating its statistics once
    more in backward, whatever checkpoints the block around it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda y: self.norm(self.linear(y)), x, use_reentrant=False)


def train_step(model: nn.Module, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, DIM, requires_grad=True)).sum().backward()


def warned(model: nn.Module, steps: int = 1) -> list[str]:
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        train_step(model, steps)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("block", "what", "fix"),
    [
        (
            InlineCheckpointBlock,
            "a checkpoint call in InlineCheckpointBlock.forward (",
            "remove that call, or leave this module out of the `CheckpointingConfig`.",
        ),
        (
            WrappedLinearBlock,
            "torch's `CheckpointWrapper`.",
            "drop `checkpoint_wrapper` / torch's `apply_activation_checkpointing` and keep this package's.",
        ),
        (
            ComposableBlock,
            "torch's composable `checkpoint(module)`.",
            "drop that `checkpoint(module)` call and keep this package's.",
        ),
    ],
)
def test_a_checkpoint_inside_a_region_is_warned_once_with_what_to_drop(block: type, what: str, fix: str) -> None:
    model = nn.Sequential(block())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    (message,) = warned(model, steps=2)
    assert message.startswith(PREFIX.format(block.__name__, "inside") + what), message
    assert message.endswith(fix), message


def test_a_checkpoint_inside_a_module_swapped_into_a_region_is_warned() -> None:
    model = nn.Sequential(PartsBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    train_step(model)  # nothing nested: no warning (the suite turns the package's warnings into errors)
    model[0].parts[1] = InlineCheckpointBlock()
    (message,) = warned(model)
    assert message.startswith(PREFIX.format("PartsBlock", "inside") + "a checkpoint call in InlineCheckpointBlock")


def test_a_checkpoint_around_a_region_is_warned() -> None:
    model = nn.Sequential(PlainBlock(), PlainBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        x = torch.randn(4, DIM, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).sum().backward()
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        PREFIX.format("PlainBlock", "around") + "a checkpoint call in test_a_checkpoint_around_a_region_is_warned ("
    ), message


def test_a_region_inside_another_region_names_it() -> None:
    model = nn.Sequential(nn.Sequential(PlainBlock()))
    config = CheckpointingConfig(names=["0"])
    checkpoint_module(model[0], "0", config)
    checkpoint_module(model[0][0], "0.0", config)
    messages = warned(model)
    assert sorted(messages) == sorted(
        [
            PREFIX.format("Sequential", "inside")
            + "another region of this package, `0.0`. Nested checkpointing recomputes the inner part once more in"
            " backward for no memory saved, and this package's checks cannot see into the other one: select either"
            " the outer or the inner modules in one `CheckpointingConfig`, not both.",
            PREFIX.format("PlainBlock", "around")
            + "another region of this package, `0`. Nested checkpointing recomputes the inner part once more in"
            " backward for no memory saved, and this package's checks cannot see into the other one: select either"
            " the outer or the inner modules in one `CheckpointingConfig`, not both.",
        ]
    )


def test_a_profiler_of_the_application_is_left_in_place() -> None:
    calls: list[str] = []

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        calls.append(event)

    model = nn.Sequential(InlineCheckpointBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    sys.setprofile(profiler)
    try:
        train_step(model)
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    # The probe stands aside while a profiler runs: the nested checkpoint is not seen then.
    assert calls


@pytest.mark.parametrize("attribution", [False, True])
def test_a_norm_a_checkpoint_inside_a_region_updates_again_is_no_finding_as_the_plain_twin_shows(
    attribution: bool,
) -> None:
    plain, model = twins(lambda: nn.Sequential(InlineCheckpointNormBlock(), InlineCheckpointNormBlock()), ["0", "1"])
    x = torch.randn(8, DIM)
    with pytest.warns(LightningCkptDeterminismWarning, match="a checkpoint call in InlineCheckpointNormBlock"):
        model(x).square().mean().backward()
    plain(x).square().mean().backward()
    # The package's own recomputation leaves the buffers alone: the model trains as the block does without it, whose
    # inner checkpoint updates the statistics a second time in both.
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    # So the check finds nothing, with attribution or without: the inner checkpoint's second update is in both passes
    # (the warning above names the inner call).
    report = check_recomputation(model, lambda: model(x).square().mean(), attribution=attribution)
    assert (report.diverged, report.cause, report.buffer_mutations) == (False, None, [])
    assert [(region.cause, region.diverged) for region in report.regions] == [(None, False)] * (2 * attribution)


def test_a_region_inside_a_reentrant_checkpoint_is_warned_from_its_backward() -> None:
    # The reentrant checkpoint runs the region under no_grad in forward (plainly) and again in its backward, where
    # the region checkpoints itself: the inner part is recomputed once more there.
    plain, model = twins(lambda: nn.Sequential(PlainBlock(), PlainBlock()), ["1"])
    x = torch.randn(4, DIM, requires_grad=True)  # the reentrant checkpoint backpropagates to its inputs only
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        checkpoint(model, x, use_reentrant=True).square().mean().backward()
    plain(x).square().mean().backward()
    (message,) = [str(w.message) for w in caught]
    assert message == (
        PREFIX.format("PlainBlock", "around")
        + "a reentrant checkpoint (`use_reentrant=True`), which runs the region once more in its backward. Nested"
        " checkpointing recomputes the inner part once more in backward for no memory saved, and this package's"
        " checks cannot see into the other one: remove it, or leave this module out of the `CheckpointingConfig`."
    )
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))


class RecursiveBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        return h + self(h, depth - 1) if depth > 0 else h


def test_a_region_calling_itself_is_named_as_such_and_its_check_sees_into_it() -> None:
    plain, model = twins(lambda: nn.Sequential(RecursiveBlock()), ["0"])
    x = torch.randn(4, DIM)
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        model[0](x, depth=2).square().mean().backward()
    plain[0](x, depth=2).square().mean().backward()
    assert {str(w.message) for w in caught} == {
        PREFIX.format("RecursiveBlock", "inside")
        + "the same region, `0`, whose forward calls the module itself. Nested checkpointing recomputes the inner"
        " part once more in backward for no memory saved: recurse through a function the forward calls rather than"
        " through the module, or checkpoint a module around the recursion instead."
    }
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    # Nothing else is checkpointed there: the check compares the region's recomputations, and finds them exact.
    report = check_recomputation(model, lambda: model[0](x, depth=2).square().mean(), attribution=True)
    assert (report.diverged, [(region.name, region.diverged) for region in report.regions]) == (False, [("0", False)])


class OffloadingBlock(nn.Module):
    """A block that offloads its own saved tensors: autograd gives them to `save_on_cpu`, not to checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return x + torch.tanh(self.linear(x))


def test_saved_tensor_hooks_inside_a_region_are_warned_naming_where_they_are_entered() -> None:
    plain, model = twins(lambda: nn.Sequential(OffloadingBlock(), OffloadingBlock()), ["0", "1"])
    x = torch.randn(4, DIM)
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        model(x).square().mean().backward()
    plain(x).square().mean().backward()
    (message,) = {str(w.message) for w in caught}
    assert message.startswith(
        "lightning_ckpt_determinism: checkpointed `OffloadingBlock` regions enter saved-tensor hooks inside them:"
        " `save_on_cpu` entered in OffloadingBlock.forward ("
    ), message
    assert message.endswith(
        "Autograd gives the tensors saved under them to those hooks, not to checkpointing: they are kept (or"
        " offloaded) rather than recomputed, and the checks cannot compare them. Enter the hooks around the"
        " checkpointed module instead (around the step), or leave this module out of the `CheckpointingConfig`."
    ), message
    # What the warning says: nothing of the regions is recomputed, and training is as without checkpointing.
    assert recomputations_by_region(model) == {"0": 0, "1": 0}
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))


def test_saved_tensor_hooks_around_a_region_leave_it_to_checkpointing_unwarned() -> None:
    plain, model = twins(lambda: nn.Sequential(PlainBlock(), PlainBlock()), ["0", "1"])
    x = torch.randn(4, DIM)
    with torch.autograd.graph.save_on_cpu():  # the suite turns a warning of the package into an error
        model(x).square().mean().backward()
    plain(x).square().mean().backward()
    assert recomputations_by_region(model) == {"0": 1, "1": 1}
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))


class OffloadingCheckpointBlock(InlineCheckpointBlock):
    """Its own checkpoint, offloaded as transformers' `activation_checkpointing_enable(offload=True)` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return x + checkpoint(self.linear, x, use_reentrant=False)


def test_saved_tensor_hooks_that_come_with_a_checkpoint_inside_are_left_to_its_warning() -> None:
    model = nn.Sequential(OffloadingCheckpointBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    (message,) = warned(model)
    what = "a checkpoint call in OffloadingCheckpointBlock.forward ("
    assert message.startswith(PREFIX.format("OffloadingCheckpointBlock", "inside") + what)


class OffloadingBesideCheckpointBlock(nn.Module):
    """Offloads one part and checkpoints another: the hooks hold no checkpoint, and keep that part's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            hidden = x + torch.tanh(self.attn(x))
        return hidden + checkpoint(self.mlp, hidden, use_reentrant=False)


def test_saved_tensor_hooks_beside_a_checkpoint_inside_are_warned_with_it() -> None:
    model = nn.Sequential(OffloadingBesideCheckpointBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    nested, hooks = warned(model)
    assert nested.startswith(PREFIX.format("OffloadingBesideCheckpointBlock", "inside") + "a checkpoint call in")
    assert hooks.startswith(
        "lightning_ckpt_determinism: checkpointed `OffloadingBesideCheckpointBlock` regions enter saved-tensor hooks"
        " inside them: `save_on_cpu` entered in OffloadingBesideCheckpointBlock.forward ("
    )


class ReusedHooksBlock(nn.Module):
    """Uses one hooks object twice: around its checkpoint and, as `beside` says, once more beside it."""

    def __init__(self, beside: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.beside = beside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = torch.autograd.graph.save_on_cpu()
        with hooks:
            with hooks:  # entered again while open: the same use
                hidden = x + torch.tanh(self.attn(x))
            hidden = hidden + checkpoint(self.mlp, hidden, use_reentrant=False)
        if self.beside:
            with hooks:
                hidden = hidden + torch.tanh(self.attn(hidden))
        return hidden


@pytest.mark.parametrize("beside", [False, True])
def test_each_use_of_saved_tensor_hooks_is_told_apart_by_whether_a_checkpoint_runs_in_it(beside: bool) -> None:
    model = nn.Sequential(ReusedHooksBlock(beside))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    kinds = [("saved-tensor hooks" in said, "another activation checkpointing" in said) for said in warned(model)]
    assert kinds == [(False, True), *([(True, False)] if beside else [])]


class MutationHooksBlock(PlainBlock):
    """Enters torch's `allow_mutation_on_saved_tensors`, saved-tensor hooks a generator of torch's makes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            return super().forward(x)


def test_hooks_a_generator_of_torch_makes_are_named_where_the_forward_enters_them() -> None:
    model = nn.Sequential(MutationHooksBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        model(torch.randn(4, DIM, requires_grad=True))  # the warning comes with the first forward
    (message,) = [str(w.message) for w in caught]
    assert "`_swap_with_cloned` entered in MutationHooksBlock.forward (" in message, message
