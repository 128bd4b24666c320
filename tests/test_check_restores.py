"""The check changes nothing: state a forward changes outside what recomputation replays (an object's counter, a NumPy
array, a parameter decayed or clamped in place, a generator or an object created lazily, a tensor attribute) is put
back by ``check_recomputation`` and by the monitor's check of the live step. Each case, with a check before every
step, trains bit-identically to a twin that runs no check, and no verdict blames ``outside_state`` on state the
check's own passes advanced."""

import contextlib
import contextvars
import datetime
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    RecomputationReport,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning
from lightning_ckpt_determinism.verify.state import StepState
from tests.helpers import trainer_kwargs
from tests.test_verdicts import WIDTH, Around, loss_of, same_state, seeded, tokens

STEPS = 3


class Tracker:
    """A user's object: a counter and what it saw."""

    def __init__(self) -> None:
        self.count = 0
        self.seen: list[int] = []


@dataclass(slots=True)
class SlottedTracker:
    """A user's object of a class with ``__slots__``: no ``__dict__``, its state in its slots."""

    count: int = 0
    seen: list[int] = field(default_factory=list)


class TrackerWithADict(SlottedTracker):
    """A plain subclass of a slotted class: its state is in its slots and its ``__dict__``."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "tracker"


class PrivateSlotTracker:
    """A tracker whose count is in a private slot, stored as ``_PrivateSlotTracker__count``; the class is renamed
    after its creation below, as factories and decorators do."""

    __slots__ = ("__count", "seen")

    def __init__(self) -> None:
        self.__count = 0
        self.seen: list[int] = []

    @property
    def count(self) -> int:
        return self.__count

    @count.setter
    def count(self, value: int) -> None:
        self.__count = value


PrivateSlotTracker.__name__ = "Renamed"


class Outside(nn.Module):
    """A checkpointed block (``body``) between an input scale and a linear head; each subclass computes the scale from
    state its forward changes outside the region."""

    def __init__(self, body: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body if body is not None else Around(nn.Tanh())
        self.head = nn.Linear(WIDTH, 1)

    def scale(self, x: torch.Tensor) -> torch.Tensor | float:
        return 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x * self.scale(x)))


class ObjectCounter(Outside):
    """Counts its calls in an object of the user's own class."""

    def __init__(self, tracker: Callable[[], Any] = Tracker) -> None:
        super().__init__()
        self.tracker = tracker()

    def scale(self, x: torch.Tensor) -> float:
        self.tracker.count += 1
        self.tracker.seen.append(self.tracker.count)
        return 1.0 + 0.1 * self.tracker.count


class LazyObject(Outside):
    """Creates its tracker at the first call."""

    def scale(self, x: torch.Tensor) -> float:
        if not hasattr(self, "tracker"):
            self.tracker = Tracker()
        self.tracker.count += 1
        return 1.0 + 0.1 * self.tracker.count


class NumpyHistogram(Outside):
    """Counts its calls in a NumPy array changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.hist = np.zeros(3)

    def scale(self, x: torch.Tensor) -> float:
        self.hist[...] += 1
        return 1.0 + 0.1 * float(self.hist[0])


class DecayedParameter(Outside):
    """Decays a parameter in place under ``no_grad`` before the region."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.alpha.mul_(0.9)
        return self.alpha


class Clamped(nn.Module):
    """A region whose gain is clamped in place in its forward (idempotent: recomputation clamps it to the same)."""

    def __init__(self, decay: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.gain = nn.Parameter(torch.linspace(-2.0, 2.0, WIDTH))
        self.decay = decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.decay:
                self.gain.mul_(0.9)
            else:
                self.gain.clamp_(-1.0, 1.0)
        return torch.tanh(self.inp(x) * self.gain)


class LazyGenerator(Outside):
    """Creates a seeded generator at its first call and draws input noise from it."""

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "noise"):
            self.noise = torch.Generator().manual_seed(7)
        return 1.0 + torch.rand(x.shape, generator=self.noise)


class TensorAttribute(Outside):
    """Sums its calls in a tensor held as a plain attribute, updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = torch.zeros(())

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1.0)
        return 1.0 + 0.1 * self.calls


class ContainedTensors(Outside):
    """Counts its calls in a tensor inside a dict and in a tensor and a NumPy array inside a list, each updated in
    place (running sums kept for logging)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = {"calls": torch.zeros(())}
        self.history = [torch.zeros(2), np.zeros(1)]

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        self.stats["calls"].add_(1.0)
        self.history[0].add_(1.0)
        self.history[1] += 1
        return 1.0 + 0.1 * self.stats["calls"] + 0.01 * self.history[0].sum() * float(self.history[1][0])


class Seen(list):
    """A list of the user's own class."""


class SubclassedContainers(Outside):
    """Counts its calls in a ``Counter``, an ``OrderedDict`` and a list of its own class: containers whose class is a
    subclass of ``dict`` or ``list`` (as Lightning's ``AttributeDict``, ``self.hparams``, is)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.ordered: OrderedDict[str, int] = OrderedDict(calls=0)
        self.seen_list = Seen()

    def scale(self, x: torch.Tensor) -> float:
        self.counts["calls"] += 1
        self.ordered["calls"] += 1
        self.seen_list.append(self.counts["calls"])
        return 1.0 + 0.1 * self.counts["calls"] + 0.01 * self.ordered["calls"] * len(self.seen_list)


class RunningScale(Outside):
    """Scales by a running mean of its inputs' means over a window of three calls (torchmetrics' `RunningMean`,
    which keeps its place in the window in a plain attribute besides its states)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = torchmetrics.aggregation.RunningMean(window=3)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        self.running.update(x.mean().detach().abs())
        return 1.0 + self.running.compute()


class FrozenByTurns(Outside):
    """Freezes and unfreezes its head at every other call (`requires_grad_`)."""

    def scale(self, x: torch.Tensor) -> float:
        self.head.requires_grad_(not self.head.weight.requires_grad)
        return 1.0


class NanStatistic(nn.Module):
    """A region that keeps diagnostics as attributes, NaN at every pass: the mean of activations above 100 (there are
    none) as a float, and as a NumPy array made afresh."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        self.mean_of_large = h[h.abs() > 100].mean().item()
        self.stats = np.array([self.mean_of_large, 1.0])
        return torch.tanh(h)


class ListedTrackers(Outside):
    """Counts its calls in objects of the user's own class held in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.trackers = [Tracker(), Tracker()]

    def scale(self, x: torch.Tensor) -> float:
        for tracker in self.trackers:
            tracker.count += 1
            tracker.seen.append(tracker.count)
        return 1.0 + 0.1 * self.trackers[0].count


class Memory:
    """A block's memory of its last input, as Transformer-XL keeps one: ``None`` until the first call."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None


class SlottedMemory:
    """:class:`Memory` with ``__slots__``."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None


class RemembersInput(nn.Module):
    """A region that reads the memory it is given and replaces it with its input: its recomputation reads the input it
    stored, not the one its forward read (a real defect)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, memory: Memory | SlottedMemory) -> torch.Tensor:
        previous = torch.zeros_like(x) if memory.last is None else memory.last
        memory.last = x.detach()
        return torch.tanh(self.inp(x) + 0.5 * previous)


class ListedMemories(Outside):
    """Hands its region the first of the memories it holds in a list."""

    def __init__(self, memory: type[Memory | SlottedMemory] = Memory) -> None:
        super().__init__(RemembersInput())
        self.memories = [memory(), memory()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x, self.memories[0]))


@dataclass(frozen=True)
class Case:
    """A model, and whether its checkpointed copy trains like the plain one (recomputation writes nothing twice)."""

    build: Callable[[], nn.Module]
    like_plain: bool = True


CASES = {
    "an object's counter": Case(ObjectCounter),
    "an object created lazily": Case(LazyObject),
    "a NumPy array changed in place": Case(NumpyHistogram),
    "a parameter decayed outside a region": Case(DecayedParameter),
    "a parameter clamped inside a region": Case(lambda: Outside(Clamped())),
    # Recomputation decays it a second time: the checkpointed model differs from the plain one, with or without a check.
    "a parameter decayed inside a region": Case(lambda: Outside(Clamped(decay=True)), like_plain=False),
    "a generator created lazily": Case(LazyGenerator),
    "a tensor attribute": Case(TensorAttribute),
    "tensors and an array inside containers": Case(ContainedTensors),
    "a head frozen by turns": Case(FrozenByTurns),
    "subclasses of dict and list": Case(SubclassedContainers),
    "a running metric": Case(RunningScale),
    "objects of the user's own class in a list": Case(ListedTrackers),
    # The region reads what its own forward stored: wrong with or without a check, and a check must not change it.
    "a memory in a list, replaced inside a region": Case(ListedMemories, like_plain=False),
    "a slotted object's counter": Case(lambda: ObjectCounter(SlottedTracker)),
    "a counter in a slot of an object with a __dict__ too": Case(lambda: ObjectCounter(TrackerWithADict)),
    "a counter in a private slot of a renamed class": Case(lambda: ObjectCounter(PrivateSlotTracker)),
    "a slotted memory in a list, replaced inside a region": Case(
        lambda: ListedMemories(SlottedMemory), like_plain=False
    ),
    # NaN is not `==` to itself: a NaN set again by recomputation is the same value, not a mutation.
    "a NaN statistic kept as an attribute": Case(lambda: Outside(NanStatistic())),
}


def held_state(model: nn.Module) -> list[object]:
    """What the forwards changed besides the state dict, as values to compare."""
    tracker = getattr(model, "tracker", None)
    noise = getattr(model, "noise", None)
    return [
        None if tracker is None else (tracker.count, list(tracker.seen)),
        getattr(model, "hist", np.zeros(0)).tolist(),
        None if noise is None else noise.get_state().tolist(),
        float(getattr(model, "calls", torch.zeros(()))),
        [float(value) for value in getattr(model, "stats", {}).values()],
        [value.tolist() for value in getattr(model, "history", [])],
        [param.requires_grad for param in model.parameters()],
        dict(getattr(model, "counts", {})),
        dict(getattr(model, "ordered", {})),
        list(getattr(model, "seen_list", [])),
        None if not hasattr(model, "running") else (model.running._num_vals_seen, float(model.running.compute())),
        [(tracker.count, list(tracker.seen)) for tracker in getattr(model, "trackers", [])],
        [None if memory.last is None else memory.last.tolist() for memory in getattr(model, "memories", [])],
    ]


@dataclass
class Run:
    model: nn.Module
    losses: list[float]
    reports: list[RecomputationReport]


def train(case: Case, *, checkpointed: bool, check: bool, **check_kwargs: object) -> Run:
    """Three SGD steps; with ``check``, ``check_recomputation`` (with attribution) before each."""
    torch.manual_seed(0)
    model = case.build()
    if checkpointed:
        apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, reports = [], []
    for step in range(STEPS):
        x = tokens(step)
        if check:
            seeded(step)
            reports.append(
                check_recomputation(model, lambda x=x: loss_of(model, x), attribution=True, **check_kwargs)  # type: ignore[arg-type]
            )
        seeded(step)
        optimizer.zero_grad()
        loss = loss_of(model, x)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return Run(model, losses, reports)


def same_run(first: Run, second: Run) -> bool:
    return (
        first.losses == second.losses
        and same_state(first.model, second.model)
        and held_state(first.model) == held_state(second.model)
    )


@pytest.mark.parametrize("name", list(CASES))
def test_a_check_before_every_step_changes_no_training(name: str) -> None:
    case = CASES[name]
    checked = train(case, checkpointed=True, check=True)
    unchecked = train(case, checkpointed=True, check=False)
    assert same_run(checked, unchecked)
    if case.like_plain:
        assert same_run(checked, train(case, checkpointed=False, check=False))
    for report in checked.reports:
        assert report.cause != "outside_state", report
        assert report.not_restored == []
        if case.like_plain:
            assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)


def test_the_state_after_a_check_is_the_state_before_it() -> None:
    model = ObjectCounter()
    model.hist = np.arange(3.0)
    model.running = torch.zeros(2)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    tracker, seen, hist, running = model.tracker, model.tracker.seen, model.hist, model.running

    def closure() -> torch.Tensor:
        model.hist += 1
        model.running.add_(1.0)
        model.tracker = Tracker()  # rebound by the step: the check binds the original again
        model.created = torch.Generator()
        return loss_of(model, tokens(0))

    check_recomputation(model, closure)
    assert model.tracker is tracker and model.tracker.seen is seen and (tracker.count, seen) == (0, [])
    assert model.hist is hist and hist.tolist() == [0.0, 1.0, 2.0]
    assert model.running is running and running.tolist() == [0.0, 0.0]
    assert not hasattr(model, "created")


def test_a_parameter_written_without_a_copy_is_named_and_not_blamed_on_outside_state() -> None:
    case = CASES["a parameter decayed outside a region"]
    # Told that nothing is written, the check copies nothing: it cannot put `alpha` back, and says so.
    run = train(case, checkpointed=True, check=True, written_parameters=[])
    first = run.reports[0]
    assert first.not_restored == ["alpha"]
    assert first.diverged and first.cause is None
    assert not same_run(run, train(case, checkpointed=True, check=False))
    # Told which, it copies that one only, and training is untouched.
    named = train(case, checkpointed=True, check=True, written_parameters=["alpha"])
    assert same_run(named, train(case, checkpointed=True, check=False))
    assert [report.not_restored for report in named.reports] == [[]] * STEPS


class Everything(nn.Module):
    """Changes every kind of state the check restored before: each random stream, a buffer, a held generator, a tensor
    attribute, a metric, scalars, a list inside a dict, a training flag and grad mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Around(nn.Dropout(0.3))
        self.head = nn.Linear(WIDTH, 1)
        self.register_buffer("seen", torch.zeros(()))
        self.noise = torch.Generator().manual_seed(5)
        self.total = torch.zeros(())
        self.metric = torchmetrics.MeanMetric()
        self.calls = 0
        self.log: dict[str, list[float]] = {"scales": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = random.uniform(0.9, 1.1) * float(np.random.uniform(0.9, 1.1))
        scale *= 1.0 + float(torch.rand((), generator=self.noise)) + 0.1 * float(torch.rand(()))
        self.seen += 1
        self.total.add_(scale)
        self.calls += 1
        self.log["scales"].append(scale)
        out = self.head(self.body(x * scale * (1 + 0.1 * self.seen)))
        self.metric.update(out.detach().mean())
        self.head.train(not self.head.training)
        torch.set_grad_enabled(True)
        return out


def test_every_kind_of_state_restored_before_is_still_restored() -> None:
    def snapshot(model: Everything) -> list[object]:
        return [
            torch.get_rng_state(),
            random.getstate(),
            np.random.get_state()[1].tolist(),
            model.noise.get_state(),
            model.seen.clone(),
            model.total.clone(),
            float(model.metric.compute()) if model.metric.update_count else None,
            model.calls,
            list(model.log["scales"]),
            model.head.training,
        ]

    torch.manual_seed(0)
    model = Everything()
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    seeded(0)
    model(tokens(0))  # the state has values of its own before the check
    before = snapshot(model)
    with torch.no_grad():
        check_recomputation(model, lambda: loss_of(model, tokens(1)), attribution=True)
        assert not torch.is_grad_enabled()
    after = snapshot(model)
    for first, second in zip(before, after, strict=True):
        assert torch.equal(first, second) if isinstance(first, torch.Tensor) else first == second


class CaseModule(pl.LightningModule):
    """A LightningModule regressing with one case's model under SGD."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.model(x)
        return F.mse_loss(out, y.expand_as(out))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(4 * STEPS, 6, WIDTH, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=-1, keepdim=True)), batch_size=4)


def fit(tmp_path: object, case: Case, monitor: RecomputationMonitor | None) -> CaseModule:
    pl.seed_everything(0, verbose=False)
    module = CaseModule(case.build)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.body"]))
    callbacks = [monitor] if monitor is not None else []
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=callbacks, strategy=strategy, max_steps=STEPS))
    trainer.fit(module)
    return module


@pytest.mark.parametrize("attribution", ["on_divergence", "always"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_monitor_checking_every_step_changes_no_training(tmp_path, name: str, attribution: str) -> None:
    # "always": the two-pass engine reruns the step from its captured start, inside the state after the step.
    case = CASES[name]
    plain = fit(tmp_path / "plain", case, None)
    monitor = RecomputationMonitor(every_n_steps=1, sentinel="off", attribution=attribution)  # type: ignore[arg-type]
    writes = "parameter" in name
    # A parameter written inside a region is written again by recomputation: attribution names that (a second
    # decay is a divergence), and training is compared with and without the monitor alike; so is a region that
    # reads what its forward wrote.
    inside = "inside a region" in name
    said = "changed parameters in place" + ("|recomputation diverged" if inside else "")
    learned = pytest.warns(LightningCkptDeterminismWarning, match=said)
    with learned if writes or inside else contextlib.nullcontext():
        monitored = fit(tmp_path / "monitored", case, monitor)
    assert same_state(plain, monitored)
    assert held_state(plain.model) == held_state(monitored.model)
    # A parameter written in `training_step` is learned at the first check, which is skipped; the others are checked.
    checked = list(monitor.history)[1 if writes else 0 :]
    assert [record.step for record in checked] == list(range(1 if writes else 0, STEPS))
    for record in checked:
        assert record.skipped is None
        if case.like_plain:
            assert record.grad_divergence == 0.0, record
        if not inside:
            assert not record.diverged, record
    last = monitor.last_report
    assert last is not None and last.cause != "outside_state" and last.not_restored == [], last


class TwoLosses(pl.LightningModule):
    """Manual optimization: a second loss backwards through the graph the first kept (``retain_graph=True``), a
    graph that saved a tensor the module holds: a buffer the forward multiplies by, or an activation it keeps as an
    attribute."""

    def __init__(self, held: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.held = held
        self.inp, self.body, self.head = nn.Linear(WIDTH, WIDTH), Around(nn.Tanh()), nn.Linear(WIDTH, 1)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.inp(x))
        if self.held == "attribute":
            self.activation = torch.tanh(h)  # `head` saves it for backward
            return self.head(self.activation)
        return self.head(h * self.gain)  # `mul` saves the buffer for backward

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        out = self(x)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(F.mse_loss(out, y), retain_graph=True)
        self.manual_backward(out.abs().mean())
        optimizer.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(4 * STEPS, WIDTH, generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(x, x.sum(dim=-1, keepdim=True)), batch_size=4)


def first_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(module(x), y)


@pytest.mark.parametrize("held", ["buffer", "attribute"])
def test_a_second_backward_through_a_kept_graph_runs_after_each_check(tmp_path, held: str) -> None:
    # Putting back a value the tensor still holds would bump its version counter: the second backward would refuse
    # the graph that saved it, and the fit would end.
    def fit_two_losses(monitor: RecomputationMonitor | None) -> TwoLosses:
        pl.seed_everything(0, verbose=False)
        module = TwoLosses(held)
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["body"]))
        callbacks = [monitor] if monitor is not None else []
        pl.Trainer(**trainer_kwargs(tmp_path, callbacks=callbacks, strategy=strategy, max_steps=STEPS)).fit(module)
        return module

    monitor = RecomputationMonitor(every_n_steps=1, loss_fn=first_loss)
    assert same_state(fit_two_losses(None), fit_two_losses(monitor))
    assert [(record.step, record.skipped, record.grad_divergence) for record in monitor.history] == [
        (step, None, 0.0) for step in range(STEPS)
    ]


class KeepsPredictions(CaseModule):
    """Keeps its last validation predictions as an attribute: an inference tensor when ``trainer.validate`` ran."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.predictions = self.model(batch[0])

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def test_an_inference_tensor_kept_by_validation_before_the_fit_leaves_every_check_running(tmp_path) -> None:
    # Putting it back in place outside inference mode is refused: every check failed and was skipped.
    def validated_then_fit(monitor: RecomputationMonitor | None) -> KeepsPredictions:
        pl.seed_everything(0, verbose=False)
        module = KeepsPredictions(CASES["a tensor attribute"].build)
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.body"]))
        callbacks = [monitor] if monitor is not None else []
        trainer = pl.Trainer(
            **trainer_kwargs(
                tmp_path,
                callbacks=callbacks,
                strategy=strategy,
                max_steps=STEPS,
                limit_val_batches=1,
                num_sanity_val_steps=0,  # the fit's own validation would bind a tensor made under `no_grad`
            )
        )
        trainer.validate(module, verbose=False)
        assert module.predictions.is_inference()
        trainer.fit(module)
        return module

    monitor = RecomputationMonitor(every_n_steps=1, sentinel="off")
    plain = validated_then_fit(None)
    monitored = validated_then_fit(monitor)
    assert same_state(plain, monitored) and held_state(plain.model) == held_state(monitored.model)
    assert [(record.step, record.skipped, record.grad_divergence) for record in monitor.history] == [
        (step, None, 0.0) for step in range(STEPS)
    ]


def test_state_is_put_back_bit_for_bit_and_written_only_where_it_changed() -> None:
    model = nn.BatchNorm1d(2)
    model.zero = torch.zeros(2)
    with torch.inference_mode():
        model.predictions = torch.zeros(2)
    state = StepState(model)
    model.zero.neg_()  # -0.0 is `==` to 0.0, and still another value
    with torch.inference_mode():
        model.predictions.add_(1.0)
    state.restore()
    assert model.zero.tolist() == [0.0, 0.0] and not model.zero.signbit().any()
    assert model.predictions.tolist() == [0.0, 0.0]
    # What holds its captured value is not written: its version counter, which a kept graph checks, stays.
    versions = model.running_mean._version, model.zero._version
    state.restore()
    assert (model.running_mean._version, model.zero._version) == versions


def test_a_buffer_registered_as_none_that_a_step_creates_is_removed_again_and_named() -> None:
    model = nn.Module()
    model.register_buffer("average", None)
    state = StepState(model)
    model.average = torch.ones(2)  # sized at the first forward
    assert state.differing_buffers() == ["average"]
    state.restore()
    assert model.average is None
    assert model._buffers == {"average": None}  # still registered, as before the step


class HookedInTrainingStep(CaseModule):
    """Registers a forward hook on its checkpointed block once, from step 1 on, keeping the handle on the block."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        body = self.model.body
        if self.global_step >= 1 and not hasattr(body, "handle"):
            body.handle = body.register_forward_hook(lambda module, args, out: out * 0.5)
        return super().training_step(batch, batch_idx)


def test_a_hook_handle_training_step_keeps_is_no_divergence_and_stays_the_live_one(tmp_path) -> None:
    # Each rerun of the step registers the hook again, under another handle id: the same hook all the same.
    runs = []
    for monitor in (None, RecomputationMonitor(every_n_steps=1, sentinel="off", on_divergence="raise")):
        pl.seed_everything(0, verbose=False)
        module = HookedInTrainingStep(Outside)
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.body"]))
        callbacks = [monitor] if monitor is not None else []
        kwargs = trainer_kwargs(tmp_path / str(len(runs)), callbacks=callbacks, strategy=strategy, max_steps=STEPS)
        pl.Trainer(**kwargs).fit(module)
        runs.append(module)
    assert [record.grad_divergence for record in monitor.history] == [0.0] * STEPS
    assert same_state(*runs)
    body = runs[1].model.body
    assert list(body._forward_hooks) == [body.handle.id]
    body.handle.remove()  # the handle the step kept removes the hook
    assert not body._forward_hooks


def test_small_tensors_in_containers_are_put_back_by_value_large_ones_and_long_lists_by_reference() -> None:
    # Copying a dataset, a cache or every step's loss at each check would cost their size: those stay references.
    model = nn.Linear(2, 2)
    model.stats = {"sum": torch.zeros(()), "cache": torch.zeros(1024)}
    model.losses = [torch.zeros(()) for _ in range(100)]
    state = StepState(model)
    for tensor in (model.stats["sum"], model.stats["cache"], model.losses[0]):
        tensor.add_(1.0)
    state.restore()
    assert float(model.stats["sum"]) == 0.0
    assert float(model.stats["cache"].sum()) == 1024.0 and float(model.losses[0]) == 1.0


def test_a_step_that_prunes_a_layer_is_checked_and_leaves_the_layer_as_it_was() -> None:
    # `torch.nn.utils.prune` moves `weight` to a `weight_orig` parameter, with a mask buffer and a pre-hook: each pass
    # prunes from the state the check puts back, and the check leaves the model as it found it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = tokens(0)
    before = list(model.named_parameters())
    state = {key: value.clone() for key, value in model.state_dict().items()}

    def pruned_loss() -> torch.Tensor:
        torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
        return loss_of(model, x)

    report = check_recomputation(model, pruned_loss)
    assert (report.diverged, report.grad_divergence, report.error, report.not_restored) == (False, 0.0, None, [])
    assert [(name, id(param)) for name, param in model.named_parameters()] == [
        (name, id(param)) for name, param in before
    ]
    assert same_state_dict(model.state_dict(), state)
    assert not model[0]._forward_pre_hooks
    loss_of(model, x).backward()  # the model still runs


def same_state_dict(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


class KeepsModelOutput(Outside):
    """Keeps its last output in a transformers ``ModelOutput`` (an ``OrderedDict`` whose fields are attributes too,
    and which refuses ``update``), rebound at each call, and counts its calls in a ``Counter``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.modeling_outputs import BaseModelOutput

        self.output_class = BaseModelOutput
        self.last = BaseModelOutput(last_hidden_state=torch.zeros(2))
        self.counts: Counter[str] = Counter()

    def scale(self, x: torch.Tensor) -> float:
        self.last = self.output_class(last_hidden_state=x.detach())
        self.counts["calls"] += 1
        return 1.0 + 0.1 * self.counts["calls"]


def test_a_model_output_held_as_an_attribute_is_put_back_as_it_was() -> None:
    checked = train(Case(KeepsModelOutput), checkpointed=True, check=True)
    assert same_run(checked, train(Case(KeepsModelOutput), checkpointed=False, check=False))
    assert [(report.diverged, report.error) for report in checked.reports] == [(False, None)] * STEPS
    last = checked.model.last
    assert list(last.keys()) == ["last_hidden_state"] and last["last_hidden_state"] is last.last_hidden_state
    assert torch.equal(last.last_hidden_state, tokens(STEPS - 1))


class Record:
    """What a block keeps of its last call, for logging: a value made afresh at every call."""

    def __init__(self) -> None:
        self.last: object | None = None


@dataclass
class Summary:
    """A record whose generated ``==`` is no truth value (it compares the tensor it holds)."""

    mean: torch.Tensor


class OneSlot:
    __slots__ = ("x",)


class ShadowedByAProperty(OneSlot):
    __slots__ = ()

    @property
    def x(self) -> int:
        raise RuntimeError("not ready")


class ShadowedByAClassAttribute(OneSlot):
    """As sympy's ``Integer`` shadows the slot ``q`` of its base ``Rational`` with a class attribute."""

    __slots__ = ()
    x = 1


def test_objects_whose_slot_a_subclass_shadows_and_read_only_c_members_are_checked_and_put_back() -> None:
    torch.manual_seed(0)
    model = Outside()
    held = [ShadowedByAProperty(), ShadowedByAClassAttribute()]
    model.body.held = held
    model.body.shadowed = ShadowedByAClassAttribute()
    # Classes written in C with read-only members, one pointer each, are no slotted objects; nor is the system's
    # entropy a generator with a state.
    model.body.delay, model.body.window = datetime.timedelta(seconds=30), slice(1, 5, 2)
    model.body.entropy = random.SystemRandom()
    OneSlot.x.__set__(held[0], 5)  # type: ignore[attr-defined]
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)
    report = check_recomputation(model, lambda: loss_of(model, x), attribution=True)
    assert (report.diverged, report.error, report.attribute_mutations) == (False, None, [])
    assert OneSlot.x.__get__(held[0]) == 5  # type: ignore[attr-defined]


@dataclass(slots=True)
class SlottedRecord:
    """:class:`Record` with slots."""

    last: object | None = None


@dataclass(slots=True)
class SlottedSummary:
    """:class:`Summary` with slots."""

    mean: torch.Tensor


class KeepsRecords(nn.Module):
    """A region that writes a fresh record of its call to an object it holds, in a list or as an attribute, and never
    reads it."""

    def __init__(self, held: str, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.kind = kind
        holder = SlottedRecord if kind.startswith("slotted") else Record
        if held == "list":
            self.records = [holder()]
        else:
            self.record = holder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record = self.records[0] if hasattr(self, "records") else self.record
        mean = x.detach().mean(dim=0)
        made: dict[str, Callable[[], object]] = {
            "object": Tracker,
            "dataclass holding a tensor": lambda: Summary(mean),
            "slotted": SlottedTracker,
            "slotted holding a tensor": lambda: SlottedSummary(mean),
        }
        record.last = made[self.kind]()
        return torch.tanh(self.inp(x))


@pytest.mark.parametrize("kind", ["object", "dataclass holding a tensor", "slotted", "slotted holding a tensor"])
@pytest.mark.parametrize("held", ["list", "attribute"])
def test_a_record_rebound_at_every_call_on_an_object_the_region_holds_is_no_finding(held: str, kind: str) -> None:
    # The record is made afresh by the forward and again by recomputation, alike: nothing the step reads changed.
    case = Case(lambda: Outside(KeepsRecords(held, kind)))
    checked = train(case, checkpointed=True, check=True)
    assert same_run(checked, train(case, checkpointed=False, check=False))
    assert [(report.diverged, report.attribute_mutations) for report in checked.reports] == [(False, [])] * STEPS


def test_the_state_of_a_compiled_module_is_named_as_users_write_it() -> None:
    # `torch.compile` wraps the model in a module holding it as `_orig_mod`: hints name what the config and the
    # warnings' own figures name, without it (nothing is compiled here: the wrapper compiles at its first call).
    model = nn.Sequential(nn.BatchNorm1d(2))
    model[0].seen = 0
    state = StepState(torch.compile(model))
    with torch.no_grad():
        model[0].running_mean.add_(1.0)
    model[0].seen = 1
    assert state.differing_buffers() == ["0.running_mean"]
    assert state.differing_attributes() == ["0.seen"]


def test_checks_leave_no_more_context_variables_in_the_callers_context_than_the_first_one() -> None:
    # torch makes a context variable for each config patch object, which stays after the patch exits: a patch made
    # per reference pass left one more at every check, for the life of the run.
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0", "1"]))
    x = torch.randn(4, 8)
    check_recomputation(model, lambda: model(x).sum())
    before = len(contextvars.copy_context())
    for _ in range(5):
        assert not check_recomputation(model, lambda: model(x).sum()).diverged
    assert len(contextvars.copy_context()) == before
