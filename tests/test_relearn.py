"""A region's profile learned at any call, not only its first: each model below behaves differently at a later call
than at its first (another code path, another mode, a new attribute or generator, state that starts changing), and
is held against a plain twin (the same weights and seeds, trained side by side) under the sentinel, in every tier,
and the check before every step. The later calls are the ones that matter: every step must be bit-identical."""

import contextlib
import copy
import warnings
import weakref
from collections.abc import Callable
from typing import get_args

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.checkpointing import wrapper as wrapper_module
from lightning_ckpt_determinism.checkpointing.profile import FirstForwardProbe
from lightning_ckpt_determinism.verify.digest import DigestTier
from lightning_ckpt_determinism.verify.sentinel.calls import RegionCall
from lightning_ckpt_determinism.verify.sentinel.report import SentinelRegion
from tests.test_verdicts import (
    WIDTH,
    Around,
    Case,
    Channels,
    Head,
    HeldGenerator,
    Recurrent,
    Trial,
    loss_of,
    same_state,
    seeded,
    tokens,
    trial,
)

TIERS = get_args(DigestTier)
STEPS = 4


class LaterRReLU(nn.Module):
    """Ends in tanh at its first call and in RReLU from the second on (a branch on a call counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.act = nn.RReLU()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        return self.act(h) if self.calls > 1 else torch.tanh(h)


class LaterRReLUSameCount(LaterRReLU):
    """Ends in ``tanh(h) ** 2`` at its first call and in RReLU from the second on: both paths save three tensors, so
    that only what the path ends in tells them apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        return self.act(h) if self.calls > 1 else torch.tanh(h).pow(2)


class LaterRReLUScaled(LaterRReLU):
    """``tanh(h) ** 2 * 2`` at its first call, ``rrelu(h) * 2`` from the second on: both save two tensors after the
    input layer's and end in the same op, so that only the ops each records tell them apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        return (self.act(h) if self.calls > 1 else torch.tanh(h).pow(2)) * 2


class RReLUOrder(nn.Module):
    """``tanh(rrelu(h))`` or ``rrelu(tanh(h))`` as its flag says: both save four tensors, RReLU's ``noise`` (filled
    late) at another position in each."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.act = nn.RReLU()
        self.rrelu_first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return torch.tanh(self.act(h)) if self.rrelu_first else self.act(torch.tanh(h))


class RReLUOrLogSigmoid(nn.Module):
    """Runs ``x + rrelu(linear(x))`` or ``x + logsigmoid(other_linear(x))`` as its flag says (a LayerDrop between two
    like-shaped layers): both paths save as many tensors, make as many autograd nodes and end in the same op."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.rrelu = nn.Linear(WIDTH, WIDTH), nn.RReLU()
        self.second, self.logsigmoid = nn.Linear(WIDTH, WIDTH), nn.LogSigmoid()
        self.rrelu_first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rrelu_first:
            return x + self.rrelu(self.first(x))
        return x + self.logsigmoid(self.second(x))


class LaterLSTM(nn.Module):
    """A linear layer at its first call, an LSTM from the second on."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.rnn = Recurrent(nn.LSTM(WIDTH, WIDTH, batch_first=True))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.inp(x))
        return self.rnn(h) if self.calls > 1 else h


class LazyCounter(nn.Module):
    """Creates its call counter at its first call, and scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return torch.tanh(self.inp(x) * (1.0 + 0.1 * self.calls))


class NormOnSomeCalls(nn.Module):
    """A linear layer, then BatchNorm over (batch, sequence) unless ``skip`` is set: a path that does not reach the
    norm's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if not self.skip:
            h = self.norm(h.flatten(0, 1)).view_as(h)
        return torch.tanh(h)


class LazyAverage(nn.Module):
    """Subtracts a moving average of its features, a buffer registered as ``None`` and sized at the first call in
    training, updated in place at every later one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("average", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            mean = h.mean((0, 1))
            if self.average is None:
                self.average = mean.clone()
            else:
                self.average.mul_(0.9).add_(0.1 * mean)
        return torch.tanh(h - self.average)


class RegisteredAverage(LazyAverage):
    """:class:`LazyAverage` registering its buffer at its first call (``register_buffer`` in forward), not as ``None``
    beforehand."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "average"):
            self.register_buffer("average", None)
        return super().forward(x)


class WarmedUpScale(nn.Module):
    """A scale it leaves alone for two calls and halves at every call after: an attribute that starts changing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 2:
            self.scale = self.scale * 0.5
        return torch.tanh(self.inp(x) * self.scale)


class LazyGenerator(nn.Module):
    """Creates the ``torch.Generator`` it draws noise from at its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "noise"):
            self.noise = torch.Generator().manual_seed(3)
        h = self.inp(x)
        return torch.tanh(h * (1 + torch.rand(h.shape, generator=self.noise)))


class FlaggedRReLU(nn.Module):
    """Ends in a functional RReLU whose ``training`` argument is a plain attribute, not the module's mode."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rrelu(self.inp(x), training=self.noisy)


def twins(
    build: Callable[[], nn.Module], tier: str, before: Callable[[nn.Module, int], object] = lambda model, step: None
) -> Trial:
    """``STEPS`` steps of ``build()`` and its copy with the model's ``body`` checkpointed, the check before each."""
    return trial(Case(build), tier, steps=STEPS, before=before)


def assert_exact(result: Trial) -> None:
    assert result.equal_steps == [True] * STEPS
    assert same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0, result.sentinel.regions
    assert result.sentinel.compared > 0
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None), report
        assert [region.cause for region in report.regions] == [None]


def training_from(step: int) -> Callable[[nn.Module, int], None]:
    """Eval mode (gradients on) before ``step``, training mode from it on."""
    return lambda model, at: model.train(at >= step)


def rrelu_first_from(step: int) -> Callable[[nn.Module, int], None]:
    """:class:`RReLUOrder`'s RReLU second before ``step``, first from it on."""
    return lambda model, at: setattr(model.body, "rrelu_first", at >= step)


def deterministic_twins(
    build: Callable[[], nn.Module], tier: str, before: Callable[[nn.Module, int], object] = lambda model, step: None
) -> Trial:
    """:func:`twins` under torch's deterministic algorithms, where uninitialised memory is NaN: a noise the
    recomputation does not fill shows."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return twins(build, tier, before)
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "later",
    [
        pytest.param(LaterRReLU, id="saving another number of tensors"),
        pytest.param(LaterRReLUSameCount, id="saving as many tensors"),
        # Only the ops each path records tell these two apart.
        pytest.param(LaterRReLUScaled, id="saving as many tensors and ending in the same op"),
    ],
)
def test_rrelu_last_only_from_the_second_call_recomputes_to_its_end(later: type[nn.Module], tier: str) -> None:
    assert_exact(deterministic_twins(lambda: Head(later()), tier))


@pytest.mark.parametrize("tier", TIERS)
def test_two_paths_saving_as_many_tensors_each_keep_their_own_filled_late_position(tier: str) -> None:
    # Learned from the first path only, the second's `noise` was digested when saved, before RReLU filled it: a
    # mismatch at every call of that path, while the gradients were exact.
    result = deterministic_twins(lambda: Head(RReLUOrder()), tier, rrelu_first_from(1))
    assert_exact(result)
    profiles = result.checkpointed.body.forward._profiles.values()
    assert sorted(sorted(profile.filled_late) for profile in profiles) == [[1], [2]]


def test_an_rrelu_path_that_looks_like_one_learned_without_it_still_trains_exactly() -> None:
    # The three counts cannot tell these paths apart; the RReLU in training mode makes every call recompute to its
    # end. (The sentinel, which digests on the learned path's positions, may still see the RReLU path's noise before
    # it is filled: docs/how-a-check-works.md says so.)
    result = deterministic_twins(lambda: Head(RReLUOrLogSigmoid()), "light", rrelu_first_from(2))
    assert result.equal_steps == [True] * STEPS
    assert same_state(result.plain, result.checkpointed)
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None), report
    assert len(result.checkpointed.body.forward._profiles) == 1  # one path, as far as the counts tell


@pytest.mark.parametrize("tier", TIERS)
def test_rrelu_last_first_called_in_eval_mode_recomputes_to_its_end_in_training(tier: str) -> None:
    assert_exact(deterministic_twins(lambda: Head(Around(nn.RReLU(), last=True)), tier, training_from(1)))


@pytest.mark.parametrize("tier", TIERS)
def test_rrelu_in_eval_mode_leaves_its_unwritten_noise_out(tier: str) -> None:
    result = twins(lambda: Head(Around(nn.RReLU())), tier, lambda model, step: model.eval())
    assert_exact(result)
    # Its noise, saved and never written in eval mode, is left out at every call: one per call, two calls a step
    # (the check's checkpointed pass and the training step's).
    assert result.sentinel.not_compared >= 2 * STEPS
    profile = result.checkpointed.body.forward.profile
    assert profile.unwritten == frozenset({1}) and profile.filled_late == frozenset()


def noisy_from(step: int) -> Callable[[nn.Module, int], None]:
    """:class:`FlaggedRReLU`'s flag off before ``step``, on from it on."""
    return lambda model, at: setattr(model.body, "noisy", at >= step)


@pytest.mark.parametrize("tier", TIERS)
def test_a_functional_rrelu_whose_training_flag_turns_on_after_the_profile_recomputes_to_its_end(tier: str) -> None:
    # The profile's key sees module modes, not this flag: the profile learned with the flag off had the noise as never
    # written, so the calls with it on stopped their recomputation before the noise was filled (gradients off by up
    # to 1e30, unseen by the sentinel, which leaves unwritten tensors out).
    result = deterministic_twins(lambda: Head(FlaggedRReLU(noisy=False)), tier, noisy_from(2))
    assert_exact(result)
    (profile,) = result.checkpointed.body.forward._profiles.values()
    assert (profile.mode_dependent, profile.unwritten, profile.filled_late) == (frozenset({1}),) * 2 + (frozenset(),)


@pytest.mark.parametrize("tier", TIERS)
def test_an_lstm_first_run_at_a_later_call_has_its_workspace_left_out(tier: str) -> None:
    result = twins(lambda: Head(LaterLSTM()), tier)
    assert_exact(result)
    assert len(result.checkpointed.body.forward.profile.workspaces) == 1


@pytest.mark.parametrize("tier", TIERS)
def test_batchnorm_first_called_in_eval_mode_updates_its_statistics_once_per_training_step(tier: str) -> None:
    result = twins(lambda: Head(Channels(nn.BatchNorm1d(6), 3)), tier, training_from(1))
    assert_exact(result)
    norm = result.checkpointed.body.layer
    assert int(norm.num_batches_tracked) == STEPS - 1


@pytest.mark.parametrize("tier", TIERS)
def test_batchnorm_whose_statistics_start_moving_after_a_warm_up_updates_them_once_per_step(tier: str) -> None:
    # Momentum 0 at the first call changes only the counter; BatchNorm's kernel updates the statistics from step 1 on
    # without a version bump.
    def warmed_up_from_step_1(model: nn.Module, step: int) -> None:
        model.body.layer.momentum = 0.1 if step >= 1 else 0.0

    result = twins(lambda: Head(Channels(nn.BatchNorm1d(6, momentum=0.0), 3)), tier, warmed_up_from_step_1)
    assert_exact(result)
    assert not torch.equal(result.checkpointed.body.layer.running_mean, torch.zeros(6))


@pytest.mark.parametrize("tier", TIERS)
def test_batchnorm_first_reached_on_a_later_path_updates_its_statistics_once_per_step(tier: str) -> None:
    def norm_from_step_1(model: nn.Module, step: int) -> None:
        model.body.skip = step == 0

    result = twins(lambda: Head(NormOnSomeCalls()), tier, norm_from_step_1)
    assert_exact(result)
    assert int(result.checkpointed.body.norm.num_batches_tracked) == STEPS - 1


@pytest.mark.parametrize("tier", TIERS)
def test_a_buffer_registered_as_none_and_created_at_the_first_call_is_replayed(tier: str) -> None:
    result = twins(lambda: Head(LazyAverage()), tier)
    assert_exact(result)
    assert result.checkpointed.body.average is not None


@pytest.mark.parametrize("tier", TIERS)
def test_a_buffer_registered_in_the_first_forward_is_protected_from_the_next_call_on(tier: str) -> None:
    result = twins(lambda: Head(RegisteredAverage()), tier)
    assert_exact(result)
    assert result.checkpointed.body.average is not None


@pytest.mark.parametrize("tier", TIERS)
def test_an_attribute_created_at_the_first_call_is_replayed(tier: str) -> None:
    result = twins(lambda: Head(LazyCounter()), tier)
    assert_exact(result)
    assert result.checkpointed.body.calls == result.plain.body.calls == STEPS


@pytest.mark.parametrize("tier", TIERS)
def test_an_attribute_that_starts_changing_after_a_warm_up_is_replayed_at_that_call(tier: str) -> None:
    result = twins(lambda: Head(WarmedUpScale()), tier)
    assert_exact(result)
    assert result.checkpointed.body.scale == result.plain.body.scale == 0.5 ** (STEPS - 2)


@pytest.mark.parametrize("tier", TIERS)
def test_a_generator_created_at_the_first_call_is_replayed(tier: str) -> None:
    result = twins(lambda: Head(LazyGenerator()), tier)
    assert_exact(result)


@pytest.mark.parametrize("tier", TIERS)
def test_a_generator_replaced_by_a_new_one_is_replayed(tier: str) -> None:
    def replace_generator(model: nn.Module, step: int) -> None:
        model.body.noise = torch.Generator().manual_seed(10 + step)

    result = twins(lambda: Head(HeldGenerator()), tier, replace_generator)
    assert_exact(result)


class EvalWarmUp(nn.Module):
    """Runs its inner layers in eval mode at its first ``warm_up`` calls (at every call with ``None``) and sets them
    back to training mode after, without ``try``/``finally``, as a warm-up is often written: a recomputation that
    stops after the region's last saved tensor (tanh's output in eval mode) stops before the switch back."""

    def __init__(self, warm_up: int | None = 1) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.25))
        self.warm_up = warm_up
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.warm_up is not None and self.calls > self.warm_up:
            return self.inner(x)
        self.inner.eval()
        out = self.inner(x)
        self.inner.train()
        return out


def flags_of(model: nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("warm_up", [1, None], ids=["at the first call", "at every call"])
def test_a_region_that_runs_layers_in_eval_mode_and_back_leaves_them_as_its_forward_did(
    tier: str, warm_up: int | None
) -> None:
    result = twins(lambda: Head(EvalWarmUp(warm_up)), tier)
    assert_exact(result)
    assert flags_of(result.checkpointed) == flags_of(result.plain) == [True] * 7


def test_a_region_recomputed_after_its_model_was_put_in_eval_mode_recomputes_in_the_forwards_mode() -> None:
    torch.manual_seed(0)
    plain = Head(Around(nn.Dropout(0.5)))
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, CheckpointingConfig(names=["body"]))
    gradients = []
    for model in (plain, checkpointed):
        seeded(0)
        loss = loss_of(model, tokens(0))
        model.eval()  # between the forward and the backward: the recomputation runs in training mode as the forward
        loss.backward()
        gradients.append([param.grad for param in model.parameters()])
        assert flags_of(model) == [False] * 6
    assert all(map(torch.equal, *gradients))


class HookedOnce(nn.Module):
    """Registers a forward hook that halves its activation's output at its first call, behind an attribute it
    creates then (as transformers installs its output-capturing hooks): the same output at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "hooked", False):
            self.act.register_forward_hook(lambda module, inputs, output: output * 0.5)
            self.hooked = True
        return x + self.act(self.inp(x))


@pytest.mark.parametrize("tier", TIERS)
def test_a_hook_registered_once_behind_an_attribute_the_forward_creates_is_registered_once(tier: str) -> None:
    result = twins(lambda: Head(HookedOnce()), tier)
    assert_exact(result)
    for model in (result.plain, result.checkpointed):
        assert len(model.body.act._forward_hooks) == 1


def save_2_tensors(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def save_3_tensors(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


class MoreInRecomputation(nn.Module):
    """torch's ``test_checkpoint_detects_non_determinism`` case as a module: its first run in a step saves two
    tensors, every later run (the recomputation) three, the first two of them the same."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs[0] += 1
        return save_2_tensors(x) if self.runs[0] == 1 else save_3_tensors(x)


@pytest.mark.parametrize("tier", TIERS)
def test_a_recomputation_that_saves_more_tensors_trains_as_under_torch_at_every_call(tier: str) -> None:
    torch.manual_seed(0)
    region = MoreInRecomputation()
    ours = nn.Sequential(MoreInRecomputation())
    apply_activation_checkpointing(ours, CheckpointingConfig(names=["0"]))
    with recomputation_sentinel(ours, mode=tier) as sentinel:  # type: ignore[arg-type]
        for step in range(STEPS):
            x = tokens(step).requires_grad_()
            expected = torch.autograd.grad(save_2_tensors(x).sum(), x)[0]
            region.runs[0] = ours[0].runs[0] = 0
            by_torch = torch.autograd.grad(checkpoint(region, x, use_reentrant=False).sum(), x)[0]
            got = torch.autograd.grad(ours(x).sum(), x)[0]
            # torch's early stop ends the recomputation once it saved as many tensors as the forward.
            assert ours[0].runs[0] == 2
            assert torch.equal(by_torch, expected) and torch.equal(got, expected)
            sentinel.next_step()
    report = sentinel.report()
    assert report.mismatches == 0
    assert report.compared >= (STEPS if tier == "light" else 2 * STEPS)


class CountingProbe(FirstForwardProbe):
    made = 0

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        CountingProbe.made += 1


def test_calls_like_a_learned_one_are_not_probed_and_each_kind_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrapper_module, "FirstForwardProbe", CountingProbe)
    CountingProbe.made = 0
    torch.manual_seed(0)
    model = Head(Channels(nn.BatchNorm1d(6), 3))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    for step in range(6):
        loss_of(model, tokens(step)).backward()
    assert CountingProbe.made == 1
    for step in range(6):
        model.train(step % 2 == 0)  # train and eval alternate: one profile each, both kept
        loss_of(model, tokens(step)).backward()
    assert CountingProbe.made == 2


def test_a_call_on_another_path_is_probed_at_the_next_call_of_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrapper_module, "FirstForwardProbe", CountingProbe)
    CountingProbe.made = 0
    torch.manual_seed(0)
    model = Head(LaterRReLU())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    wrapper = model.body.forward
    loss_of(model, tokens(0)).backward()
    assert (CountingProbe.made, wrapper.profile.filled_late) == (1, frozenset())
    loss_of(model, tokens(1)).backward()  # RReLU for the first time: a path no profile knows, recomputed to its end
    assert (CountingProbe.made, wrapper.profile) == (1, None)
    for step in range(2, 5):
        loss_of(model, tokens(step)).backward()
    assert (CountingProbe.made, wrapper.profile.filled_late) == (2, frozenset({1}))


class SkippedOrNoisy(nn.Module):
    """Passes its input through when ``skip`` is set (a LayerDrop-like branch chosen per call), and otherwise
    scales a tanh by host noise drawn in forward when ``noisy`` (a real defect: recomputation draws other noise), by
    a constant when not."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.noisy = noisy
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skip:
            return x * 1.0
        scale = float(np.random.rand()) if self.noisy else 0.5
        return x + torch.tanh(self.inp(x) * scale)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("noisy", [True, False], ids=["host noise", "exact"])
def test_a_branch_taken_every_other_call_is_compared_from_its_second_call_on(tier: str, noisy: bool) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    model = Head(SkippedOrNoisy(noisy))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    seen = []
    for step in range(12):
        model.body.skip = step % 2 == 0  # the branch that computes is taken every other call, never twice in a row
        with recomputation_sentinel(model, mode=tier) as sentinel:
            loss_of(model, tokens(step)).backward()
        if not model.body.skip:
            region = sentinel.report().regions["body"]
            seen.append((region.compared > 0, region.mismatches > 0))
    # Its first call takes a path the region has not learned; every later one is compared, and the noise seen.
    assert seen == [(False, False)] + [(True, noisy)] * 5


class BranchingCell(nn.Module):
    """A recurrent cell whose call at one timestep takes a branch of its own, scaled by NumPy's RNG when ``noisy``."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.noisy = noisy

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        if branch:
            x = torch.sigmoid(x) * (float(np.random.rand()) if self.noisy else 2.0)
        return x + torch.tanh(self.linear(x))


def _over_timesteps(
    cell: nn.Module, steps: int, tier: str, arguments: Callable[[int, int], dict[str, bool]]
) -> list[tuple[SentinelRegion, bool]]:
    """Train a plain twin of a linear layer then ``cell`` run over 20 timesteps (each call given ``arguments(step,
    timestep)``) beside a copy whose cell is checkpointed, under the sentinel; for each step, what the sentinel counted
    for the cell and whether the twins' gradients are equal."""
    torch.manual_seed(0)
    plain = nn.ModuleDict({"inp": nn.Linear(WIDTH, WIDTH), "cell": cell})
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["cell"]))
    results = []
    for step in range(steps):
        for net in (plain, model):
            np.random.seed(step)
            torch.manual_seed(1000 + step)
            net.zero_grad()
            with recomputation_sentinel(model, mode=tier) if net is model else contextlib.nullcontext() as sentinel:
                hidden = net["inp"](tokens(step))
                for timestep in range(20):
                    hidden = net["cell"](hidden, **arguments(step, timestep))
                hidden.square().mean().backward()
        equal = all(map(torch.equal, [p.grad for p in plain.parameters()], [p.grad for p in model.parameters()]))
        results.append((sentinel.report().regions["cell"], equal))
    return results


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("noisy", [True, False], ids=["host noise", "exact"])
def test_a_branch_one_timestep_of_each_pass_takes_is_compared_from_the_second_pass_on(tier: str, noisy: bool) -> None:
    # Its 19 other calls of each pass lie between two calls of the branch: more than probing the next calls reaches.
    results = _over_timesteps(BranchingCell(noisy), 4, tier, lambda step, timestep: {"branch": timestep == 5})
    # The noise makes the checkpointed gradients differ at every step; the sentinel compares the branch from the
    # second pass on, and sees the noise there (the light tier digests one drawn tensor of a call: at some steps).
    assert [not equal for _, equal in results] == [noisy] * 4
    assert [region.on_new_paths > 0 for region, _ in results] == [True, False, False, False]
    found = [region.mismatches > 0 for region, _ in results]
    assert found == [False] + [noisy] * 3 if tier != "light" else (found[0], any(found[1:])) == (False, noisy)


class RandomOnceACell(nn.Module):
    """A cell whose ``F.rrelu`` draws its noise at one timestep only (``noisy``), and which branches when told."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, branch: bool, noisy: bool) -> torch.Tensor:
        if branch:
            x = torch.sigmoid(x) * 2.0
        return x + F.rrelu(self.linear(x), training=noisy)


def test_a_call_probing_for_an_awaited_path_keeps_the_profile_of_the_known_path_it_takes() -> None:
    # The branch at timestep 5 of the first step is awaited there; the calls there probe for it, each taking the
    # known path with the noise drawn, which that path was learned without: its profile must stay as learned.
    results = _over_timesteps(
        RandomOnceACell(),
        5,
        "exact",
        lambda step, timestep: {"branch": step == 0 and timestep == 5, "noisy": timestep == 5},
    )
    assert [(region.mismatches, equal) for region, equal in results] == [(0, True)] * 5


class OneOrTwoStages(nn.Module):
    """Runs a first stage at every call and a second one unless ``skip`` is set: both paths save activations. When
    ``counted``, the second stage reads a counter kept in a dict, which recomputation does not replay (a real
    defect)."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.counted = counted
        self.state = {"calls": 0}
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        if not self.skip:
            self.state["calls"] += 1
            scale = 1 + 0.01 * self.state["calls"] if self.counted else 1.0
            hidden = torch.sigmoid(self.second(hidden * scale))
        return hidden * 2


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("counted", [True, False], ids=["dict counter", "exact"])
def test_paths_that_alternate_are_each_compared_at_their_own_last_activations(tier: str, counted: bool) -> None:
    # The light tier fixes a call's targets when it starts: after a call on another path than its layout's, each call
    # learns its own as it goes, so that the second stage's output, downstream of the defect, is compared.
    torch.manual_seed(0)
    plain = Head(OneOrTwoStages(counted))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    seen = []
    with recomputation_sentinel(model, mode=tier) as sentinel:
        for step in range(10):
            for twin in (plain, model):
                twin.body.skip = step % 2 == 0
                twin.zero_grad()
                loss_of(twin, tokens(step)).backward()
            grads = zip(plain.parameters(), model.parameters(), strict=True)
            exact = all(a.grad is b.grad is None or torch.equal(a.grad, b.grad) for a, b in grads)
            before = sum(found for found, _ in seen)
            seen.append((sentinel.report().mismatches - before, exact))
    # The twin: the full path's gradients differ at every call with the counter; the skipping path's never.
    assert [exact for _, exact in seen] == [True, not counted] * 5
    # The full path is new at step 1 (not compared); from its second call on, each defect is seen at its step.
    assert [found > 0 for found, _ in seen] == [False, False] + [False, counted] * 4


class ThreeWayCycle(nn.Module):
    """Takes one of three paths in turn, by its own call counter; the third scales its last op by a counter kept in a
    dict, which recomputation does not replay (a real defect), when ``counted``."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.counted = counted
        self.state = {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        if self.calls % 3 == 2:
            return x + torch.tanh(self.out(h))
        if self.calls % 3 == 1:
            return x + torch.sigmoid(self.out(torch.relu(h))) * torch.tanh(h)
        self.state["calls"] += 1
        scale = 1 + 0.01 * self.state["calls"] if self.counted else 1.0
        return x + torch.tanh(self.out(torch.sin(h)) * scale)  # only the last saved tensor differs


@pytest.mark.parametrize("counted", [True, False], ids=["dict counter", "exact"])
def test_a_probed_call_after_unwatched_steps_is_compared_at_its_own_last_activations_by_the_light_tier(
    counted: bool,
) -> None:
    # The sentinel pauses at every other step (`sentinel_every_n_steps=2`), so it misses the calls that change path:
    # a watched call the region probes starts with the layout of another path. It learns its own targets, so the light
    # tier flags the steps the exact tier flags, and compares something at each.
    found = {}
    for tier in ("light", "exact"):
        torch.manual_seed(0)
        model = Head(ThreeWayCycle(counted))
        apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
        seen = []
        with recomputation_sentinel(model, mode=tier) as sentinel:
            for step in range(12):
                before = sentinel.report()
                with sentinel.paused() if step % 2 else contextlib.nullcontext():
                    loss_of(model, tokens(step)).backward()
                after = sentinel.report()
                if step % 2 == 0:
                    seen.append((after.mismatches > before.mismatches, after.compared > before.compared))
        found[tier] = seen
    assert found["light"] == found["exact"]
    assert any(differed for differed, _ in found["exact"]) == counted


def test_a_region_whose_paths_settle_keeps_the_light_tiers_layout_again(monkeypatch: pytest.MonkeyPatch) -> None:
    handled = []
    save = RegionCall.save
    monkeypatch.setattr(RegionCall, "save", lambda call, *args: handled.append(1) or save(call, *args))
    torch.manual_seed(0)
    model = Head(OneOrTwoStages(counted=False))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))

    def tensors_handled(skips: list[bool]) -> list[int]:
        counts = []
        for step, skip in enumerate(skips):
            model.body.skip = skip
            handled.clear()
            loss_of(model, tokens(step)).backward()
            counts.append(len(handled))
        return counts

    with recomputation_sentinel(model, mode="light"):
        tensors_handled([False] * 2 + [True, False] * 4)  # both paths learned; the calls alternate
        alternating = tensors_handled([True, False])
        settled = tensors_handled([False] * 17)
    # Alternating calls hand the light tier every saved tensor (each learns its own targets); once the region took one
    # path for 16 calls in a row, its layout holds again, and the light tier handles its targets alone.
    full = settled[0]
    assert alternating[1] == full > 3
    assert settled[-1] <= 3


class ThreePaths(nn.Module):
    """Takes one of three code paths, chosen per call by ``path``: its input passed through, ``tanh``, or ``tanh``
    gated by ``sigmoid``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.path = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == 0:
            return x * 1.0
        hidden = self.inp(x)
        return x + (torch.tanh(hidden) if self.path == 1 else torch.tanh(hidden) * torch.sigmoid(hidden))


def test_a_path_seen_once_is_probed_for_eight_calls_then_half_as_long_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wrapper_module, "FirstForwardProbe", CountingProbe)
    CountingProbe.made = 0
    torch.manual_seed(0)
    model = Head(ThreePaths())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))

    def probes(paths: list[int]) -> int:
        before = CountingProbe.made
        for step, path in enumerate(paths):
            model.body.path = path
            loss_of(model, tokens(step)).backward()
        return CountingProbe.made - before

    assert probes([0, 1]) == 1  # the first call learns the passing path; the tanh one is new
    assert probes([0] * 12) == 8  # the calls after it probe for it, then give up
    assert probes([2] + [0] * 12) == 4  # the next new path is probed for half as long
    assert probes([1, 1]) == 1  # back: the call after the new one probes, takes it and learns it
    assert probes([2, 0, 2]) == 2  # the gated path again: probed for by the call after it, and learned as it returns
    assert probes([0, 1, 2] * 3) == 0  # every path known: no more probes
    assert len(model.body.forward._profiles) == 3


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_end_marker_recomputes_to_the_end_whatever_the_global_early_stop(early_stop: bool) -> None:
    torch.manual_seed(0)
    plain = Head(Around(nn.RReLU(), last=True))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            for step in range(3):
                grads = []
                for twin in (plain, model):
                    torch.manual_seed(step)
                    grads.append(torch.autograd.grad(loss_of(twin, tokens(step)), list(twin.parameters())))
                assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
                assert not any(grad.isnan().any() for grad in grads[1])
    finally:
        torch.use_deterministic_algorithms(deterministic)


class Cached(nn.Module):
    """Stores each call's activation on itself, rebinding ``last`` in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.last = torch.zeros(4, 6, WIDTH)  # an activation's size: its memory is not kept alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        self.last = h.detach().clone()
        return torch.tanh(h)


def test_a_tensor_attribute_a_forward_rebinds_keeps_the_forwards_value_and_the_old_one_is_not_held() -> None:
    torch.manual_seed(0)
    model = Head(Cached())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    old = weakref.ref(model.body.last)
    out = loss_of(model, tokens(0))
    assert old() is None  # not kept alive until the recomputation
    forward_value = model.body.last
    out.backward()
    # The recomputation rebound it too; the forward's value is put back after it, as without checkpointing.
    assert model.body.last is forward_value


class CachedLength(nn.Module):
    """Grows a scale buffer when a longer sequence comes (its length then kept as a 0-dim tensor, as transformers'
    dynamic RoPE keeps it) and resets both for a short one: what the forward does depends on the length held."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.limit: int | torch.Tensor = 4
        self.register_buffer("scale", torch.ones(WIDTH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = torch.tensor(x.shape[1])
        if length > self.limit:
            self.register_buffer("scale", torch.full((WIDTH,), 0.5), persistent=False)
            self.limit = length
        elif length < 4 < self.limit:
            self.register_buffer("scale", torch.ones(WIDTH), persistent=False)
            self.limit = 4
        return torch.tanh(self.inp(x) * self.scale)


@pytest.mark.parametrize("protect_buffers", [True, False])
def test_a_length_kept_as_a_small_tensor_is_replayed_with_the_buffer_it_decides(protect_buffers: bool) -> None:
    torch.manual_seed(0)
    plain = Head(CachedLength())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"], protect_buffers=protect_buffers))
    grown = model.body.limit
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for length in (6, 3, 6, 3):  # grown by an eval-free long step, then reset by a short one
            x = tokens(length)[:, :length]
            grads = [torch.autograd.grad(loss_of(twin, x), list(twin.parameters())) for twin in (plain, model)]
            assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
            assert sentinel.settle()["body"].mismatches == 0
            sentinel.next_step()
    assert grown == 4 and model.body.limit == plain.body.limit == 4
    assert torch.equal(model.body.scale, plain.body.scale)


class LateCount(nn.Module):
    """Counts its calls in a buffer, in place, from its second call on, and scales by the count: a buffer that starts
    changing after a warm-up, with nothing before the call to tell."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            self.count += 1
        return torch.tanh(self.inp(x) * self.count)


@pytest.mark.parametrize("tier", ["sampled", "exact"])
def test_a_buffer_first_changed_in_place_at_a_later_call_is_changed_once_and_that_call_recomputed_exactly(
    tier: str,
) -> None:
    torch.manual_seed(0)
    plain = Head(LateCount())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    equal, found = [], []
    with recomputation_sentinel(model, mode=tier) as sentinel:  # type: ignore[arg-type]
        for step in range(STEPS):
            x = tokens(step)
            grads = [torch.autograd.grad(loss_of(twin, x), list(twin.parameters())) for twin in (plain, model)]
            equal.append(all(torch.equal(a, b) for a, b in zip(*grads, strict=True)))
            found.append(sentinel.settle()["body"].mismatches)
            sentinel.next_step()
            # Changed once per call, as without checkpointing, the call that changed it first included.
            assert float(model.body.count) == float(plain.body.count) == max(1, step + 1)
    # The buffer is small: copied as each call starts until it is known to change, so the call that first changes it
    # is recomputed from the value it started from, and the sentinel finds nothing. From the next call on it is
    # replayed as learned.
    assert equal == [True, True, True, True]
    assert found == [0, 0, 0, 0]


class CalledTwice(nn.Module):
    """Its ``body`` called twice a step after a linear layer (whose gradient flows through the body's weights), as a
    GAN's discriminator on real and generated samples; ``temperatures``, where given, are set on the body before each
    call, as a caller sets a flag between two calls."""

    def __init__(self, body: nn.Module, temperatures: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.body = body
        self.head = nn.Linear(WIDTH, 1)
        self.temperatures = temperatures

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = []
        h = self.inp(x)
        for index, part in enumerate((h, h.flip(0))):
            if self.temperatures is not None:
                self.body.temperature = self.temperatures[index]
            halves.append(self.body(part))
        return self.head(halves[0] - 0.5 * halves[1])


class ScaledIfSet(nn.Module):
    """Scales by ``scale`` where its caller has set one (``getattr`` with a default)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x) * getattr(self, "scale", 1.0))


class CreatedBetweenCalls(CalledTwice):
    """Creates ``body.scale`` before the body's second call (the first call's recomputation must not read it), and
    deletes it when the step starts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vars(self.body).pop("scale", None)
        h = self.inp(x)
        first = self.body(h)
        self.body.scale = 3.0
        second = self.body(h.flip(0))
        return self.head(first - 0.5 * second)


class Tempered(nn.Module):
    """Divides by a temperature its caller sets (a plain float attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x) / self.temperature)


class HookScaled(nn.Module):
    """Scales by the last output's mean magnitude, which its own forward hook sets after each call: a hook runs
    outside the region's forward, before its recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.last = 0.0
        self.register_forward_hook(lambda module, args, out: setattr(module, "last", float(out.detach().abs().mean())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x) * (1 + self.last))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: CalledTwice(Tempered(), (1.0, 3.0)), id="a float the caller sets between calls"),
        pytest.param(lambda: CalledTwice(HookScaled()), id="a float the module's forward hook sets"),
        pytest.param(lambda: Head(HookScaled()), id="a float a forward hook sets, one call a step"),
        pytest.param(lambda: CreatedBetweenCalls(ScaledIfSet()), id="an attribute the caller creates between calls"),
    ],
)
def test_an_attribute_rebound_outside_the_forward_before_its_recomputation_is_replayed(
    tier: str, build: Callable[[], nn.Module]
) -> None:
    # Hooks run around the region's forward, not in it; recomputation must read what the forward read.
    assert_exact(twins(build, tier))


def test_an_attribute_rebound_after_the_forward_is_live_again_after_the_recomputation() -> None:
    torch.manual_seed(0)
    model = CalledTwice(Tempered(), (1.0, 3.0))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    read = []
    model.body.inp.register_forward_hook(lambda module, args, out: read.append(model.body.temperature))
    loss_of(model, tokens(0)).backward()
    assert read == [1.0, 3.0, 3.0, 1.0]  # each recomputation read its own forward's; backward runs the second first
    assert model.body.temperature == 3.0


def test_a_tensor_a_shared_block_stores_at_each_call_is_not_held_for_its_recomputations() -> None:
    # An activation a forward stores on its module (for logging), at each call of a block shared by two calls: the
    # first call's must not stay alive until backward, which would undo what checkpointing saves.
    torch.manual_seed(0)
    plain = CalledTwice(Cached())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    stored: list[weakref.ref[torch.Tensor]] = []
    model.body.register_forward_hook(lambda module, args, out: stored.append(weakref.ref(module.last)))
    loss = loss_of(model, tokens(0))
    assert stored[0]() is None and stored[1]() is model.body.last
    loss.backward()
    loss_of(plain, tokens(0)).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize("detached", [True, False], ids=["a detached copy", "the output itself"])
def test_a_tensor_a_hook_stores_on_a_shared_block_at_each_call_is_not_held_for_its_recomputations(
    detached: bool,
) -> None:
    # A forward hook of the region's module (outside its forward) storing each call's output, for logging or a
    # feature loss: plain training lets each go when the next call's hook rebinds it, and so must checkpointing.
    class Summed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(WIDTH * 4, WIDTH * 4), nn.Tanh())
            self.body.register_forward_hook(
                lambda module, args, out: setattr(module, "last", out.detach().clone() if detached else out)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(self.body(x + shift).sum() for shift in range(4))  # `sum` saves no output of the body

    torch.manual_seed(0)
    plain = Summed()
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = torch.randn(4, WIDTH * 4, generator=torch.Generator().manual_seed(0))  # 512 bytes an output
    alive = []
    for twin in (plain, model):
        stored: list[weakref.ref[torch.Tensor]] = []
        twin.body.register_forward_hook(
            lambda module, args, out, stored=stored: stored.append(weakref.ref(module.last))
        )
        loss = twin(x)
        alive.append([ref() is not None for ref in stored])
        loss.backward()
    assert alive == [[False, False, False, True]] * 2
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))


def test_a_sparse_tensor_held_as_an_attribute_is_left_alone() -> None:
    class Graph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.adjacency = torch.eye(4).to_sparse()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(torch.sparse.mm(self.adjacency, self.inp(x)))

    torch.manual_seed(0)
    plain = Head(Graph())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)[:, 0]
    for twin in (plain, model):
        loss_of(twin, x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))


def test_a_weight_a_pre_hook_sets_before_each_of_two_calls_is_read_anew_and_the_sentinel_sees_it() -> None:
    # Old-style spectral norm on a layer that is itself the region, called twice a step: its pre-hook (outside the
    # region) sets a weight-sized tensor before each call, which is not kept alive for the first call's
    # recomputation (a larger value is not held: see `AttributeReplay`). That recomputation reads the second
    # call's weight, as under torch's own `checkpoint`; the sentinel counts it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        layer = nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH * 4))  # 1 KiB a weight
    torch.manual_seed(0)
    plain = CalledTwice(nn.Sequential(layer, nn.Linear(WIDTH * 4, WIDTH)))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body.0"]))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for twin in (plain, model):
            loss_of(twin, tokens(0)).backward()
    assert not all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    assert sentinel.report().regions["body.0"].mismatches > 0


def test_the_sentinel_names_the_call_of_a_region_called_once_a_timestep_whose_tensor_differed() -> None:
    # The branch at timestep 5 draws NumPy noise: from the second pass on, its call is compared and differs.
    _, (region, equal) = _over_timesteps(
        BranchingCell(True), 2, "exact", lambda step, timestep: {"branch": timestep == 5}
    )
    assert not equal and region.mismatches > 0 and region.first_mismatch is not None
    assert region.first_mismatch.endswith(", at the region's call 5 (from 0) of its forward pass")


class NoisyGenerator(nn.Module):
    """A generator whose output is scaled by NumPy's RNG: its recomputation differs (a real defect)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(z) * float(np.random.rand()))


def test_a_call_never_backpropagated_leaves_the_next_steps_calls_named_as_they_are() -> None:
    # Lightning's GAN example: per step the generator runs for logging (never backpropagated), for its own loss
    # (backpropagated: the only call recomputed) and detached for the discriminator's loss.
    torch.manual_seed(0)
    np.random.seed(0)
    model = nn.ModuleDict({"generator": NoisyGenerator(), "discriminator": nn.Linear(WIDTH, 1)})
    apply_activation_checkpointing(model, CheckpointingConfig(names=["generator"]))
    firsts = []
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for step in range(3):
            z = tokens(step)
            model["generator"](z)
            model["discriminator"](model["generator"](z)).mean().backward()
            model["discriminator"](model["generator"](z).detach()).mean().backward()
            firsts.append(sentinel.settle()["generator"].first_mismatch)
    assert [
        first is not None and first.endswith("at the region's call 1 (from 0) of its forward pass") for first in firsts
    ] == [True] * 3
