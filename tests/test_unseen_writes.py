"""Buffers a forward writes in a way that moves no version counter (through ``.data``, as VQ-VAE codebook averages
are updated; by a kernel, as ``F.batch_norm`` updates running statistics it is given), for the first time after the
region's first call: a small one (copied as each forward starts) is recomputed from that copy, exactly as a plain twin
trains; a larger one cannot be, and the check says how to make it so."""

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.checkpointing.contexts import SMALL_BUFFER_BYTES
from lightning_ckpt_determinism.verify.reports import UNSEEN_WRITE_HINT
from tests.helpers import trainer_kwargs

WIDTH = 16
SMALL_ROWS = 1
KEPT_ROWS = SMALL_BUFFER_BYTES // (4 * WIDTH) + 1  # just over what a region copies at each forward


class DataAverage(nn.Module):
    """Subtracts the first row of an average it reads, then, after ``warm`` calls, updates the average through
    ``.data`` (the VQ-VAE pattern)."""

    def __init__(self, rows: int, warm: int = 1) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.register_buffer("average", torch.zeros(rows, WIDTH))
        self.warm, self.calls = warm, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        out = x + self.out(torch.tanh(h - self.average[0]))
        if self.calls > self.warm:
            self.average.data.mul_(0.5).add_(0.5 * h.detach().mean(0))
        return out


class WarmedNorm(nn.Module):
    """``F.batch_norm`` on running statistics of its own, with momentum 0 for ``warm`` calls: its kernel updates
    them in place without a version bump, and only from then on."""

    def __init__(self, warm: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mean", torch.zeros(WIDTH))
        self.register_buffer("var", torch.ones(WIDTH))
        self.warm, self.calls = warm, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        momentum = 0.0 if self.calls <= self.warm else 0.1
        h = F.batch_norm(self.inp(x), self.mean, self.var, training=True, momentum=momentum)
        return torch.tanh(h) * (1 + self.mean)


def gradients(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).mean().backward()
    return [param.grad.clone() for param in model.parameters()]


def twins(block: nn.Module) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    plain = nn.Sequential(block, nn.Linear(WIDTH, 1))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    return plain, model


def trained_side_by_side(plain: nn.Module, model: nn.Module, steps: int = 5) -> tuple[list[bool], list[bool]]:
    """Whether each step's gradients, and each step's buffers after it, differ between the twins."""
    data = torch.randn(steps, 4, WIDTH, generator=torch.Generator().manual_seed(1))
    gradients_differ, buffers_differ = [], []
    for x in data:
        pairs = zip(gradients(plain, x), gradients(model, x), strict=True)
        gradients_differ.append(any(not torch.equal(a, b) for a, b in pairs))
        buffers = zip(model.buffers(), plain.buffers(), strict=True)
        buffers_differ.append(any(not torch.equal(ours, theirs) for ours, theirs in buffers))
    return gradients_differ, buffers_differ


@pytest.mark.parametrize("block", [lambda: DataAverage(SMALL_ROWS), WarmedNorm], ids=["data write", "kernel write"])
def test_a_small_buffer_first_written_without_a_version_bump_trains_as_the_plain_twin(block) -> None:
    plain, model = twins(block())
    assert trained_side_by_side(plain, model) == ([False] * 5, [False] * 5)
    # torch's own checkpoint differs from the first write on: what the package makes exact.
    torch.manual_seed(0)
    plain = nn.Sequential(block(), nn.Linear(WIDTH, 1))
    theirs = copy.deepcopy(plain)
    original = theirs[0].forward
    theirs[0].forward = lambda x: torch.utils.checkpoint.checkpoint(original, x, use_reentrant=False)
    assert any(trained_side_by_side(plain, theirs)[0])


def test_a_larger_buffer_written_through_data_after_the_first_call_is_named_with_the_fix() -> None:
    plain, model = twins(DataAverage(KEPT_ROWS))
    # Ground truth: kept from call to call, its copy misses the write; from the first write on, the twins differ.
    assert trained_side_by_side(plain, model)[0] == [False, True, True, True, True]
    x = torch.randn(4, WIDTH)
    report = check_recomputation(model, lambda: model(x).pow(2).mean(), attribution=True, exclude_attributes=["calls"])
    [region] = report.regions
    assert report.diverged and region.diverged
    assert (region.cause, region.hint) == ("buffer_mutation", UNSEEN_WRITE_HINT)


class DataAverageReadAfter(DataAverage):
    """:class:`DataAverage` reading its average again after writing it, so that the recomputation runs the write
    (torch's early stop ends it at the last saved tensor otherwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        a = torch.tanh(h - self.average[0])
        if self.calls > self.warm:
            self.average.data.mul_(0.5).add_(0.5 * h.detach().mean(0))
        return x + self.out(a * (1 + self.average[0]))


def penalised_gradients(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """A gradient penalty's step: ``autograd.grad(create_graph=True)``, then backward; two recomputations."""
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    loss = model(x).pow(2).mean()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad.pow(2).sum()).backward()
    return [param.grad.clone() for param in model.parameters()]


def test_a_second_recomputation_of_a_forward_starts_from_the_same_copy_as_the_first() -> None:
    plain, model = twins(DataAverageReadAfter(SMALL_ROWS))
    for x in torch.randn(4, 4, WIDTH, generator=torch.Generator().manual_seed(1)):
        pairs = zip(penalised_gradients(plain, x), penalised_gradients(model, x), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        assert torch.equal(plain[0].average, model[0].average)


class GradientStatistic(torch.autograd.Function):
    """Saves a view of a statistics buffer and adds to it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, statistic: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(statistic)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (statistic,) = ctx.saved_tensors
        statistic.add_(grad.abs().sum(0))
        return grad * 2, None


class KeepsGradientStatistics(nn.Module):
    """Reads a small buffer only in forward, through a view its backward writes to."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("statistics", torch.zeros(2, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(GradientStatistic.apply(self.inp(x), self.statistics[0]))


def test_what_backward_writes_through_a_saved_view_of_a_small_buffer_lands_on_the_buffer() -> None:
    plain, model = twins(KeepsGradientStatistics())
    assert trained_side_by_side(plain, model) == ([False] * 5, [False] * 5)
    assert bool(model[0].statistics[0].ne(0).all())


class AverageModule(pl.LightningModule):
    """Regresses through a :class:`DataAverageReadAfter` block (its recomputation runs the write)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(DataAverageReadAfter(rows), nn.Linear(WIDTH, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(data), batch_size=8)


def monitored_fit(tmp_path: Path, rows: int, sentinel: str) -> tuple[RecomputationMonitor, list[str]]:
    monitor = RecomputationMonitor(every_n_steps=1, sentinel=sentinel, exclude_attributes=["calls"])  # type: ignore[arg-type]
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.0"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, strategy=strategy, callbacks=[monitor]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(AverageModule(rows))
    return monitor, [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)]


@pytest.mark.parametrize("sentinel", ["light", "exact"])
def test_the_monitor_finds_nothing_where_a_small_buffer_written_through_data_trains_exactly(
    tmp_path: Path, sentinel: str
) -> None:
    # Recomputation writes its copy and gives the buffer back: not a change of the buffer's, for the sentinel either.
    monitor, said = monitored_fit(tmp_path, SMALL_ROWS, sentinel)
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(step, 0.0) for step in range(4)]
    report = monitor.sentinel_report
    assert report is not None and report.mismatches == 0 < report.compared
    assert not [message for message in said if "diverged" in message or "sentinel saw" in message]


def test_the_monitor_names_a_larger_buffer_written_through_data_with_the_fix(tmp_path: Path) -> None:
    monitor, said = monitored_fit(tmp_path, KEPT_ROWS, "light")
    assert [record.diverged for record in monitor.history] == [False, True, True, True]
    [message] = [message for message in said if "recomputation diverged at step 1" in message]
    assert f"{UNSEEN_WRITE_HINT} Changed: model.0.average." in message
