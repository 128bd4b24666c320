"""Tests for the live-step engine (`lightning_ckpt_determinism.verify.live_step`) and the state it captures and
restores."""

import math
from collections import defaultdict, deque

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, checkpointing_disabled
from lightning_ckpt_determinism.verify.gradients import GradientStash
from lightning_ckpt_determinism.verify.live_step import check_live_step, compare_gradients
from lightning_ckpt_determinism.verify.state import StepState
from tests.helpers import BatchNormBlock, DropoutBlock, NumpyNoiseBlock, batch, make_stack

NAMES = ["a", "b"]


class TwoRanks:
    """An ``all_reduce`` over two simulated ranks: this rank's tensor and the other rank's, given in advance."""

    def __init__(self, other: list[torch.Tensor]) -> None:
        self.other = list(other)
        self.calls: list[str] = []

    def __call__(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self.calls.append(op)
        theirs = self.other.pop(0)
        return tensor + theirs if op == "sum" else torch.maximum(tensor, theirs)


def test_equal_gradients_compare_with_one_collective_and_give_zero():
    grads = [torch.ones(3), torch.zeros(2)]
    reduce = TwoRanks([torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0], dtype=torch.float64)])
    result = compare_gradients(NAMES, grads, [g.clone() for g in grads], all_reduce=reduce)
    assert (result.grad_divergence, result.max_abs_diff, result.error) == (0.0, 0.0, None)
    assert result.per_parameter == {"a": 0.0, "b": 0.0}
    assert reduce.calls == ["sum"]


def test_a_difference_on_another_rank_reaches_every_rank():
    grads = [torch.tensor([3.0, 4.0]), torch.zeros(1)]
    # The other rank: one unequal gradient, 3 elements, squared differences 0.25 over a squared norm 25, max 0.5.
    reduce = TwoRanks(
        [
            torch.tensor([1.0, 0.0, 3.0, 0.0, 0.0, 0.0], dtype=torch.float64),
            torch.tensor([0.25, 25.0], dtype=torch.float64),
            torch.tensor([0.5, 0.0], dtype=torch.float64),
        ]
    )
    result = compare_gradients(NAMES, grads, [g.clone() for g in grads], all_reduce=reduce)
    assert reduce.calls == ["sum", "sum", "max"]
    assert result.grad_divergence == pytest.approx(math.sqrt(0.25 / 50.0))
    assert result.per_parameter == {"a": 0.5, "b": 0.0}


def test_replicated_values_count_once_in_the_sums():
    live, reference = [torch.tensor([3.0, 4.5])], [torch.tensor([3.0, 4.0])]
    counted = compare_gradients(["a"], live, reference)
    assert counted.grad_divergence == pytest.approx(0.1)
    not_here = TwoRanks(
        [
            torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.0], dtype=torch.float64),
            torch.tensor([0.0, 0.0], dtype=torch.float64),
            torch.tensor([0.0], dtype=torch.float64),
        ]
    )
    # This rank's copy does not count: the other rank's (equal) values make the whole sum.
    result = compare_gradients(["a"], live, reference, all_reduce=not_here, counted=[False])
    assert result.grad_divergence == 0.0
    assert result.per_parameter == {"a": 0.5}


@pytest.mark.parametrize(
    ("live", "reference", "message"),
    [
        ([None, None], [None, None], "no parameter received a gradient"),
        ([torch.ones(1), None], [torch.ones(1), None], "no parameter received a gradient"),
        ([torch.ones(1), torch.ones(1)], [torch.ones(1), None], "the reference pass gave no gradient for ['b']"),
    ],
)
def test_nothing_to_compare_is_an_error_never_zero(live, reference, message):
    counted = [False, True]  # the one gradient present is not counted here, and no other rank adds any
    result = compare_gradients(NAMES, live, reference, counted=counted)
    assert result.error is not None and message in result.error
    assert result.grad_divergence == math.inf


def test_non_finite_live_gradients_are_skipped_only_when_asked():
    live, reference = [torch.tensor([math.inf]), torch.ones(1)], [torch.ones(1), torch.ones(1)]
    assert compare_gradients(NAMES, live, reference, skip_non_finite=True).skipped
    compared = compare_gradients(NAMES, live, reference)
    assert not compared.skipped
    assert compared.grad_divergence == math.inf


def _live_step(model: nn.Module, seed: int = 5) -> StepState:
    """Run the live (checkpointed) step from a seeded state; return the state it started from."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    entry = StepState(model)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    return entry


def _reference(model: nn.Module):
    def run() -> float:
        x, y = batch()
        with checkpointing_disabled():
            loss = F.mse_loss(model(x), y)
            loss.backward()
        return float(loss.detach())

    return run


@pytest.mark.parametrize("clone_gradients", [False, True])
@pytest.mark.parametrize(
    ("block", "diverges"), [(DropoutBlock, False), (BatchNormBlock, False), (NumpyNoiseBlock, True)]
)
def test_check_live_step_compares_and_puts_the_live_step_back(block, diverges, clone_gradients):
    model = make_stack(block)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[block.__name__]))
    entry = _live_step(model)
    live = {name: param.grad for name, param in model.named_parameters()}
    values = {name: grad.clone() for name, grad in live.items()}
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    torch_rng, numpy_rng = torch.get_rng_state(), np.random.get_state()[1].copy()
    report = check_live_step(model, _reference(model), entry, clone_gradients=clone_gradients)
    assert report is not None
    assert report.diverged == diverges
    assert (report.grad_divergence > 0.0) == diverges
    assert report.error is None
    # The live gradients are back (the tensors themselves unless copies were asked for), and so is the state.
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, values[name])
        assert (param.grad is live[name]) != clone_gradients
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert np.array_equal(np.random.get_state()[1], numpy_rng)


def test_the_reference_starts_from_the_gradients_held_before_the_live_backward():
    model = make_stack(BatchNormBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["BatchNormBlock"]))
    before = [torch.full_like(param, 0.5) for param in model.parameters()]
    for param, grad in zip(model.parameters(), before, strict=True):
        param.grad = grad.clone()
    entry = _live_step(model)
    report = check_live_step(model, _reference(model), entry, gradients_before=before)
    assert report is not None and report.grad_divergence == 0.0
    # Without them the reference lacks the held part, and the comparison says so.
    for param, grad in zip(model.parameters(), before, strict=True):
        param.grad = grad.clone()
    entry = _live_step(model)
    assert check_live_step(model, _reference(model), entry).grad_divergence > 0.0  # type: ignore[union-attr]


def test_step_state_restores_plain_attributes_in_place_and_leaves_module_internals_alone():
    model = make_stack(BatchNormBlock, n=1)
    model.counter = 1
    model.outputs = [torch.ones(1)]
    model.table = {"a": 1}
    outputs, table = model.outputs, model.table
    state = StepState(model)
    model.counter += 1
    model.outputs.append(torch.zeros(1))
    model.table["b"] = 2
    model.fresh = "new"
    model.blocks[0].training = False
    model(batch()[0])
    state.restore()
    assert (model.counter, len(model.outputs), model.table, "fresh" in vars(model)) == (1, 1, {"a": 1}, False)
    assert model.outputs is outputs and model.table is table
    assert model.blocks[0].training
    assert int(model.blocks[0].norm.num_batches_tracked) == 0


def test_step_state_restores_the_hooks_of_every_module_in_their_order():
    model = make_stack(DropoutBlock, n=1).eval()  # no dropout: the same output at every call
    x = batch()[0]
    kept = model.head.register_forward_hook(lambda module, inputs, output: output + 1)
    gone = model.head.register_forward_hook(lambda module, inputs, output: output * 2)
    expected = model(x)
    state = StepState(model)
    gone.remove()
    model.inp.register_forward_pre_hook(lambda module, inputs: (inputs[0] * 3,))
    model.head.register_forward_hook(lambda module, inputs, output: output * 5, prepend=True)
    state.restore()
    assert torch.equal(model(x), expected)  # (out + 1) * 2, as before the step
    assert [hook_id for hook_id in model.head._forward_hooks] == [kept.id, gone.id]
    state.restore()  # again: nothing to do
    assert torch.equal(model(x), expected)


def test_a_check_leaves_a_hook_the_step_removed_removed_as_training_does():
    # The check restores the step's start for its reference pass, then what the live step left.
    model = make_stack(DropoutBlock, n=1).eval()
    handle = model.head.register_forward_hook(lambda module, inputs, output: output * 2)
    entry = StepState(model)
    handle.remove()  # by a callback's `on_before_backward`, which the reference pass does not rerun
    after_step = StepState(model)
    entry.restore()
    assert len(model.head._forward_hooks) == 1  # the reference starts where the step started
    after_step.restore()
    assert len(model.head._forward_hooks) == 0


def test_step_state_restores_containers_nested_in_plain_attributes_and_deques():
    model = make_stack(DropoutBlock, n=1)
    model.outputs = defaultdict(list, {"train": [1]})
    model.pairs = ([0], {"seen": {1}})
    model.recent = deque([1], maxlen=3)
    inner, recent = model.outputs["train"], model.recent
    state = StepState(model)
    model.outputs["train"].append(2)
    model.outputs["val"].append(3)
    model.pairs[0].append(1)
    model.pairs[1]["seen"].add(2)
    model.recent.append(2)
    state.restore()
    assert dict(model.outputs) == {"train": [1]} and model.outputs["train"] is inner
    assert model.pairs == ([0], {"seen": {1}})
    assert list(model.recent) == [1] and model.recent is recent and recent.maxlen == 3


def test_gradient_stash_with_copies_survives_a_backward_writing_into_the_same_storage():
    weight = nn.Parameter(torch.ones(2))
    (weight * 3).sum().backward()
    storage = weight.grad
    stash = GradientStash([weight], clone=True)
    weight.grad = storage
    with torch.no_grad():
        storage.fill_(9.0)  # a bucket view written by the next backward
    stash.put_back()
    assert torch.equal(weight.grad, torch.tensor([3.0, 3.0]))
