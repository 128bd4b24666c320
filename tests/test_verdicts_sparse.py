"""Sparse gradients (``nn.Embedding(sparse=True)``, in a checkpointed region and outside one) against ground truth: the
zoo's plain twin under the sentinel and the check in every tier, ``check_recomputation`` against torch's own
checkpoint, and the default ``RecomputationMonitor`` against a twin trained without it and one without checkpointing.
"""

import copy
import math
from typing import get_args

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.verify.compare import gradient_divergence
from lightning_ckpt_determinism.verify.digest import DigestTier
from tests.helpers import trainer_kwargs
from tests.test_verdicts import STEPS, WIDTH, Around, Case, Head, same_state, tokens, trial

VOCABULARY = 10


def ids_of(x: torch.Tensor) -> torch.Tensor:
    """Token ids made from the features, as the zoo's language models make them."""
    return (x[..., 0].abs() * 4).long().clamp(max=VOCABULARY - 1)


class SparseLookup(nn.Module):
    """Looks rows up in an ``nn.Embedding(sparse=True)`` and drops some of them: the table's gradient is sparse and
    depends on the dropout mask recomputation must replay."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x)) * self.drop(self.table(ids_of(x)))


class SparseOutside(nn.Module):
    """A sparse table looked up outside the checkpointed ``body``, its rows added to the features the body reads."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.body = Around(nn.Dropout(0.3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x + self.table(ids_of(x))))


SPARSE_ZOO = {
    "Embedding(sparse=True) in a region": Case(lambda: Head(SparseLookup())),
    "Embedding(sparse=True) outside the region": Case(SparseOutside),
}


def table_of(model: nn.Module) -> nn.Embedding:
    return next(sub for sub in model.modules() if isinstance(sub, nn.Embedding))


@pytest.mark.parametrize("mode", get_args(DigestTier))
@pytest.mark.parametrize("name", list(SPARSE_ZOO))
def test_a_sparse_gradient_trains_exactly_with_nothing_from_the_sentinel_nor_the_check(name, mode):
    result = trial(SPARSE_ZOO[name], mode)
    grad = table_of(result.checkpointed).weight.grad
    assert grad is not None and grad.layout is torch.sparse_coo  # the case holds what it is about
    assert result.gradients_equal
    assert same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0, result.sentinel.regions
    assert result.sentinel.compared > 0
    assert len(result.checks) == STEPS
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
        assert report.per_parameter[f"{'body.' if 'in a' in name else ''}table.weight"] == 0.0
        assert [region.cause for region in report.regions] == [None] * len(result.regions)


def sparse_model(preserve_rng_state: bool = True) -> tuple[nn.Module, nn.Module]:
    """A plain model and its checkpointed copy (the body, as ``SparseLookup`` regions go)."""
    torch.manual_seed(0)
    plain = Head(SparseLookup())
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(
        checkpointed, CheckpointingConfig(names=["body"], preserve_rng_state=preserve_rng_state)
    )
    return plain, checkpointed


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), torch.zeros(*x.shape[:-1], 1))


@pytest.mark.parametrize("gradients", ["autograd", "backward"])
def test_check_recomputation_on_a_clean_sparse_model_gives_zero_and_leaves_the_sparse_gradient_as_it_was(gradients):
    _, model = sparse_model()
    x = tokens(0)
    loss_of(model, x).backward()
    held = table_of(model).weight.grad
    assert held is not None and held.layout is torch.sparse_coo and not held.is_coalesced()
    torch.manual_seed(1)
    report = check_recomputation(model, lambda: loss_of(model, x), gradients=gradients, calibrate_noise=True)
    assert (report.diverged, report.grad_divergence, report.noise_floor, report.error) == (False, 0.0, 0.0, None)
    assert report.per_parameter["body.table.weight"] == 0.0
    assert table_of(model).weight.grad is held and not held.is_coalesced()


@pytest.mark.parametrize("gradients", ["autograd", "backward"])
def test_check_recomputation_measures_a_redrawn_dropout_mask_as_torchs_checkpoint_gives_it(gradients):
    plain, model = sparse_model(preserve_rng_state=False)
    x = tokens(0)
    params = list(plain.parameters())

    def by_torch(x: torch.Tensor) -> torch.Tensor:
        return plain.head(checkpoint(plain.body, x, use_reentrant=False, preserve_rng_state=False))

    torch.manual_seed(1)
    reference = torch.autograd.grad(loss_of(plain, x), params)
    torch.manual_seed(1)
    out = by_torch(x)
    redrawn = torch.autograd.grad(F.mse_loss(out, torch.zeros_like(out)), params)
    assert reference[0].layout is torch.sparse_coo
    # Dense forms with the table's repeated rows summed in float64, as the check sums them.
    expected, per_parameter = gradient_divergence(
        [grad.double().to_dense() for grad in reference], [grad.double().to_dense() for grad in redrawn]
    )
    assert expected > 0
    torch.manual_seed(1)
    report = check_recomputation(model, lambda: loss_of(model, x), gradients=gradients)
    assert report.diverged and report.error is None
    assert report.grad_divergence == pytest.approx(expected, rel=1e-12)
    names = [name for name, _ in plain.named_parameters()]
    assert report.per_parameter == dict(zip(names, per_parameter, strict=True))
    assert report.per_parameter["body.table.weight"] > 0


class SparseLookupModule(pl.LightningModule):
    """A LightningModule over token ids: a sparse table in the checkpointed ``SparseLookup``-like body, another
    outside it, and a frozen head, so that every trainable parameter has a sparse gradient (``SparseAdam`` needs
    it); ``optimizer`` is ``"sgd"`` or ``"sparse_adam"``."""

    def __init__(self, optimizer: str = "sgd", p: float = 0.3) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.outside = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.body = SparseBody(p)
        self.head = nn.Linear(WIDTH, 1).requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        features = self.body(ids) * self.outside(ids)
        return F.mse_loss(self.head(features).mean(dim=1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [param for param in self.parameters() if param.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(trainable, lr=0.5)
        return torch.optim.SparseAdam(trainable, lr=0.05)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2)
        ids = torch.randint(0, VOCABULARY, (32, 5), generator=generator)
        return DataLoader(TensorDataset(ids, torch.randn(32, 1, generator=generator)), batch_size=8)


class SparseBody(nn.Module):
    """Rows of a sparse table, dropped at random, through a nonlinearity."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.drop = nn.Dropout(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.drop(self.table(ids)) * 2)


def fit(tmp_path, optimizer: str, *, monitor: RecomputationMonitor | None, checkpointing: dict | None, **setup):
    pl.seed_everything(0, verbose=False)
    module = SparseLookupModule(optimizer)
    strategy = (
        SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["SparseBody"], **checkpointing))
        if checkpointing is not None
        else "auto"
    )
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, callbacks=[monitor] if monitor else [], strategy=strategy, max_steps=4, **setup)
    )
    trainer.fit(module)
    return trainer, module


def same_optimizer_state(first: pl.Trainer, second: pl.Trainer) -> bool:
    one, other = first.optimizers[0].state_dict()["state"], second.optimizers[0].state_dict()["state"]
    return one.keys() == other.keys() and all(
        state.keys() == other[index].keys()
        and all(
            torch.equal(value, other[index][key]) if isinstance(value, torch.Tensor) else value == other[index][key]
            for key, value in state.items()
        )
        for index, state in one.items()
    )


@pytest.mark.parametrize(
    ("optimizer", "setup"),
    # Under accumulation the live step's sparse gradients are added to those of the batch before, as the check's
    # reference pass adds its own.
    [("sgd", {}), ("sparse_adam", {}), ("sgd", {"accumulate_grad_batches": 2})],
)
def test_the_default_monitor_trains_sparse_tables_bit_identically_with_every_check_at_zero(tmp_path, optimizer, setup):
    monitor = RecomputationMonitor(every_n_steps=1)
    plain_trainer, plain = fit(tmp_path / "plain", optimizer, monitor=None, checkpointing=None, **setup)
    twin_trainer, twin = fit(tmp_path / "twin", optimizer, monitor=None, checkpointing={}, **setup)
    trainer, monitored = fit(tmp_path / "monitored", optimizer, monitor=monitor, checkpointing={}, **setup)
    assert [(entry.step, entry.grad_divergence, entry.diverged) for entry in monitor.history] == [
        (step, 0.0, False) for step in range(4)
    ]
    sentinel = monitor.sentinel_report
    assert sentinel is not None and sentinel.compared > 0 and sentinel.mismatches == 0
    assert same_state(plain, monitored) and same_state(twin, monitored)
    assert not same_state(SparseLookupModule(optimizer), monitored)  # it trained
    assert same_optimizer_state(plain_trainer, trainer) and same_optimizer_state(twin_trainer, trainer)
    assert all(
        param.grad is None or param.grad.layout is torch.sparse_coo
        for param in monitored.parameters()
        if param.requires_grad
    )


def test_the_monitor_measures_a_redrawn_mask_in_a_sparse_table_and_leaves_training_as_it_was(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore", sentinel="off")
    config = {"preserve_rng_state": False}
    _, twin = fit(tmp_path / "twin", "sgd", monitor=None, checkpointing=config)
    _, monitored = fit(tmp_path / "monitored", "sgd", monitor=monitor, checkpointing=config)
    assert len(monitor.history) == 4
    assert all(entry.diverged and 0 < entry.grad_divergence < math.inf for entry in monitor.history)
    assert same_state(twin, monitored)
