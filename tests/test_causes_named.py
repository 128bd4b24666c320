"""Causes that name what happened, each held against a plain twin (the same weights and seeds, trained side by side):
a parameter written in place in forward is ``parameter_write``, and only when its values changed; every buffer of
running statistics is ``buffer_mutation``; a torchmetrics metric updated inside a region is ``metric_update``."""

import copy
import gc
import itertools
import math
import random
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, get_args

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    RecomputationReport,
    SentinelReport,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
    checkpointing_disabled,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify.attribution import observer as observer_module
from lightning_ckpt_determinism.verify.attribution.evidence import Divergence
from lightning_ckpt_determinism.verify.attribution.observer import Attribution
from lightning_ckpt_determinism.verify.attribution.region_cause import evidence_cause
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.digest import DigestTier
from lightning_ckpt_determinism.verify.reports import (
    HOST_RNG_STREAM_HINT,
    INPUT_CHANGED_HINT,
    SUBSTITUTED_PARAMETERS_HINT,
    TORCH_RNG_STREAM_HINT,
    UNREPLAYED_GENERATOR_HINT,
)
from lightning_ckpt_determinism.verify.state import named_metrics
from tests.helpers import DIM, PlainBlock, trainer_kwargs, twins
from tests.test_verdicts import (
    STEPS,
    WIDTH,
    Around,
    Case,
    Channels,
    Head,
    MaxNormEmbedding,
    loss_of,
    same_state,
    tokens,
    trial,
)

MODES = get_args(DigestTier)


class Decay(nn.Module):
    """Decays a gain parameter in place in forward, under ``no_grad``, then scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.alpha = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.alpha.mul_(0.9)
        return torch.tanh(self.inp(x) * self.alpha)


class DecayUnread(nn.Module):
    """Decays a parameter in place in forward, under ``no_grad``, and never reads it: only the write differs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.unread = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.unread.mul_(0.9)
        return torch.tanh(self.inp(x))


class SmallRows(MaxNormEmbedding):
    """An embedding with ``max_norm`` whose rows all start well within it: no renormalisation changes a value."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.table.weight.mul_(0.01)


class Mean(torchmetrics.Metric):
    """A mean with states named the same in every torchmetrics version (``MeanMetric``'s were renamed in 1.x)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("weight", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor) -> None:
        self.total += value
        self.weight += 1

    def compute(self) -> torch.Tensor:
        return self.total / self.weight


class Metered(nn.Module):
    """Updates a torchmetrics mean of its input in forward, before the ops whose outputs backward needs; the metric
    held as a submodule, or in a plain dict or list (not registered)."""

    def __init__(self, held: str = "submodule") -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        if held == "submodule":
            self.seen = Mean()
        else:
            self.metrics = {"seen": Mean()} if held == "dict" else [Mean()]

    def metric(self) -> Mean:
        return self.seen if hasattr(self, "seen") else self.metrics["seen" if isinstance(self.metrics, dict) else 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.metric().update(x.abs().mean())
        return torch.tanh(self.inp(x))


def named(report: RecomputationReport) -> list[tuple[str, str | None, str | None]]:
    return [(region.name, region.cause, region.hint) for region in report.regions if region.cause is not None]


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_decayed_in_forward_is_a_parameter_write_not_outside_state(mode: str) -> None:
    result = trial(Case(lambda: Head(Decay())), mode)
    # Ground truth: the twin decays once per step, the checkpointed copy reads and writes the decayed gain again.
    assert not result.gradients_equal
    assert not same_state(result.plain, result.checkpointed)
    assert result.sentinel.regions["body"].mismatches > 0
    for report in result.checks:
        assert report.diverged and report.cause is None
        ((region, cause, hint),) = named(report)
        assert (region, cause) == ("body", "parameter_write")
        assert hint is not None and hint.endswith("Written: body.alpha.")


@pytest.mark.parametrize("mode", MODES)
def test_the_sentinel_counts_each_recomputed_write_that_changed_values(mode: str) -> None:
    result = trial(Case(lambda: Head(DecayUnread())), mode)
    # Ground truth: the gradients agree, and the checkpointed copy decays the parameter more often than the twin,
    # which decays it once per step.
    once_per_step = torch.ones(WIDTH)
    for _ in range(STEPS):
        once_per_step.mul_(0.9)
    assert result.gradients_equal
    assert torch.equal(result.plain.body.unread, once_per_step)
    assert bool((result.checkpointed.body.unread < once_per_step).all())
    found = result.sentinel.regions["body"]
    # One recomputation a step in training, one in the check's checkpointed pass: the write, and nothing else.
    assert (found.mismatches, found.first_mismatch, found.cause) == (
        2 * STEPS,
        "parameter `body.unread` written in place by recomputation",
        "parameter_write",
    )
    for report in result.checks:
        assert [(region, cause) for region, cause, _ in named(report)] == [("body", "parameter_write")]


def test_a_decay_the_check_puts_back_is_named_by_the_recomputation_that_reads_it() -> None:
    # As the monitor checks once it learned the write: the gain's value is captured and put back before each pass,
    # so both passes compute the same loss, and the recomputation alone differs.
    torch.manual_seed(0)
    model = Head(Decay())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)
    before = model.body.alpha.detach().clone()
    report = check_recomputation(
        model, lambda: F.mse_loss(model(x), torch.zeros(4, 6, 1)), attribution=True, written_parameters=["body.alpha"]
    )
    assert report.reference_loss == report.checkpointed_loss
    assert report.diverged and report.cause is None
    assert [(region, cause) for region, cause, _ in named(report)] == [("body", "parameter_write")]
    assert report.regions[0].first_divergent_op == ("aten.mul_.Tensor", 0)
    assert torch.equal(model.body.alpha, before)


def maml_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A MAML step: one inner step on half the batch, then the loss of the other half through ``functional_call`` with
    the adapted weights."""
    params = dict(model.named_parameters())
    inner = functional_call(model, params, (x[:4],)).square().mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {name: param - 0.5 * grad for (name, param), grad in zip(params.items(), grads, strict=True)}
    return functional_call(model, fast, (x[4:],)).square().mean()


def test_weights_substituted_by_functional_call_are_named_and_the_fix_trains_as_the_plain_twin() -> None:
    plain, model = twins(lambda: nn.Sequential(PlainBlock(), nn.Linear(DIM, 1)), ["0"])
    x = torch.randn(8, DIM)
    expected = torch.autograd.grad(maml_loss(plain, x), list(plain.parameters()))
    got = torch.autograd.grad(maml_loss(model, x), list(model.parameters()))
    # Recomputation reads the module's own weights, not the adapted ones: wrong gradients, as under torch's checkpoint.
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    report = check_recomputation(model, lambda: maml_loss(model, x), attribution=True)
    (region,) = report.regions
    assert (report.diverged, region.cause) == (True, "parameter_write")
    assert region.hint == f"{SUBSTITUTED_PARAMETERS_HINT} Substituted: 0.linear.bias, 0.linear.weight."
    # The hint's fix: the call with substituted weights runs plainly.
    with checkpointing_disabled():
        fixed = torch.autograd.grad(maml_loss(model, x), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, fixed, strict=True))


def test_the_recomputed_renorm_of_the_zoo_embedding_writes_the_values_it_found() -> None:
    # With torch's own checkpoint: the forward renormalises the rows it looks up, and the recomputation's renorm
    # in backward finds them within `max_norm` and leaves every bit as it was.
    torch.manual_seed(0)
    model = Head(MaxNormEmbedding())
    initial = model.body.table.weight.detach().clone()
    out = model.head(torch.utils.checkpoint.checkpoint(model.body, tokens(0), use_reentrant=False))
    after_forward = model.body.table.weight.detach().clone()
    version = model.body.table.weight._version
    out.sum().backward()
    assert not torch.equal(initial, after_forward)  # the forward's renorm changed rows
    assert model.body.table.weight._version > version  # the recomputation wrote the weight again
    assert torch.equal(model.body.table.weight, after_forward)  # with the same values


@pytest.mark.parametrize("build", [MaxNormEmbedding, SmallRows], ids=["renormalised in forward", "within max_norm"])
@pytest.mark.parametrize("mode", MODES)
def test_a_renorm_that_changes_no_value_is_no_finding(build: Callable[[], nn.Module], mode: str) -> None:
    result = trial(Case(lambda: Head(build())), mode)
    assert result.gradients_equal and same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0 and result.sentinel.compared > 0, result.sentinel.regions
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.cause) == (False, 0.0, None)
        assert named(report) == []


def _twin_steps(
    build: Callable[[], nn.Module], config: CheckpointingConfig, mode: str, steps: int = 2
) -> tuple[nn.Module, nn.Module, list[RecomputationReport], bool, SentinelReport]:
    """``steps`` SGD steps of a plain twin and its checkpointed copy under ``config``, the sentinel on the copy and
    the check (with attribution) before each step: both models, the checks, whether the gradients were equal, and
    the sentinel's report."""
    torch.manual_seed(0)
    plain = build()
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, config)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (plain, checkpointed)]
    checks, equal = [], True
    with recomputation_sentinel(checkpointed, mode=mode) as sentinel:  # type: ignore[arg-type]
        for step in range(steps):
            x = tokens(step)
            checks.append(
                check_recomputation(
                    checkpointed, lambda x=x: F.mse_loss(checkpointed(x), torch.zeros(4, 6, 1)), attribution=True
                )
            )
            grads = []
            for model, optimizer in zip((plain, checkpointed), optimizers, strict=True):
                optimizer.zero_grad()
                F.mse_loss(model(x), torch.zeros(4, 6, 1)).backward()
                grads.append([param.grad for param in model.parameters()])
                optimizer.step()
            equal &= all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
            sentinel.next_step()
    return plain, checkpointed, checks, equal, sentinel.report()


NORMS = {
    "BatchNorm1d": lambda: Channels(nn.BatchNorm1d(6), 3),
    "InstanceNorm1d": lambda: Channels(nn.InstanceNorm1d(6, affine=True, track_running_stats=True), 3),
    "InstanceNorm2d": lambda: Channels(nn.InstanceNorm2d(6, track_running_stats=True), 4),
    "InstanceNorm3d": lambda: Channels(nn.InstanceNorm3d(6, affine=True, track_running_stats=True), 5),
}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("mode", MODES)
def test_every_norm_with_running_statistics_is_a_buffer_mutation_without_protect_buffers(norm: str, mode: str) -> None:
    config = CheckpointingConfig(names=["body"], protect_buffers=False)
    plain, checkpointed, checks, equal, sentinel = _twin_steps(lambda: Head(NORMS[norm]()), config, mode)
    statistics = ["body.layer.running_mean", "body.layer.running_var"]
    # Ground truth: the gradients agree, the running statistics of the checkpointed copy moved twice per step.
    assert equal
    assert not all(torch.equal(plain.get_buffer(name), checkpointed.get_buffer(name)) for name in statistics)
    assert sentinel.mismatches > 0
    for report in checks:
        ((region, cause, hint),) = named(report)
        assert (region, cause) == ("body", "buffer_mutation")
        assert hint is not None and "running_mean" in hint
        assert set(statistics) <= set(report.buffer_mutations)


@pytest.mark.parametrize("norm", list(NORMS))
def test_every_norm_with_running_statistics_is_exact_with_protect_buffers(norm: str) -> None:
    plain, checkpointed, checks, equal, sentinel = _twin_steps(
        lambda: Head(NORMS[norm]()), CheckpointingConfig(names=["body"]), "exact"
    )
    assert equal and same_state(plain, checkpointed) and sentinel.mismatches == 0
    assert all(named(report) == [] and not report.diverged for report in checks)


METRICS_HELD = {"submodule": "body.seen", "dict": "body.metrics['seen']", "list": "body.metrics[0]"}


class _Unprintable:
    """A dict key whose ``repr`` fails."""

    def __repr__(self) -> str:
        raise AttributeError("no repr")


def test_metrics_in_containers_are_named_whatever_their_keys_and_long_containers_are_not_searched() -> None:
    body = Metered("dict")
    body.metrics = {_Unprintable(): body.metrics["seen"]}
    body.history = [Mean() for _ in range(65)]  # longer than a container searched for metrics (a log, not a state)
    assert [name for name, _ in named_metrics(body)] == ["metrics[<_Unprintable>]"]


@pytest.mark.parametrize("held", list(METRICS_HELD))
@pytest.mark.parametrize("mode", MODES)
def test_a_metric_updated_in_a_region_is_a_metric_update(mode: str, held: str) -> None:
    plain, checkpointed, checks, equal, sentinel = _twin_steps(
        lambda: Head(Metered(held)), CheckpointingConfig(names=["body"]), mode
    )
    # Ground truth: the gradients agree, and the checkpointed copy's metric counted every step twice.
    assert equal
    assert float(plain.body.metric().weight) == 2.0
    assert float(checkpointed.body.metric().weight) == 4.0
    # Both states (the weighted sum and the weight) at every recomputation: the check's and the training step's.
    found = sentinel.regions["body"]
    assert (found.mismatches, found.cause) == (2 * 2 * 2, "metric_update")
    assert found.first_mismatch == f"metric `{METRICS_HELD[held]}` (total) updated by recomputation"
    for report in checks:
        # The gradients agree, but the metric was updated again: the report diverged, as a plain twin has no such step.
        assert report.diverged and report.grad_divergence == 0.0
        ((region, cause, hint),) = named(report)
        assert (region, cause) == ("body", "metric_update")
        assert hint is not None and hint.endswith(f"Updated: {METRICS_HELD[held]}.")


def test_a_metric_update_is_put_back_by_the_check() -> None:
    torch.manual_seed(0)
    model = Head(Metered())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    model.body.seen.update(torch.tensor(5.0))
    report = check_recomputation(model, lambda: F.mse_loss(model(tokens(0)), torch.zeros(4, 6, 1)), attribution=True)
    assert named(report)[0][1] == "metric_update"
    assert (float(model.body.seen.total), float(model.body.seen.weight)) == (5.0, 1.0)


@pytest.mark.parametrize(
    ("parameter_input", "buffer_input", "random", "cause"),
    [
        (True, False, False, "parameter_write"),
        (False, True, False, "buffer_mutation"),
        (False, False, False, None),
        (True, True, True, "rng_not_preserved"),
    ],
)
def test_a_differing_op_that_read_changed_state_names_that_state(
    parameter_input: bool, buffer_input: bool, random: bool, cause: str | None
) -> None:
    divergence = Divergence(
        4,
        "aten.repeat.default",
        "values",
        random=random,
        same_inputs=False,
        buffer_input=buffer_input,
        parameter_input=parameter_input,
    )
    assert evidence_cause(divergence) == cause


class MeteredModule(pl.LightningModule):
    """A regression whose checkpointed ``body`` (by default) updates a torchmetrics metric in forward."""

    def __init__(self, body: Callable[[], nn.Module] = lambda: Metered()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Head(body())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.model(batch[0]), torch.zeros(batch[0].shape[0], 6, 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.cat([tokens(step) for step in range(4)])), batch_size=4)


def _fit(
    tmp_path: Path, monitor: RecomputationMonitor | None, body: Callable[[], nn.Module] = lambda: Metered()
) -> MeteredModule:
    module = MeteredModule(body)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.body"]))
    callbacks = [] if monitor is None else [monitor]
    pl.Trainer(**trainer_kwargs(tmp_path, max_steps=3, strategy=strategy, callbacks=callbacks)).fit(module)
    return module


def test_the_monitor_names_a_metric_update_that_changes_no_gradient_and_changes_nothing_itself(tmp_path: Path) -> None:
    unmonitored = _fit(tmp_path / "plain", None)
    monitor = RecomputationMonitor(every_n_steps=50)
    with pytest.warns(LightningCkptDeterminismWarning, match="^lightning_ckpt_determinism: ") as warned:
        monitored = _fit(tmp_path / "monitored", monitor)
    messages = [str(warning.message) for warning in warned]
    assert any("Cause metric_update" in message for message in messages)  # the sentinel's, at step 0
    assert any("`model.body` updated a torchmetrics metric a second time" in message for message in messages)
    # The live check at step 0 compares gradients, buffers and attributes: all agree. The sentinel sees the metric's
    # states move in recomputation, and the follow-up check it asks for names the region and the cause.
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (1, True)]
    report = monitor.sentinel_report
    assert report is not None and report.regions["model.body"].cause == "metric_update"
    # The checks put the metric back: the monitored run's metric and weights are those of the run without it.
    assert float(monitored.model.body.seen.weight) == float(unmonitored.model.body.seen.weight) == 6.0
    assert same_state(monitored.model, unmonitored.model)


class QuantizedBlock(nn.Module):
    """A linear layer and ReLU with a residual, prepared for quantization-aware training: its fake-quantize modules
    update their observers' statistics (buffers) in forward, in one fused op by default."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear(x)) + 0.5 * x


def _quantization_aware(protect_buffers: bool) -> tuple[nn.Module, nn.Module]:
    """A model with a :class:`QuantizedBlock` prepared for QAT (the default, fused, fake-quantize), and its plain twin
    without checkpointing."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), QuantizedBlock(), nn.Linear(16, 4)).train()
    plain.qconfig = quantization.get_default_qat_qconfig("x86")  # type: ignore[assignment]
    quantization.prepare_qat(plain, inplace=True)
    model = copy.deepcopy(plain)
    config = CheckpointingConfig(classes=["QuantizedBlock"], protect_buffers=protect_buffers)
    apply_activation_checkpointing(model, config)
    return model, plain


def test_observers_updated_again_by_a_fused_fake_quantize_are_a_buffer_mutation() -> None:
    model, _ = _quantization_aware(protect_buffers=False)
    for seed in range(2):  # the first step initialises the observers; the second shows the second update
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        report = check_recomputation(model, lambda x=x: model(x).square().mean(), attribution=True)
        model(x).square().mean().backward()
    [region] = report.regions
    assert report.diverged and region.cause == "buffer_mutation"
    assert region.hint is not None and "`protect_buffers=True`" in region.hint
    assert "1.linear.activation_post_process.scale" in region.buffer_mutations


def test_quantization_aware_training_with_protected_buffers_trains_as_the_plain_twin() -> None:
    model, plain = _quantization_aware(protect_buffers=True)
    for seed in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        grads = []
        for net in (plain, model):
            net.zero_grad()
            net(x).square().mean().backward()
            grads.append([param.grad for param in net.parameters()] + list(net.buffers()))
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class CountsAfterItsNorm(nn.Module):
    """A BatchNorm, then a product by how many times the forward ran, counted in a list (Python state the region does
    not replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        return torch.tanh(self.norm(self.linear(x)) * float(len(self.calls)))


@pytest.mark.parametrize("protect_buffers", [False, True])
def test_python_state_read_after_a_norm_that_updates_its_statistics_again_is_python_state(
    protect_buffers: bool,
) -> None:
    # The norm's output is the same at recomputation (batch statistics in training); the product differs through the
    # count alone: setting `protect_buffers` would not help, and the cause must not say it would.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), CountsAfterItsNorm(), nn.Linear(8, 1)).train()
    apply_activation_checkpointing(
        model, CheckpointingConfig(classes=["CountsAfterItsNorm"], protect_buffers=protect_buffers)
    )
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    report = check_recomputation(model, lambda: model(x).square().mean(), attribution=True)
    [region] = report.regions
    assert report.diverged and region.cause == "python_state"
    assert region.first_divergent_op is not None and region.first_divergent_op[0] == "aten.mul.Tensor"


class NumpyScaled(nn.Module):
    """Its last op scales by a fresh NumPy draw: the product saves the drawn tensor as its input, and torch's early
    stop ends the recomputation right there, before the product runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x)) * torch.from_numpy(np.random.rand(WIDTH).astype(np.float32))


class AttributeScaled(nn.Module):
    """Its last op scales by a tensor attribute, larger than the attributes a region replays (see
    `AttributeReplay`), which its caller rebinds between the forward and the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.scale = torch.ones(4, 6, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x)) * self.scale


def _saved_tensor_check(
    body: nn.Module, *, rebind: bool = False, preserve_host_rng: bool = False, preserve_rng_state: bool = True
) -> tuple[RecomputationReport, float]:
    """A check of ``Head(body)`` with attribution, then how far the checkpointed model's gradients of the same step
    are from a plain twin's (relative L2), each step from NumPy's same seed, rebinding ``body.scale`` after the
    forward when ``rebind``."""
    torch.manual_seed(0)
    plain = Head(body)
    model = copy.deepcopy(plain)
    config = CheckpointingConfig(
        names=["body"], preserve_host_rng=preserve_host_rng, preserve_rng_state=preserve_rng_state
    )
    apply_activation_checkpointing(model, config)
    x = tokens(0)

    def step_loss(of: nn.Module) -> torch.Tensor:
        np.random.seed(0)
        if rebind:
            of.body.scale = torch.ones(4, 6, WIDTH)
        value = loss_of(of, x)
        if rebind:
            of.body.scale = torch.full((4, 6, WIDTH), 2.0)
        return value

    report = check_recomputation(model, lambda: step_loss(model), attribution=True)
    grads = []
    for of in (plain, model):
        of.zero_grad()
        step_loss(of).backward()
        grads.append(torch.cat([param.grad.flatten() for param in of.parameters()]))
    return report, float((grads[1] - grads[0]).norm() / grads[0].norm())


def test_a_fresh_numpy_tensor_read_where_torch_stops_the_recomputation_is_named_host_rng() -> None:
    report, from_twin = _saved_tensor_check(NumpyScaled())
    # Ground truth: the checkpointed gradients are not the plain twin's.
    assert from_twin > 0.01
    [region] = report.regions
    assert report.diverged and (region.name, region.cause, region.diverged) == ("body", "host_rng", True)
    # Every recomputed op matched; the product, where torch stopped, had saved the new draw as its input.
    assert region.first_divergent_op == ("aten.mul.Tensor", region.ops_compared)
    assert region.hint is not None and "Differs: the 3rd tensor the region saved" in region.hint
    assert region.max_abs_diff == math.inf


def test_the_numpy_draw_replayed_is_exact_and_names_nothing() -> None:
    report, from_twin = _saved_tensor_check(NumpyScaled(), preserve_host_rng=True)
    assert from_twin == 0.0
    assert not report.diverged and [region.cause for region in report.regions] == [None]


def test_a_tensor_attribute_rebound_before_backward_and_read_where_torch_stops_is_python_state() -> None:
    report, from_twin = _saved_tensor_check(AttributeScaled(), rebind=True)
    assert from_twin > 0.01
    [region] = report.regions
    assert report.diverged and (region.cause, region.first_divergent_op) == (
        "python_state",
        ("aten.mul.Tensor", region.ops_compared),
    )


def test_a_sentinel_of_the_caller_keeps_watching_the_checks_pass() -> None:
    torch.manual_seed(0)
    model = Head(NumpyScaled())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)
    with recomputation_sentinel(model, mode="exact") as sentinel:
        report = check_recomputation(model, lambda: loss_of(model, x), attribution=True)
    # The caller's sentinel saw the check's checkpointed pass, as it would without attribution: attribution then has
    # no sentinel of its own, and does not name the region by its saved tensor. It names it by the NumPy stream its
    # recomputation drew from again, which the check compares after the passes.
    assert sentinel.report().regions["body"].mismatches == 1
    assert report.diverged and [(region.cause, region.first_divergent_op) for region in report.regions] == [
        ("host_rng", None)
    ]


def test_the_monitor_names_the_numpy_draw_read_where_torch_stops_the_recomputation(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    np.random.seed(0)
    _fit(tmp_path, monitor, NumpyScaled)
    assert [entry.diverged for entry in monitor.history] == [True] * 3
    report = monitor.last_report
    assert report is not None
    assert [(region.name, region.cause) for region in report.regions if region.diverged] == [("model.body", "host_rng")]


class GainLast(nn.Module):
    """Linear, tanh, then a gain parameter read by the region's last op (where torch's early stop ends the
    recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x)) * self.gain


def test_a_substituted_weight_read_where_torch_stops_the_recomputation_is_a_parameter_write() -> None:
    plain, model = twins(lambda: nn.Sequential(GainLast(), nn.Linear(DIM, 1)), ["0"])
    x = torch.randn(8, DIM)

    def adapted_gain(of: nn.Module) -> torch.Tensor:
        """`maml_loss` with only the gain adapted: every op before the product reads the module's own weights."""
        params = dict(of.named_parameters())
        inner = functional_call(of, params, (x[:4],)).square().mean()
        (grad,) = torch.autograd.grad(inner, [params["0.gain"]], create_graph=True)
        return functional_call(of, {"0.gain": params["0.gain"] - 0.5 * grad}, (x[4:],)).square().mean()

    expected = torch.autograd.grad(adapted_gain(plain), list(plain.parameters()))
    got = torch.autograd.grad(adapted_gain(model), list(model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    report = check_recomputation(model, lambda: adapted_gain(model), attribution=True)
    (region,) = report.regions
    # The region's second call, with the adapted gain, at its product (after t, addmm and tanh).
    assert (report.diverged, region.cause, region.first_divergent_op) == (
        True,
        "parameter_write",
        ("aten.mul.Tensor", 3),
    )
    assert region.hint is not None and region.hint.startswith(f"{SUBSTITUTED_PARAMETERS_HINT} Substituted: 0.gain.")


def test_a_sentinel_of_the_caller_on_another_region_leaves_this_one_compared() -> None:
    torch.manual_seed(0)
    model = Head(nn.Sequential(nn.Linear(WIDTH, WIDTH), NumpyScaled()))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body.0", "body.1"]))
    x = tokens(0)
    with recomputation_sentinel(model.body[0], mode="exact") as sentinel:
        report = check_recomputation(model, lambda: loss_of(model, x), attribution=True)
    assert sentinel.report().compared > 0
    assert report.diverged
    assert [(region.name, region.cause) for region in report.regions] == [("body.0", None), ("body.1", "host_rng")]


def test_attribution_whose_sentinel_cannot_be_built_compares_the_ops_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no sentinel")

    monkeypatch.setattr(observer_module, "RecomputationSentinel", broken)
    # A tensor attribute rebound before backward, read where torch stops: no recomputed op shows it (a NumPy draw
    # there would be named by the NumPy stream its recomputation moved).
    report, _ = _saved_tensor_check(AttributeScaled(), rebind=True)
    assert report.diverged and [region.cause for region in report.regions] == [None]
    report, _ = _saved_tensor_check(Around(nn.Dropout(0.3)), preserve_rng_state=False)
    assert [region.cause for region in report.regions] == ["rng_not_preserved"]


class NoisyLast(nn.Module):
    """No parameters: tanh, then a product by a fresh NumPy draw (the op where torch's early stop ends the
    recomputation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * torch.from_numpy(np.random.rand(x.shape[-1]).astype(np.float32))


class CalledTwice(nn.Module):
    """Calls ``noisy`` first on a constant (a call that saves nothing: nothing needs grad), then on its features."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.noisy = NoisyLast()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        constant = self.noisy(torch.ones(3, DIM))
        return self.noisy(self.inp(x)) + constant.sum()


class Recursive(nn.Module):
    """Calls itself once: the outer call's product reads a parameter, the inner call's a fresh NumPy draw."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if depth > 0:
            return (h * self.gain).exp() + self(h, depth - 1)
        return h * torch.from_numpy(np.random.rand(DIM).astype(np.float32))


def _noisy_check(
    build: Callable[[], nn.Module], names: list[str], loss: Callable[[nn.Module], torch.Tensor]
) -> tuple[RecomputationReport, bool]:
    """A check with attribution of ``build()``, its regions ``names``, and whether its gradients equal a plain
    twin's, each pass from NumPy's same seed."""
    plain, model = twins(lambda: nn.Sequential(build(), nn.Linear(DIM, 1)), names)

    def seeded_loss(of: nn.Module) -> torch.Tensor:
        np.random.seed(0)
        return loss(of)

    expected = torch.autograd.grad(seeded_loss(plain), list(plain.parameters()))
    got = torch.autograd.grad(seeded_loss(model), list(model.parameters()))
    report = check_recomputation(model, lambda: seeded_loss(model), attribution=True)
    return report, all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


X = torch.randn(8, DIM, generator=torch.Generator().manual_seed(3))


def test_a_saved_tensor_difference_goes_to_its_call_after_a_call_that_saved_nothing() -> None:
    report, equal = _noisy_check(CalledTwice, ["0.noisy"], lambda of: of(X).square().mean())
    assert not equal
    [region] = report.regions
    # The second call, at its product (after tanh and the draw's lift); the first saved nothing and is not blamed.
    assert (region.cause, region.diverged, region.first_divergent_op) == ("host_rng", True, ("aten.mul.Tensor", 2))


def test_a_host_rng_draw_in_a_call_with_substituted_weights_of_equal_values_is_host_rng() -> None:
    def cloned_weights(of: nn.Module) -> torch.Tensor:
        """A `functional_call` whose weights are clones: the values the module holds."""
        params = {name: param.clone() for name, param in of.named_parameters()}
        return functional_call(of, params, (X,)).square().mean()

    report, equal = _noisy_check(lambda: nn.Sequential(nn.Linear(DIM, DIM), NoisyLast()), ["0"], cloned_weights)
    assert not equal
    [region] = report.regions
    assert (region.cause, region.first_divergent_op) == ("host_rng", ("aten.mul.Tensor", 4))


@pytest.mark.filterwarnings("ignore:.*have another activation checkpointing inside them")
def test_a_recursive_region_is_blamed_at_the_call_whose_tensor_differed() -> None:
    report, equal = _noisy_check(Recursive, ["0"], lambda of: of(X).square().mean())
    assert not equal
    [region] = report.regions
    # The inner call's product (t, addmm, tanh, the draw's lift, mul), not the outer call's op at the same place.
    assert (region.cause, region.first_divergent_op) == ("host_rng", ("aten.mul.Tensor", 4))


class TwiceUnderAutocast(nn.Module):
    """Calls its region ``body`` twice inside one ``bfloat16`` autocast context, then, with ``noisy``, a region
    ``noise`` that scales by a NumPy draw (:class:`NumpyScaled`)."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.body = Around(nn.Tanh())
        self.noise = NumpyScaled() if noisy else None
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.body(x) + self.body(x * 0.5)
            if self.noise is not None:
                h = self.noise(h)
            return self.head(h).float().pow(2).mean()


@pytest.mark.parametrize("noisy", [False, True])
def test_a_region_called_twice_under_one_autocast_context_is_no_finding(noisy: bool) -> None:
    # Autocast casts the weights once per context: the second call takes them from its cache, its recomputation (in
    # a fresh context) casts them again. The gradients are exact; attribution must line the two up.
    torch.manual_seed(0)
    plain = TwiceUnderAutocast(noisy)
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body", "noise"] if noisy else ["body"]))
    x = tokens(0)
    if not noisy:
        for twin in (plain, model):
            twin(x).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
        model.zero_grad()
    report = check_recomputation(model, lambda: model(x), attribution=True)
    body = next(region for region in report.regions if region.name == "body")
    assert (body.diverged, body.cause, body.first_divergent_op, body.error) == (False, None, None, None)
    assert report.diverged is noisy
    if noisy:
        assert [(region.name, region.cause) for region in report.regions if region.diverged] == [("noise", "host_rng")]


class Reseeding(nn.Module):
    """Seeds NumPy's global RNG and draws a permutation of its features from it, as BigBird's block-sparse attention
    does in training: its recomputation draws the same values, and leaves NumPy's stream where the forward did."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.seed = seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        np.random.seed(self.seed)
        return torch.tanh(self.inp(x))[..., torch.from_numpy(np.random.permutation(WIDTH))]


class Reseeded(nn.Module):
    """Two :class:`Reseeding` regions; the loss reads a NumPy draw made after them, as a next step's masking would."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Reseeding(0), Reseeding(1)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x))).pow(2).mean()


@pytest.mark.parametrize("preserve_host_rng", [False, True])
def test_a_region_that_seeds_numpy_and_draws_leaves_its_stream_otherwise_and_is_named(preserve_host_rng: bool) -> None:
    torch.manual_seed(0)
    plain = Reseeded()
    model = copy.deepcopy(plain)
    config = CheckpointingConfig(names=["first", "second"], preserve_host_rng=preserve_host_rng)
    apply_activation_checkpointing(model, config)
    states = []
    for twin in (plain, model):
        np.random.seed(5)
        twin(tokens(0)).backward()
        states.append(np.random.get_state()[1].copy())
    # The gradients agree; what draws from NumPy next does not, unless recomputation replays its stream.
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    assert np.array_equal(*states) is preserve_host_rng
    x = tokens(1)
    for attribution in (False, True):
        np.random.seed(7)  # as a step's masking leaves it: not where a region's own seed puts it
        report = check_recomputation(model, lambda: model(x), attribution=attribution)
        assert report.grad_divergence == 0.0
        if preserve_host_rng:
            assert (report.diverged, report.cause) == (False, None)
            assert all(region.cause is None for region in report.regions)
            continue
        assert (report.diverged, report.cause, report.hint) == (True, "host_rng", HOST_RNG_STREAM_HINT)
        if attribution:
            assert [(region.name, region.cause) for region in report.regions] == [
                ("first", "host_rng"),
                ("second", "host_rng"),
            ]


class ReseededModule(pl.LightningModule):
    """:class:`Reseeded`, its batches masked by a NumPy draw in ``training_step``; with ``hook_draws``, an
    ``on_before_backward`` that draws from NumPy too (which the check's reference pass does not run)."""

    def __init__(self, hook_draws: bool = False) -> None:
        super().__init__()
        self.model = Reseeded()
        self.hook_draws = hook_draws

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        mask = torch.from_numpy((np.random.rand(*x.shape) > 0.2).astype(np.float32))
        return self.model(x * mask)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.hook_draws:
            np.random.rand()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 6, WIDTH, generator=torch.Generator().manual_seed(1))), 8)


class Mixup(pl.Callback):
    """Draws from Python's and NumPy's streams around the backward (a mixup weight for the next batch): listed
    before the monitor, its `on_after_backward` runs before the monitor's check."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        random.random()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        np.random.beta(0.4, 0.4)


def _reseeded_fit(
    tmp_path: Path,
    strategy: object,
    monitor: RecomputationMonitor | None,
    hook_draws: bool = False,
    before: tuple[pl.Callback, ...] = (),
):
    pl.seed_everything(0, verbose=False)
    module = ReseededModule(hook_draws)
    callbacks = [*before] if monitor is None else [*before, monitor]
    pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=callbacks, max_steps=3)).fit(module)
    return {key: value.clone() for key, value in module.state_dict().items()}


def test_the_monitor_names_a_numpy_stream_recomputation_moved_and_the_fix_trains_as_the_plain_twin(
    tmp_path: Path,
) -> None:
    def strategy(preserve_host_rng: bool) -> SingleDeviceCheckpointingStrategy:
        config = CheckpointingConfig(classes=["Reseeding"], preserve_host_rng=preserve_host_rng)
        return SingleDeviceCheckpointingStrategy(checkpointing=config)

    plain = _reseeded_fit(tmp_path / "plain", "auto", None)
    broken = RecomputationMonitor(every_n_steps=1)
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        moved = _reseeded_fit(tmp_path / "broken", strategy(False), broken)
    said = [str(warning.message) for warning in caught if "recomputation drew" in str(warning.message)]
    assert re.match(
        r"lightning_ckpt_determinism: recomputation drew from the host's random streams at step 0: .* the gradients"
        r" are exact\. Region `model\.first` drew from the host's random streams again, cause host_rng: ",
        said[0],
    )
    assert broken.last_report is not None and broken.last_report.cause == "host_rng"
    assert any(not torch.equal(plain[key], moved[key]) for key in plain)  # the masks drawn next differed
    fixed = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    exact = _reseeded_fit(tmp_path / "fixed", strategy(True), fixed)
    assert all(torch.equal(plain[key], exact[key]) for key in plain)
    assert [record.diverged for record in fixed.history] == [False] * 3
    # Hooks around the backward that draw from the host's streams (the module's, a callback's listed before the
    # monitor) are not recomputation's doing.
    hooked = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    _reseeded_fit(tmp_path / "hooked", strategy(True), hooked, hook_draws=True)
    assert [record.diverged for record in hooked.history] == [False] * 3
    mixed = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    with pytest.warns(LightningCkptDeterminismWarning, match=r"`Mixup` run `on_after_backward` before"):
        _reseeded_fit(tmp_path / "mixed", strategy(True), mixed, before=(Mixup(),))
    assert [record.diverged for record in mixed.history] == [False] * 3


class RandomHalf(nn.Module):
    """Keeps a random half of its tokens, chosen by `argsort` of a torch draw (as ViTMAE masks patches): the draw
    reaches the gradients only through the indices `keep_data_dependent` keeps from the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = torch.argsort(torch.rand(x.shape[0], x.shape[1]), dim=1)[:, : x.shape[1] // 2]
        return torch.tanh(self.inp(torch.gather(x, 1, kept.unsqueeze(-1).expand(-1, -1, x.shape[-1]))))


class RandomlyMasked(nn.Module):
    """A :class:`RandomHalf` region and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = RandomHalf()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).pow(2).mean()


@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_a_draw_whose_result_recomputation_keeps_still_moves_torchs_rng_unless_replayed(
    preserve_rng_state: bool,
) -> None:
    torch.manual_seed(0)
    plain = RandomlyMasked()
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"], preserve_rng_state=preserve_rng_state))
    states = []
    for twin in (plain, model):
        torch.manual_seed(5)
        twin(tokens(0)).backward()
        states.append(torch.get_rng_state())
    # The gradients agree; what draws from torch next does not, unless recomputation replays its RNG.
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    assert torch.equal(*states) is preserve_rng_state
    x = tokens(1)
    for attribution in (False, True):
        report = check_recomputation(model, lambda: model(x), attribution=attribution)
        assert report.grad_divergence == 0.0
        if preserve_rng_state:
            assert (report.diverged, report.cause) == (False, None)
            assert all(region.cause is None for region in report.regions)
            continue
        assert (report.diverged, report.cause, report.hint) == (True, "rng_not_preserved", TORCH_RNG_STREAM_HINT)
        if attribution:
            (region,) = report.regions
            assert (region.name, region.diverged, region.cause, region.hint) == (
                "body",
                True,
                "rng_not_preserved",
                TORCH_RNG_STREAM_HINT,
            )
            assert region.first_divergent_op is not None and region.first_divergent_op[0] == "aten.rand.default"


class RandomlyMaskedModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = RandomlyMasked()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(24, 6, WIDTH, generator=torch.Generator().manual_seed(1))), 8)


def test_the_monitor_names_torchs_rng_moved_by_recomputation_and_the_fix_trains_as_the_plain_twin(
    tmp_path: Path,
) -> None:
    def fit(
        name: str, preserve_rng_state: bool | None, monitor: RecomputationMonitor | None
    ) -> dict[str, torch.Tensor]:
        pl.seed_everything(0, verbose=False)
        module = RandomlyMaskedModule()
        strategy: object = "auto"
        if preserve_rng_state is not None:
            config = CheckpointingConfig(classes=["RandomHalf"], preserve_rng_state=preserve_rng_state)
            strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
        callbacks = [] if monitor is None else [monitor]
        pl.Trainer(**trainer_kwargs(tmp_path / name, strategy=strategy, callbacks=callbacks, max_steps=3)).fit(module)
        return {key: value.clone() for key, value in module.state_dict().items()}

    plain = fit("plain", None, None)
    broken = RecomputationMonitor(every_n_steps=1)
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        moved = fit("broken", False, broken)
    assert any(not torch.equal(plain[key], moved[key]) for key in plain)  # the next step kept other tokens
    said = [str(warning.message) for warning in caught if "recomputation drew" in str(warning.message)]
    assert len(said) == 3
    assert said[0].startswith(
        "lightning_ckpt_determinism: recomputation drew from torch's RNG at step 0: it ended the step in another"
        " state than the same step without checkpointing; the gradients are exact. Region `model.body` diverged at"
        " `aten.rand.default`"
    )
    assert [(record.diverged, record.grad_divergence) for record in broken.history] == [(True, 0.0)] * 3
    fixed = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    exact = fit("fixed", True, fixed)
    assert all(torch.equal(plain[key], exact[key]) for key in plain)
    assert [record.diverged for record in fixed.history] == [False] * 3


class WrittenBetweenCalls(nn.Module):
    """Calls its region ``body`` twice, writing one of its parameters in place under ``no_grad`` in between."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Around(nn.Tanh())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            self.body.inp.bias.add_(0.1)
        return self.head(self.body(h)).float().pow(2).mean()


@pytest.mark.parametrize("autocast", [False, True])
def test_a_parameter_written_between_calls_is_a_parameter_write_under_autocast_too(autocast: bool) -> None:
    # Under autocast the op that differs reads the weight's cast, an op the observer leaves out: it stands for the
    # parameter it was cast from.
    torch.manual_seed(0)
    model = WrittenBetweenCalls()
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(x)

    report = check_recomputation(model, loss, attribution=True)
    assert report.diverged
    assert [(region.name, region.cause) for region in report.regions if region.diverged] == [
        ("body", "parameter_write")
    ]


class TiedHead(nn.Module):
    """An LM head reading the weight of an embedding it does not hold (a list hides it from the module tree)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.tied = [embedding]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.proj(h)), self.tied[0].weight)


class TiedSpectralHead(nn.Module):
    """An embedding under new-style ``spectral_norm`` and a head tied to it: every read of its weight runs the power
    iteration, which updates the embedding's ``_u`` and ``_v`` buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.utils.parametrizations.spectral_norm(nn.Embedding(WIDTH, WIDTH))
        self.head = TiedHead(self.embedding)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens))


def test_buffers_outside_a_region_its_recomputation_updates_again_are_a_buffer_mutation_naming_them() -> None:
    torch.manual_seed(0)
    plain = TiedSpectralHead()
    model = copy.deepcopy(plain)
    assert model.head.tied[0] is model.embedding
    apply_activation_checkpointing(model, CheckpointingConfig(names=["head"]))
    tokens = torch.randint(0, WIDTH, (4, 6), generator=torch.Generator().manual_seed(1))
    for twin in (plain, model):
        twin(tokens).square().mean().backward()
    buffers = ["embedding.parametrizations.weight.0._u", "embedding.parametrizations.weight.0._v"]
    # Ground truth: the recomputation ran the power iteration once more than the plain twin.
    assert [name for name in buffers if not torch.equal(plain.get_buffer(name), model.get_buffer(name))] == buffers
    report = check_recomputation(model, lambda: model(tokens).square().mean(), attribution=True)
    assert report.diverged and report.buffer_mutations == buffers
    (region,) = report.regions
    assert (region.name, region.cause, region.buffer_mutations) == ("head", "buffer_mutation", buffers)
    assert region.hint.endswith(f"Changed: {', '.join(buffers)}.") and "does not hold" in region.hint


class CountedBlock(nn.Module):
    """Scales by a module-level call count: a Python-state defect of its own."""

    calls = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) * (1.0 + 0.01 * next(CountedBlock.calls)))


def test_a_norm_outside_the_regions_downstream_of_a_python_state_region_leaves_it_python_state() -> None:
    # The norm's statistics differ after the passes because the region's output did, not because a recomputation
    # updated them: the region is not renamed buffer_mutation.
    torch.manual_seed(0)
    model = nn.Sequential(CountedBlock(), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["CountedBlock"]))
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1))
    report = check_recomputation(model, lambda: model(x).square().mean(), attribution=True)
    assert report.diverged and report.buffer_mutations == ["1.running_mean", "1.running_var"]
    assert [(region.name, region.cause) for region in report.regions] == [("0", "python_state")]


def _checked_under_lossy_hooks(plain: nn.Module, model: nn.Module, x: torch.Tensor) -> RecomputationReport:
    """Train both twins one step under activation compression (what the hooks give back is rounded to bfloat16),
    show that their gradients differ, and check the checkpointed one under the same hooks."""

    def loss(module: nn.Module) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.float()):
            return module(x).square().sum()

    loss(plain).backward()
    loss(model).backward()
    # The twin saves its activations through the hooks, the checkpointed model its regions' inputs, which every
    # recomputed op reads rounded: gradients differ.
    assert not all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    return check_recomputation(model, lambda: loss(model), attribution=True)


def test_lossy_saved_tensor_hooks_around_the_regions_are_named_by_the_input_recomputation_started_from() -> None:
    plain, model = twins(lambda: nn.Sequential(PlainBlock(), PlainBlock(), nn.Linear(DIM, 1)), ["0", "1"])
    report = _checked_under_lossy_hooks(plain, model, torch.randn(4, DIM))
    assert report.diverged
    assert [(region.name, region.cause, region.hint) for region in report.regions] == [
        (name, "python_state", INPUT_CHANGED_HINT) for name in ("0", "1")
    ]


def test_python_state_read_by_an_op_on_the_regions_input_keeps_its_own_hint() -> None:
    calls = itertools.count()

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x * (1.0 + next(calls))))

    model = nn.Sequential(Counting())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, DIM)
    report = check_recomputation(model, lambda: model(x).square().sum(), attribution=True)
    # The op that differs reads the region's input, unchanged, and a factor the counter gave: not the input's doing.
    assert [(region.cause, region.hint) for region in report.regions] == [("python_state", Cause.PYTHON_STATE.hint)]


class PicksAnInput(nn.Module):
    """Reads one of its two inputs, as a global counter says: Python state choosing what the op reads."""

    calls: ClassVar[list[int]] = [0]

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return torch.tanh(self.linear(first if self.calls[0] % 2 else second))


class ReadsACachedView(nn.Module):
    """Reads a tensor a global cache holds beside its input, both views of one storage."""

    cache: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.cache["key"])


def test_python_state_choosing_among_unchanged_inputs_or_views_of_their_storage_keeps_its_own_hint() -> None:
    picks = nn.Sequential(PicksAnInput())
    apply_activation_checkpointing(picks, CheckpointingConfig(names=["0"]))
    for shape in ((4, DIM), (2, 4, DIM)):  # in 3-D, `F.linear` reads a 2-D view of the input it picked
        first, second = torch.randn(shape), torch.randn(shape)
        # Recomputation reads the other input, unchanged: not an input that reached it changed.
        report = check_recomputation(
            picks, lambda first=first, second=second: picks[0](first, second).square().sum(), attribution=True
        )
        assert [(region.cause, region.hint) for region in report.regions] == [
            ("python_state", Cause.PYTHON_STATE.hint)
        ], shape

    cached = nn.Sequential(ReadsACachedView())
    apply_activation_checkpointing(cached, CheckpointingConfig(names=["0"]))
    fused = torch.randn(4, 3 * DIM)

    def closure() -> torch.Tensor:
        ReadsACachedView.cache["key"] = fused[:, DIM : 2 * DIM]
        loss = cached(fused[:, :DIM]).square().sum()
        ReadsACachedView.cache["key"] = fused[:, 2 * DIM :]  # the next layer's, before backward
        return loss

    # The cached view changed, not the region's input, though both lie on one storage.
    report = check_recomputation(cached, closure, attribution=True)
    assert [(region.cause, region.hint) for region in report.regions] == [("python_state", Cause.PYTHON_STATE.hint)]


class ChunkedBlock(nn.Module):
    """Splits its input in two halves, each read by its own op (a reversible block's coupling)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM // 2, DIM // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first, second + torch.tanh(self.linear(first))], dim=-1)


def test_an_input_changed_on_its_way_to_recomputation_is_named_where_the_ops_read_parts_of_it() -> None:
    plain, model = twins(lambda: nn.Sequential(nn.Linear(DIM, DIM), ChunkedBlock(), nn.Linear(DIM, 1)), ["1"])
    report = _checked_under_lossy_hooks(plain, model, torch.randn(2, 4, DIM))
    assert [(region.name, region.cause, region.hint) for region in report.regions] == [
        ("1", "python_state", INPUT_CHANGED_HINT)
    ]


class SparseAdjacencyLayer(nn.Module):
    """A graph layer given a sparse adjacency, which the digest cannot read, and scaled by a global counter."""

    calls: ClassVar[list[int]] = [0]

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return torch.sparse.mm(adjacency, torch.tanh(self.linear(x * (1.0 + self.calls[0]))))


def test_an_argument_the_digest_cannot_read_is_not_taken_for_an_input_that_changed() -> None:
    model = nn.Sequential(SparseAdjacencyLayer())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x, adjacency = torch.randn(4, DIM), torch.rand(4, 4).to_sparse()
    report = check_recomputation(model, lambda: model[0](x, adjacency).square().sum(), attribution=True)
    assert [(region.cause, region.hint) for region in report.regions] == [("python_state", Cause.PYTHON_STATE.hint)]


def test_an_attributed_pass_keeps_no_region_input_alive_that_offloading_hooks_let_go() -> None:
    model = nn.Sequential(PlainBlock(), PlainBlock(), PlainBlock())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
    inputs: list[weakref.ref[torch.Tensor]] = []
    model[1].register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    model[2].register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    attribution = Attribution(model)
    with attribution.observing():
        # Offloading as `save_on_cpu` does: the copy is kept, the original let go.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            loss = model(torch.randn(4, DIM)).square().sum()
        gc.collect()
        assert [ref() is None for ref in inputs] == [True, True]
        loss.backward()
    attribution.finish(None)


class _NoisyBlock(nn.Module):
    """A block whose inner layer's forward hook adds noise from a generator the hook holds, not the module."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        generator = torch.Generator().manual_seed(7)
        self.linear.register_forward_hook(
            lambda module, inputs, output: output + 0.01 * torch.randn(output.shape, generator=generator)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_a_generator_no_module_holds_is_named_as_not_replayed_whatever_preserve_rng_state_says(
    preserve_rng_state: bool,
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_NoisyBlock(), nn.Linear(DIM, 1))
    model = nn.Sequential(_NoisyBlock(), nn.Linear(DIM, 1))
    model.load_state_dict(plain.state_dict())
    config = CheckpointingConfig(names=["0"], preserve_rng_state=preserve_rng_state)
    apply_activation_checkpointing(model, config)
    x = torch.randn(4, DIM)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert not torch.equal(plain[0].linear.weight.grad, model[0].linear.weight.grad)
    report = check_recomputation(model, lambda: model(x).square().sum(), attribution=True)
    (region,) = report.regions
    assert (region.cause, region.first_divergent_op) == ("rng_not_preserved", ("aten.randn.generator", 2))
    # With the setting on, the hint does not ask for it: it says which generators are replayed and which are not.
    assert region.hint == (UNREPLAYED_GENERATOR_HINT if preserve_rng_state else Cause.RNG_NOT_PRESERVED.hint)


class _ScheduledDropout(nn.Module):
    """Dropout at the rate a schedule (a dict) gives, drawn from torch's default generator."""

    schedule: ClassVar[dict[str, float]] = {"value": 0.1}

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(torch.tanh(self.linear(x)), p=self.schedule["value"], training=True)


class _ScheduledNoise(nn.Module):
    """Noise of the spread a schedule (a dict) gives, drawn from a generator the module holds (the region's own)."""

    schedule: ClassVar[dict[str, float]] = {"value": 0.1}

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        return x + hidden * torch.normal(1.0, self.schedule["value"], size=hidden.shape, generator=self.generator)


@pytest.mark.parametrize(
    ("block", "op"), [(_ScheduledDropout, "aten.bernoulli_.float"), (_ScheduledNoise, "aten.normal.float_float")]
)
def test_a_random_op_asked_for_another_draw_by_python_state_is_named_python_state_not_rng(
    block: type[_ScheduledDropout | _ScheduledNoise], op: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(block(), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, DIM)

    def closure() -> torch.Tensor:
        block.schedule["value"] = 0.1
        loss = model(x).square().sum()
        block.schedule["value"] = 0.5  # the schedule moves on before the backward: recomputation draws otherwise
        return loss

    (region,) = check_recomputation(model, closure, attribution=True).regions
    assert region.diverged and region.first_divergent_op is not None
    # The generator was replayed: the rate or spread Python handed the op moved, which is what the user must fix.
    assert (region.cause, region.first_divergent_op[0]) == ("python_state", op)
    assert region.hint == Cause.PYTHON_STATE.hint
