import math
import random

import numpy as np
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    Cause,
    CheckpointingConfig,
    apply_activation_checkpointing,
    check_recomputation,
    gradient_divergence,
)
from lightning_ckpt_determinism.checkpointing import checkpointing_disabled
from lightning_ckpt_determinism.verify.two_pass import NothingRecomputed, PassFailed
from tests.helpers import (
    BatchNormBlock,
    DropoutBlock,
    FailingRecomputeBlock,
    NumpyNoiseBlock,
    PlainBlock,
    PythonRandomBlock,
    RoutingBlock,
    batch,
    make_stack,
)


def checked_stack(block: type[nn.Module], **config: object) -> nn.Module:
    model = make_stack(block)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[block.__name__], **config))  # type: ignore[arg-type]
    return model


def mse_closure(model: nn.Module, seed: int = 1):
    x, y = batch(seed)
    return lambda: F.mse_loss(model(x), y)


def test_dropout_with_rng_preserved_is_exact():
    model = checked_stack(DropoutBlock)
    report = check_recomputation(model, mse_closure(model))
    assert report.grad_divergence == 0.0
    assert report.max_abs_diff == 0.0
    assert not report.diverged
    assert report.error is None
    assert report.worst_parameters == []
    assert report.checked_regions == ["blocks.0", "blocks.1", "blocks.2"]
    assert report.reference_loss == report.checkpointed_loss


def test_dropout_without_rng_preserved_diverges_and_names_parameters():
    model = checked_stack(DropoutBlock, preserve_rng_state=False)
    report = check_recomputation(model, mse_closure(model))
    assert report.grad_divergence > 0.01
    assert report.diverged
    assert report.max_abs_diff == max(report.per_parameter.values())
    names = [name for name, _ in report.worst_parameters]
    assert 1 <= len(names) <= 5
    assert set(names) <= {name for name, _ in model.named_parameters()}
    diffs = [diff for _, diff in report.worst_parameters]
    assert diffs == sorted(diffs, reverse=True)
    # The loss is the same: dropout masks differ only in recomputation, inside backward.
    assert report.reference_loss == report.checkpointed_loss


@pytest.mark.parametrize("block", [NumpyNoiseBlock, PythonRandomBlock])
def test_host_rng_diverges_unless_replayed(block):
    without = checked_stack(block)
    assert check_recomputation(without, mse_closure(without)).diverged
    replayed = checked_stack(block, preserve_host_rng=True)
    report = check_recomputation(replayed, mse_closure(replayed))
    assert report.grad_divergence == 0.0
    assert not report.diverged


def test_shape_change_is_reported_with_torchs_message_and_state_is_restored():
    model = checked_stack(RoutingBlock)
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    report = check_recomputation(model, mse_closure(model))
    assert report.diverged
    assert math.isinf(report.grad_divergence)
    assert report.error is not None
    assert report.error.startswith("CheckpointError: torch.utils.checkpoint: Recomputed values")
    assert "different metadata" in report.error
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state)


def test_random_streams_continue_as_if_no_check_ran():
    model = checked_stack(DropoutBlock)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    check_recomputation(model, lambda: F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1)) + random.random())
    after = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0])
    assert after[1:] == expected[1:]


def test_buffers_grads_modes_and_grad_mode_are_untouched():
    model = checked_stack(BatchNormBlock)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    existing = torch.full_like(model.head.weight, 7.0)
    model.head.weight.grad = existing.clone()
    model.blocks[1].eval()
    with torch.no_grad():
        report = check_recomputation(model, mse_closure(model))
        assert not torch.is_grad_enabled()
    assert report.grad_divergence == 0.0
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert torch.equal(model.head.weight.grad, existing)
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")
    assert [m.training for m in model.blocks] == [True, False, True]


def test_state_is_restored_when_the_reference_pass_raises():
    model = checked_stack(BatchNormBlock)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    torch_state = torch.get_rng_state()
    x, _ = batch()

    def closure() -> torch.Tensor:
        model(x)
        torch.rand(10)
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        check_recomputation(model, closure)
    assert torch.equal(torch.get_rng_state(), torch_state)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


def test_torchmetrics_updated_by_the_closure_are_restored():
    model = checked_stack(PlainBlock)
    model.metric = torchmetrics.MeanMetric()
    model.metric.update(torch.tensor(1.0))
    x, y = batch()

    def closure() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.metric.update(loss.detach() * 100)
        return loss

    check_recomputation(model, closure)
    assert model.metric.update_count == 1
    assert model.metric.compute() == 1.0


_SCALE = [1.0]


class GlobalToggleBlock(PlainBlock):
    """Scales by a module-level number it toggles at each call: its recomputation reads the toggled one, a
    difference in the gradients alone (the check restores no global, and compares none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, _SCALE[0] = _SCALE[0], 2.5 - _SCALE[0]
        return x + torch.tanh(self.linear(x) * scale)


def test_tolerance_decides_the_verdict():
    model = checked_stack(GlobalToggleBlock)
    _SCALE[0] = 1.0
    strict = check_recomputation(model, mse_closure(model))
    _SCALE[0] = 1.0
    lenient = check_recomputation(model, mse_closure(model), tolerance=strict.grad_divergence * 10)
    assert lenient.grad_divergence == strict.grad_divergence > 0.0
    assert strict.diverged and not lenient.diverged


def test_a_tolerance_does_not_hide_a_random_stream_recomputation_moved():
    # Dropout unreplayed: the gradients differ (the tolerance may accept that), and torch's RNG ends the step
    # elsewhere than without checkpointing, a state change that counts whatever the gradients.
    model = checked_stack(DropoutBlock, preserve_rng_state=False)
    strict = check_recomputation(model, mse_closure(model))
    lenient = check_recomputation(model, mse_closure(model), tolerance=strict.grad_divergence * 10)
    assert lenient.grad_divergence == strict.grad_divergence > 0.0
    assert (strict.diverged, lenient.diverged, lenient.cause) == (True, True, "rng_not_preserved")


@pytest.mark.parametrize("gradients", ["autograd", "backward"])
def test_a_closure_that_runs_backward_itself_is_told_to_return_the_loss_and_leaves_no_gradient(gradients):
    model = checked_stack(PlainBlock)
    x, y = batch()

    def closure_of_lbfgs() -> torch.Tensor:
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    said = (
        r"the check's closure ran a backward itself \(it wrote the `.grad` of 10 parameters\), .* give a closure that"
        r" returns the loss without calling `backward\(\)`"
    )
    with pytest.raises(ValueError, match=said):
        check_recomputation(model, closure_of_lbfgs, gradients=gradients)
    assert [param.grad for param in model.parameters()] == [None] * 10
    # The loss alone is checked.
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), gradients=gradients)
    assert (report.diverged, report.grad_divergence) == (False, 0.0)


class RaggedWidth(nn.Module):
    """Keeps a NumPy-drawn number of its features: recomputation saves a tensor of another shape, and torch raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = int(np.random.randint(1, 9))
        return torch.tanh(self.linear(x))[:, :kept].exp().sum(1, keepdim=True).expand(-1, 8)


@pytest.mark.parametrize("gradients", ["autograd", "backward"])
def test_a_closure_that_runs_a_backward_of_its_own_still_gets_its_recomputations_error(gradients):
    # The closure's own backward reaches a parameter outside the region; the check's error is the region's, not it.
    np.random.seed(0)
    model = nn.Sequential(RaggedWidth(), nn.Linear(8, 1))
    model.scale = nn.Parameter(torch.ones(8))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(3, 8)

    def closure() -> torch.Tensor:
        model.scale.square().sum().backward()
        return model(x).sum() + model.scale.square().sum()

    report = check_recomputation(model, closure, gradients=gradients)
    assert report.diverged and report.error is not None and report.error.startswith("CheckpointError")


def test_bad_input_raises_clear_errors():
    model = checked_stack(PlainBlock)
    with pytest.raises(ValueError, match="`tolerance` must be a non-negative float, got -1"):
        check_recomputation(model, mse_closure(model), tolerance=-1.0)
    with pytest.raises(ValueError, match="must return a scalar loss tensor, got Tensor\\(16, 1\\)"):
        check_recomputation(model, lambda: model(batch()[0]))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="has no parameter that requires grad"):
        check_recomputation(frozen, lambda: frozen(torch.ones(1, 2)).sum())
    lazy = nn.Sequential(nn.LazyLinear(2), nn.Tanh())
    apply_activation_checkpointing(lazy, CheckpointingConfig(names=["1"]))
    said = r"lazy modules have not initialised yet \(0.weight, 0.bias\): run one forward"
    with pytest.raises(ValueError, match=said):
        check_recomputation(lazy, lambda: lazy(torch.ones(1, 2)).sum())
    assert torch.nn.parameter.is_lazy(lazy[0].weight)
    with pytest.raises(TypeError, match=r"takes the model, then the closure computing its loss: got \(function, "):
        check_recomputation(mse_closure(model), model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`attribution` must be True or False, got 'yes'"):
        check_recomputation(model, mse_closure(model), attribution="yes")  # type: ignore[arg-type]


def reference_divergence(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    ref = np.concatenate([t.numpy().ravel() for t in reference]).astype(np.float64)
    oth = np.concatenate([t.numpy().ravel() for t in other]).astype(np.float64)
    return float(np.linalg.norm(ref - oth) / np.linalg.norm(ref))


def test_gradient_divergence_matches_an_independent_implementation():
    generator = torch.Generator().manual_seed(0)
    reference = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    other = [t + 1e-3 * torch.randn(t.shape, generator=generator) for t in reference]
    divergence, max_diffs = gradient_divergence(reference, other)
    assert divergence == pytest.approx(reference_divergence(reference, other), rel=1e-12)
    assert max_diffs == [float((r.double() - o.double()).abs().max()) for r, o in zip(reference, other, strict=True)]
    assert gradient_divergence(reference, [t.clone() for t in reference]) == (0.0, [0.0, 0.0])


def test_gradient_divergence_non_finite_and_missing_values():
    nan_both = [torch.tensor([1.0, math.nan, math.inf])]
    assert gradient_divergence(nan_both, [torch.tensor([1.0, math.nan, math.inf])]) == (0.0, [0.0])
    assert gradient_divergence(nan_both, [torch.tensor([1.0, 2.0, math.inf])]) == (math.inf, [math.inf])
    assert gradient_divergence([torch.tensor([1.0])], [torch.tensor([-math.inf])]) == (math.inf, [math.inf])
    assert gradient_divergence([None], [None]) == (0.0, [0.0])
    assert gradient_divergence([torch.tensor([3.0, 4.0])], [None]) == (1.0, [4.0])
    assert gradient_divergence([None], [torch.tensor([1.0])]) == (math.inf, [1.0])
    with pytest.raises(ValueError, match="differs in shape: \\(2,\\) and \\(3,\\)"):
        gradient_divergence([torch.zeros(2)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="as many gradients on both sides, got 1 and 2"):
        gradient_divergence([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dropout_is_replayed_and_the_cuda_stream_continues_as_if_no_check_ran():
    model = checked_stack(DropoutBlock).cuda()
    x, y = (t.cuda() for t in batch())
    torch.cuda.manual_seed(3)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(3)
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y))
    assert report.grad_divergence == 0.0
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    unpreserved = checked_stack(DropoutBlock, preserve_rng_state=False).cuda()
    assert check_recomputation(unpreserved, lambda: F.mse_loss(unpreserved(x), y)).diverged


def test_a_check_with_no_gradient_to_compare_is_an_error_finding_not_zero():
    model = nn.Sequential(nn.Linear(2, 2))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    inputs = torch.ones(2, requires_grad=True)
    # The loss needs grad through its input only: no parameter of the module gets a gradient in either pass.
    for gradients in ("autograd", "backward"):
        report = check_recomputation(model, lambda: (inputs * 2).sum(), gradients=gradients)  # type: ignore[arg-type]
        assert report.error is not None
        assert report.error.startswith("the check could not compare gradients: no parameter received a gradient")
        assert (report.diverged, report.grad_divergence) == (True, math.inf)


def test_a_check_whose_closure_recomputes_no_region_raises_rather_than_pass() -> None:
    # Two passes that run the same computation have equal gradients whatever the regions recompute: a closure run
    # under `checkpointing_disabled()`, or one calling no region, read 0.0 with the regions' recomputation broken.
    model = checked_stack(NumpyNoiseBlock)
    x, y = batch(1)
    assert check_recomputation(model, lambda: F.mse_loss(model(x), y)).diverged  # ground truth: the defect is there

    def disabled() -> torch.Tensor:
        with checkpointing_disabled():
            return F.mse_loss(model(x), y)

    for closure in (disabled, lambda: F.mse_loss(model.head(x), y)):
        with pytest.raises(NothingRecomputed, match="recomputed no checkpointed region"):
            check_recomputation(model, closure, attribution=True)


def test_checked_regions_are_the_regions_the_checkpointed_pass_recomputed() -> None:
    model = checked_stack(PlainBlock)
    x, y = batch(1)
    first = check_recomputation(model, lambda: F.mse_loss(model.head(model.blocks[0](x)), y))
    every = check_recomputation(model, mse_closure(model))
    assert (first.checked_regions, every.checked_regions) == (["blocks.0"], ["blocks.0", "blocks.1", "blocks.2"])


def test_a_reference_pass_failing_on_one_rank_raises_pass_failed_on_every_rank() -> None:
    # Under DDP a `loss_fn` failing on rank 1 alone (a detached loss) raised there, while rank 0 went on into the
    # checkpointed pass's collective and waited for it: a hang, where one process skips the check.
    model = checked_stack(PlainBlock)
    x, y = batch()

    def detached() -> torch.Tensor:
        return F.mse_loss(model(x), y).detach()

    with pytest.raises(PassFailed) as here:  # this rank's own failure, agreed
        check_recomputation(model, detached, agree=lambda decision: decision)
    assert isinstance(here.value.__cause__, ValueError)
    with pytest.raises(PassFailed, match="reference pass failed on another rank"):  # the other rank's
        check_recomputation(model, mse_closure(model), agree=lambda decision: True)
    with pytest.raises(ValueError, match="does not require grad"):  # one process: the error itself
        check_recomputation(model, detached)


@pytest.mark.parametrize("block", [DropoutBlock, BatchNormBlock])
def test_backward_gradients_equal_autograd_ones_and_leave_grad_as_it_was(block):
    model = checked_stack(block)
    held = {name: torch.full_like(param, 7.0) for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        param.grad = held[name]
    # A first check teaches the regions their profile: the two compared below then recompute alike (up to the last
    # saved tensor), where a region's first call recomputes to its end.
    check_recomputation(model, mse_closure(model))
    by_autograd = check_recomputation(model, mse_closure(model), attribution=True)
    by_backward = check_recomputation(model, mse_closure(model), attribution=True, gradients="backward")
    assert by_backward == by_autograd
    assert by_backward.grad_divergence == 0.0
    assert all(param.grad is held[name] for name, param in model.named_parameters())
    assert all(torch.equal(param.grad, torch.full_like(param, 7.0)) for param in model.parameters())
    broken = checked_stack(block, preserve_rng_state=False, protect_buffers=False)
    report = check_recomputation(broken, mse_closure(broken), gradients="backward")
    # Dropout redrawn diverges the gradients; BatchNorm updated twice leaves them exact and is the step's buffer
    # mutation (found without attribution, as the live engine finds it).
    assert (report.grad_divergence > 0.0) == (block is DropoutBlock)
    assert report.diverged
    assert report.cause == (None if block is DropoutBlock else Cause.BUFFER_MUTATION)


def test_gradients_argument_is_validated():
    model = checked_stack(PlainBlock)
    with pytest.raises(ValueError, match="`gradients` can be autograd, backward, got 'grad'"):
        check_recomputation(model, mse_closure(model), gradients="grad")  # type: ignore[arg-type]


def test_python_state_is_the_same_in_both_passes_and_restored_after():
    model = checked_stack(PlainBlock)
    model.steps = 3
    model.seen = [1]
    seen = model.seen

    def closure() -> torch.Tensor:
        model.steps += 1
        model.seen.append(model.steps)
        model.created = True
        return mse_closure(model)()

    report = check_recomputation(model, closure)
    assert report.grad_divergence == 0.0
    assert (model.steps, model.seen, "created" in vars(model)) == (3, [1], False)
    assert model.seen is seen


def test_extra_passes_of_attribution_follow_the_agreed_decision():
    # On one rank a clean model needs no host-RNG confirmation; agreeing with a rank that does runs it here too, so
    # that every rank runs as many forwards (and their collectives).
    model = checked_stack(PlainBlock)
    passes = []

    def closure() -> torch.Tensor:
        passes.append(1)
        return mse_closure(model)()

    check_recomputation(model, closure, attribution=True, agree=lambda decision: decision)
    alone = len(passes)
    passes.clear()
    # The other rank's answers, in order: its reference pass did not fail, nor its checkpointed pass, it wants the
    # host-RNG confirmation, and that pass did not fail either.
    others = iter([False, False, True, False])
    report = check_recomputation(model, closure, attribution=True, agree=lambda decision: decision or next(others))
    assert (alone, len(passes)) == (2, 3)
    assert report.grad_divergence == 0.0 and not report.diverged


class ReentrantInside(nn.Module):
    """Runs its linear layer through torch's reentrant checkpoint, as transformers' own checkpointing can."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=True)


def test_reentrant_checkpointing_elsewhere_is_one_line_naming_gradients_backward():
    torch.manual_seed(0)
    # The gradients of the first layer come through the reentrant checkpoint's backward.
    model = nn.Sequential(nn.Linear(4, 4), ReentrantInside(), nn.Linear(4, 4), nn.Tanh())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["2"]))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"^lightning_ckpt_determinism: the model runs reentrant checkpointing .*"
        r'call `check_recomputation\(\.\.\., gradients="backward"\)`, or switch it to',
    ):
        check_recomputation(model, lambda: model(x).sum())
    # What the line says to do checks it.
    report = check_recomputation(model, lambda: model(x).sum(), gradients="backward")
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)


def test_a_closure_failing_before_backward_in_the_checkpointed_pass_raises_pass_failed_not_a_divergence() -> None:
    model = checked_stack(PlainBlock)
    closure, calls = mse_closure(model), []

    def fails_when_run_again() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # the checkpointed pass, after the reference pass
            raise ValueError("not safe to run twice")
        return closure()

    with pytest.raises(PassFailed, match=r"^ValueError: not safe to run twice$") as raised:
        check_recomputation(model, fails_when_run_again, attribution=True)
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_recomputation_that_raises_in_backward_is_still_the_finding() -> None:
    model = checked_stack(FailingRecomputeBlock)
    report = check_recomputation(model, mse_closure(model), attribution=True)
    assert report.diverged and math.isinf(report.grad_divergence)
    assert report.error is not None and "FailingRecomputeBlock" in report.error
