"""Buffers too large for a region to copy before it knows a forward changes them (over ``KEPT_BUFFER_BYTES``): a
forward that first changes one after the region's first call, or code outside the region that writes one between a
forward and its recomputation, makes that one recomputation read other values than the forward did. The gradients of
that step differ from a plain twin's; every check names the buffer and says so (cause ``buffer_mutation``, the
read-otherwise hint), and the calls after it are exact."""

import copy
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.checkpointing.contexts import KEPT_BUFFER_BYTES
from lightning_ckpt_determinism.checkpointing.wrapper import buffers_read_otherwise
from lightning_ckpt_determinism.verify.reports import READ_OTHERWISE_HINT
from tests.helpers import trainer_kwargs

WIDTH = 8
ROWS = KEPT_BUFFER_BYTES // (4 * 64) + 1  # a (ROWS, 64) float32 table: just over what a region keeps a copy of


class LateTable(nn.Module):
    """Scales by the first row of a large table; from its ``start``-th call on, decays the table in place in
    forward (an average that starts after a warm-up)."""

    def __init__(self, start: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", torch.zeros(ROWS, 64))
        self.calls = 0
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.start:
            self.table.mul_(0.5).add_(1.0)
        return torch.tanh(self.linear(x)) * (1 + self.table[0, :WIDTH])


class ReadTable(LateTable):
    """Only reads its large table (``start`` never comes)."""

    def __init__(self) -> None:
        super().__init__(start=10**9)


def stack(block: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(block, nn.Linear(WIDTH, WIDTH))


def gradients(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [param.grad.clone() for param in model.parameters()]


def test_the_call_that_first_changes_a_large_buffer_is_the_only_one_that_differs_and_is_counted() -> None:
    plain = stack(LateTable())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, WIDTH)
    differs = []
    for _ in range(5):
        pairs = zip(gradients(plain, x), gradients(model, x), strict=True)
        differs.append(any(not torch.equal(a, b) for a, b in pairs))
        assert torch.equal(model[0].table, plain[0].table)  # changed once a call, as without checkpointing
    # Ground truth: the twin's gradients differ at the third call alone, where the table first changed.
    assert differs == [False, False, True, False, False]
    assert buffers_read_otherwise(model) == {"0.table": 1}


def test_the_two_pass_check_names_the_large_buffer_a_forward_first_changed() -> None:
    model = stack(LateTable())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        gradients(model, x)
    report = check_recomputation(model, lambda: model(x).pow(2).sum(), attribution=True, exclude_attributes=["calls"])
    [region] = report.regions
    assert report.diverged and region.diverged
    assert region.cause == "buffer_mutation"
    assert region.hint == f"{READ_OTHERWISE_HINT} Read otherwise: 0.table."
    # The next call is exact: the region replays the table from then on.
    again = check_recomputation(model, lambda: model(x).pow(2).sum(), attribution=True, exclude_attributes=["calls"])
    assert not again.diverged


def test_a_large_buffer_written_between_the_forward_and_its_recomputation_is_named() -> None:
    plain = stack(ReadTable())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, WIDTH)
    gradients(model, x)

    def written_after_forward(net: nn.Module) -> torch.Tensor:
        loss = net(x).pow(2).sum()
        net[0].table.add_(1.0)  # the caller writes it before backward recomputes the region
        return loss

    # Ground truth: torch's own checkpoint and the package both recompute from the written table here, once.
    plain.zero_grad()
    written_after_forward(plain).backward()
    model.zero_grad()
    written_after_forward(model).backward()
    assert not torch.equal(plain[0].linear.weight.grad, model[0].linear.weight.grad)
    assert buffers_read_otherwise(model) == {"0.table": 1}
    model[0].table.sub_(2.0)  # the table as it was before both calls
    report = check_recomputation(model, lambda: written_after_forward(model), attribution=True)
    # Replayed from the call after the first write: this check's recomputation reads what its forward read.
    assert not report.diverged
    assert buffers_read_otherwise(model) == {"0.table": 1}


class TableModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = stack(LateTable())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(48, WIDTH, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(data), batch_size=8)


@pytest.mark.parametrize("attribution", ["on_divergence", "never"])
def test_the_monitor_names_the_large_buffer_at_the_step_it_first_changed(tmp_path: Path, attribution: str) -> None:
    monitor = RecomputationMonitor(every_n_steps=1, attribution=attribution, exclude_attributes=["calls"])  # type: ignore[arg-type]
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.0"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=5, strategy=strategy, callbacks=[monitor]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(TableModule())
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(step, step == 2) for step in range(5)]
    [message] = [str(w.message) for w in caught if "recomputation diverged" in str(w.message)]
    assert message.startswith("lightning_ckpt_determinism: recomputation diverged at step 2:")
    assert message.endswith(f"{READ_OTHERWISE_HINT} Read otherwise: model.0.table.")


class CountedTable(ReadTable):
    """Reads its large table only; counts its calls in a small buffer from its third call on."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls >= 2:
            self.count.add_(1)
        return super().forward(x) * (1 + self.count)


def test_a_large_buffer_only_read_beside_one_first_changed_late_is_not_named() -> None:
    plain = stack(CountedTable())
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, WIDTH)
    for _ in range(4):
        pairs = zip(gradients(plain, x), gradients(model, x), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    # The counter's module changed at the third call; its table, never written, was recomputed as the forward read it.
    assert buffers_read_otherwise(model) == {}
