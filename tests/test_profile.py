"""What a region's first checkpointed forward teaches its wrapper (`checkpointing/profile.py`), and the replay of a
forward's state in recomputation (`checkpointing/contexts.py`): buffers, plain attributes and generators."""

import contextlib
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, check_recomputation
from lightning_ckpt_determinism.checkpointing.profile import OPAQUE_WORKSPACES
from lightning_ckpt_determinism.checkpointing.wrapper import buffers_read_otherwise
from tests.helpers import (
    DIM,
    BatchNormBlock,
    BufferCounter,
    InferenceCacheBlock,
    PartsBlock,
    PlainBlock,
    WrittenAfterItsForward,
    batch,
    one_process_group,
    twins,
)


def checkpointed(module: nn.Module) -> nn.Module:
    apply_activation_checkpointing(module, CheckpointingConfig(names=["0"]))
    return module


def step(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x, y = batch()
    torch.manual_seed(seed)
    out = model(x)
    F.mse_loss(out.flatten(1)[:, :1], y).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


class RReLUAtTheEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.act = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def test_the_first_call_learns_which_saved_tensors_are_filled_after_they_are_saved() -> None:
    model = checkpointed(nn.Sequential(RReLUAtTheEnd()))
    wrapper = model[0].forward
    assert wrapper.profile is None
    step(model)
    profile = wrapper.profile
    # addmm saves the input (the weight is a parameter), rrelu_with_noise its noise, then its input.
    assert profile is not None and profile.saved == 3
    assert profile.filled_late == frozenset({1})
    assert profile.workspaces == frozenset()


class PrefilledNoise(nn.Module):
    """``rrelu_with_noise`` given a noise tensor that already holds the values the op writes into it, as the caching
    allocator can hand an uninitialised one (the memory of the same draw, just freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.ones_like(x)
        return torch.ops.aten.rrelu_with_noise(self.linear(x), noise, 1.0, 1.0, True) * 2


def test_a_saved_tensor_an_op_writes_after_saving_it_is_filled_late_even_if_its_values_already_matched() -> None:
    model = checkpointed(nn.Sequential(PrefilledNoise()))
    step(model)
    # addmm saves the input, rrelu_with_noise its noise (written in place after it is saved), then its input.
    assert model[0].forward.profile.filled_late == frozenset({1})


class UnfilledNoise(nn.Module):
    """A functional RReLU whose ``training`` argument is false: its noise is saved and never written."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rrelu(self.linear(x), training=False)


def test_the_unwritten_noise_of_an_rrelu_is_mode_dependent_and_left_out() -> None:
    # Whether the op writes it is its `training` argument, which no profile key sees: a later call may write it.
    model = checkpointed(nn.Sequential(UnfilledNoise()))
    step(model)
    profile = model[0].forward.profile
    assert (profile.unwritten, profile.mode_dependent, profile.filled_late) == (frozenset({1}),) * 2 + (frozenset(),)
    assert profile.left_out == frozenset({1})


def test_an_lstm_workspace_is_found_among_the_saved_tensors() -> None:
    lstm = nn.LSTM(DIM, DIM, batch_first=True)

    class Features(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = lstm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x.unsqueeze(1))[0].squeeze(1)

    model = checkpointed(nn.Sequential(Features()))
    step(model)
    profile = model[0].forward.profile
    assert "aten.mkldnn_rnn_layer" in OPAQUE_WORKSPACES
    assert profile is not None and len(profile.workspaces) == 1
    assert profile.filled_late == frozenset()


def test_the_buffers_and_attributes_a_forward_changes_are_learned_and_generators_found() -> None:
    block = BatchNormBlock()
    block.calls = 0
    block.label = "constant"
    block.noise = torch.Generator().manual_seed(0)
    original = block.forward

    def counting(x: torch.Tensor) -> torch.Tensor:
        block.calls += 1
        return original(x)

    block.forward = counting  # type: ignore[method-assign]
    model = checkpointed(nn.Sequential(block))
    step(model)
    profile = model[0].forward.profile
    assert profile is not None
    assert profile.buffers == frozenset({"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"})
    # The count the forward rebound was put back for its recomputation, which counted from where the forward did (the
    # wrapper finds rebound attributes at each call, `contexts.AttributeReplay`, rather than in the profile).
    assert block.calls == 1
    assert [name for name, _ in profile.generators] == ["noise"]


class LateBuffer(nn.Module):
    """Updates a count buffer (of ``size`` elements) in place once ``armed``: a buffer the first call did not
    change."""

    def __init__(self, size: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.armed = False
        self.register_buffer("count", torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.count += 1
        return torch.tanh(self.linear(x) * (1 + self.count.flatten()[0]))


class ReplacedBuffer(nn.Module):
    """Replaces its step buffer by assignment in forward, and reads the new one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return torch.tanh(self.linear(x) / self.steps)


def test_a_buffer_replaced_by_assignment_is_replayed_and_the_live_one_kept() -> None:
    plain, model = twins(lambda: nn.Sequential(ReplacedBuffer()), ["0"])
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert int(model[0].steps) == int(plain[0].steps) == 3


# A count, copied as each forward starts, so that even a write through `.data` between calls (no version bump) is
# seen; and a table of 64 KiB, whose copy is kept from call to call until something writes it.
@pytest.mark.parametrize(
    ("size", "through_data"),
    [((), False), ((), True), ((128, 128), False)],
    ids=["count", "count written through .data", "table"],
)
def test_a_buffer_first_changed_after_the_first_call_is_replayed_from_the_next_forward(
    caplog: pytest.LogCaptureFixture, size: tuple[int, ...], through_data: bool
) -> None:
    plain, model = twins(lambda: nn.Sequential(LateBuffer(size)), ["0"])
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        for seed in range(2):
            expected, got = step(plain, seed), step(model, seed)
            assert all(torch.equal(expected[name], got[name]) for name in expected)
        assert model[0].forward.profile.buffers == frozenset()
        with torch.no_grad():  # written between calls (a state loaded, an old-style update through `.data`)
            for net in (plain, model):
                (net[0].count.data if through_data else net[0].count).fill_(2.0)
        plain[0].armed = model[0].armed = True
        # The forward changes the count for the first time: noted, and recomputed from the count it started from.
        expected, got = step(plain, 2), step(model, 2)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
        assert model[0].forward.profile.buffers == frozenset({"count"})
    (line,) = [record.getMessage() for record in caplog.records if "changed its buffer" in record.getMessage()]
    assert "region `0` changed its buffer `count` in forward, which it had not been seen to do" in line
    # Counted once, as without checkpointing, and replayed from then on.
    assert torch.equal(model[0].count, plain[0].count) and float(model[0].count.flatten()[0]) == 3.0
    expected, got = step(plain, 3), step(model, 3)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert torch.equal(model[0].count, plain[0].count) and float(model[0].count.flatten()[0]) == 4.0


class LazyPositions(nn.Module):
    """Builds a small positional table at its first forward, in a buffer registered as `None` (as lazily built
    rotary caches do); ``dropout`` after its linear layer when given."""

    def __init__(self, lazy: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("table", None if lazy else torch.arange(float(DIM)).cos(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.register_buffer("table", torch.arange(float(DIM)).cos(), persistent=False)
        return x + self.dropout(torch.tanh(self.linear(x * self.table)))


def test_a_buffer_the_forward_creates_is_recomputed_from_none_and_never_counted_as_read_otherwise() -> None:
    plain, model = twins(lambda: nn.Sequential(LazyPositions(lazy=True)), ["0"])
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
        model[0].table = plain[0].table = None  # a cache reset every step
    assert buffers_read_otherwise(model) == {}


@pytest.mark.parametrize("lazy", [False, True])
def test_a_buffer_the_forward_creates_is_not_named_the_cause_of_another_defect(lazy: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LazyPositions(lazy, dropout=0.5))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], preserve_rng_state=False))
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x).flatten(1)[:, :1], y))
    # Dropout drawn anew diverges; without attribution no cause is guessed, the table built up front or lazily.
    assert report.diverged and report.grad_divergence > 0
    assert (report.cause, report.hint, report.buffer_mutations) == (None, None, [])


class AveragedFromItsSecondCall(nn.Module):
    """Creates a buffer registered as `None` at its second call, and updates it in place at every call after."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("mean", None)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.mean is None and self.calls >= 2:
            self.mean = x.detach().mean(0)
        elif self.mean is not None:
            self.mean.mul_(0.5).add_(x.detach().mean(0))
        return torch.tanh(self.linear(x)) * (1 + (self.mean if self.mean is not None else 0))


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = AveragedFromItsSecondCall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


def test_a_call_that_ran_without_a_buffer_a_later_call_creates_is_recomputed_without_it() -> None:
    # The first call's recomputation, after the second call created the buffer, runs as its forward did: without it,
    # so it neither takes the update path nor writes the live average a second time.
    plain, model = twins(CalledTwice, ["block"])
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
        assert torch.equal(plain.block.mean, model.block.mean)
        assert plain.block.calls == model.block.calls


class CumulativeInstanceNorm(nn.Module):
    """An instance norm tracking running statistics with ``momentum=None``: its kernel writes them back unchanged
    in training (a version bump with the same values)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.InstanceNorm1d(DIM, track_running_stats=True, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x).unsqueeze(-1).expand(-1, -1, 4)).sum(-1)


def test_a_buffer_written_back_unchanged_at_the_first_call_is_learned_there_and_not_noted_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain, model = twins(lambda: nn.Sequential(CumulativeInstanceNorm()), ["0"])
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        for seed in range(3):
            expected, got = step(plain, seed), step(model, seed)
            assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert model[0].forward.profile.buffers == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert [record.getMessage() for record in caplog.records if "for the first time" in record.getMessage()] == []


def test_a_buffer_made_under_inference_mode_trains_as_without_checkpointing() -> None:
    plain, model = twins(lambda: nn.Sequential(InferenceCacheBlock()), ["0"])
    with torch.inference_mode():  # the sanity check's validation batches
        plain(batch()[0]), model(batch()[0])
    assert model[0].table.is_inference()
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert torch.equal(model[0].table, plain[0].table)


def add_a_norm(parts: nn.ModuleList) -> None:
    parts.append(nn.BatchNorm1d(DIM))


def swap_in_a_norm(parts: nn.ModuleList) -> None:
    parts[1] = nn.BatchNorm1d(DIM)


@pytest.mark.parametrize("change", [add_a_norm, swap_in_a_norm])
def test_a_submodule_added_or_replaced_after_wrapping_has_its_buffers_protected(change, caplog) -> None:
    plain, model = twins(lambda: nn.Sequential(PartsBlock()), ["0"])
    for seed in range(4):
        if seed == 2:
            change(plain[0].parts), change(model[0].parts)
        with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
            expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
        assert all(
            torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
        )
    # The norm's statistics moved once a step, as without checkpointing.
    assert int(model[0].parts[-1].num_batches_tracked) == 2
    assert [r.getMessage() for r in caplog.records if "other submodules" in r.getMessage()] == [
        "lightning_ckpt_determinism: region `0` holds other submodules than at its last call; it learns them again."
    ]


def test_a_lazy_module_swapped_into_a_region_initialises_at_a_plain_call_as_at_wrapping() -> None:
    def build() -> nn.Module:
        block = PartsBlock()
        block.parts.append(nn.Dropout(0.5))  # draws after the lazy module's initialisation has drawn
        return nn.Sequential(block)

    plain, model = twins(build, ["0"])
    for seed in range(3):
        if seed == 1:
            plain[0].parts[1], model[0].parts[1] = nn.LazyLinear(DIM), nn.LazyLinear(DIM)
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)


class NormMadeInForward(nn.Module):
    """A linear layer and a batch norm its first forward makes (where ``__init__`` left ``None``), then tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            self.norm = nn.BatchNorm1d(DIM)
        return x + torch.tanh(self.norm(self.linear(x)))


class UsesMadeNorm(nn.Module):
    """A :class:`NormMadeInForward`, called ``twice`` in a step, or once and then its norm once more outside it."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.twice = twice
        self.block = NormMadeInForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        return self.block(2 * h) if self.twice else self.block.norm(3 * h)


@pytest.mark.parametrize("use", ["once", "twice", "again_outside"])
def test_a_submodule_a_forward_makes_trains_and_updates_its_statistics_as_without_checkpointing(use: str) -> None:
    build = (lambda: nn.Sequential(NormMadeInForward())) if use == "once" else (lambda: UsesMadeNorm(use == "twice"))
    plain, model = twins(build, ["0" if use == "once" else "block"])
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        # Its parameters have gradients from the first step on: the recomputation used the norm the forward made.
        assert sorted(got) == sorted(expected) and all(torch.equal(expected[name], got[name]) for name in expected)
        # Its statistics as without checkpointing: updated once per call, also by the caller between the forward and
        # the recomputation, whose update the recomputation keeps.
        states = zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in states)


def test_a_submodule_a_forward_makes_is_kept_apart_from_selective_checkpointing_as_without_checkpointing() -> None:
    torch.manual_seed(0)
    plain, model = nn.Sequential(NormMadeInForward()), nn.Sequential(NormMadeInForward())
    model.load_state_dict(plain.state_dict())
    # `save_ops` counts the recomputation's op calls: the copies of the made norm's buffers must not be among them.
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], save_ops=["aten.addmm"]))
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert sorted(got) == sorted(expected) and all(torch.equal(expected[name], got[name]) for name in expected)
        states = zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in states)


# Which buffer each writer's first write names: the large table replaced. The small ones (the shift, the norm's
# statistics) are recomputed from the copies taken as the forward started whoever wrote them since, with nothing to
# note; a shared module's statistics change in the block's forward too.
WRITTEN = {"caller": None, "shared": None, "statistics": None, "replaced": "2.shift"}


@pytest.mark.parametrize("writer", sorted(WRITTEN))
def test_a_buffer_written_between_the_forward_and_its_recomputation_is_replayed_as_the_forward_read_it(
    caplog: pytest.LogCaptureFixture, writer: str
) -> None:
    plain, model = twins(lambda: WrittenAfterItsForward(writer), ["block"])
    x, y = batch()
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        for _ in range(3):  # the first call learns; the second finds the write as it recomputes; the third replays
            grads = []
            for net in (plain, model):
                net.zero_grad(set_to_none=True)
                F.mse_loss(net(x), y).backward()
                grads.append({name: param.grad.clone() for name, param in net.named_parameters()})
            assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in model.state_dict().items())
    said = [record.getMessage() for record in caplog.records if "was written between" in record.getMessage()]
    assert said == [
        f"lightning_ckpt_determinism: region `block`'s buffer `{name}` was written between its forward and its"
        " recomputation (by code outside the region, or a module sharing the buffer); the region replays it from now"
        " on."
        for name in [WRITTEN[writer]]
        if name is not None
    ]


@pytest.mark.parametrize("protect_buffers", [True, False])
def test_recomputation_hands_out_the_buffers_themselves(protect_buffers: bool) -> None:
    model = nn.Sequential(BufferCounter())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], protect_buffers=protect_buffers))
    step(model)
    # torch's own checkpoint gives [1, 1, 1]: the backward's update lands on the buffer itself, not on a copy.
    assert model[0].counter.tolist() == [1.0, 1.0, 1.0]


def test_a_region_pickled_after_its_first_call_learns_again_in_its_copy() -> None:
    model = checkpointed(nn.Sequential(PlainBlock()))
    step(model)
    assert model[0].forward.profile is not None
    copied = pickle.loads(pickle.dumps(model))
    assert copied[0].forward.profile is None
    assert all(torch.equal(a, b) for a, b in zip(step(model).values(), step(copied).values(), strict=True))
    assert copied[0].forward.profile is not None


class DTensorDropoutBlock(nn.Module):
    """An up projection whose output stays a DTensor under tensor parallelism, dropout on it (two in-place ops on
    its noise), and a down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.dropout = nn.Dropout(0.3)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.dropout(torch.tanh(self.up(x))))


@contextlib.contextmanager
def tensor_parallel_block(tmp_path: Path) -> Iterator[tuple[nn.Sequential, torch.Tensor, int]]:
    """A :class:`DTensorDropoutBlock` sharded over a one-process mesh and checkpointed, an input, and the number of
    autograd nodes its plain forward makes (the ground truth of a learned path's count)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with one_process_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Sequential(DTensorDropoutBlock())
        parallelize_module(model[0], mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        x = torch.randn(4, 8)
        before = torch.autograd._get_sequence_nr()
        model(x)
        made = torch.autograd._get_sequence_nr() - before
        apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
        yield model, x, made


def test_a_learning_call_counts_the_autograd_nodes_the_forward_makes_under_tensor_parallelism(tmp_path) -> None:
    # The probe's own reads of DTensors (`to_local()`) made autograd nodes a steady call does not: every later call
    # took an unknown path, was not compared, and made the next call learn again.
    from lightning_ckpt_determinism.verify.sentinel.observer import region_profile

    with tensor_parallel_block(tmp_path) as (model, x, made):
        paths = []
        for _ in range(3):
            model(x).sum().backward()
            profile = region_profile(model[0])
            paths.append(None if profile is None else profile.path[1])
    assert paths == [made, made, made]


@pytest.mark.parametrize("ops", [False, True], ids=["module", "op"])
def test_a_call_measured_for_a_memory_budget_counts_the_autograd_nodes_the_forward_makes_under_tensor_parallelism(
    tmp_path, ops: bool
) -> None:
    # A memory budget measures the fit's first batch, reading each region's saved tensors and inputs (DTensors under
    # tensor parallelism) as that batch's forwards run. Read with grad mode on, `to_local()` made autograd nodes the
    # forward does not: the path learned at that call was one no later call takes, and every region's call at the
    # batch the plan took effect went uncompared (counted as a new path).
    from lightning_ckpt_determinism.checkpointing.measure import ActivationMeter
    from lightning_ckpt_determinism.verify.sentinel.observer import region_profile

    with tensor_parallel_block(tmp_path) as (model, x, made):
        meter = ActivationMeter(model, {"0": model[0]}, ops=ops)
        with meter.measuring():
            model(x).sum().backward()
        profile = region_profile(model[0])
    assert profile is not None
    assert profile.path[1] == made
    assert meter.figures()[0].calls == 1


def test_a_region_given_op_outputs_to_keep_learns_its_path_again_at_its_next_call() -> None:
    # A memory budget's op plan takes effect at the fit's second batch: what the region saves then is not what its
    # learned paths say (under tensor parallelism with a tiny Llama every call of that step read as an unknown path,
    # "the sentinel compared nothing"); the calls of the same plan keep the profile they learn.
    from lightning_ckpt_determinism.checkpointing.wrapper import keep_op_calls
    from lightning_ckpt_determinism.verify.sentinel.observer import region_profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), PlainBlock(), nn.Linear(DIM, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
    x = torch.randn(4, DIM)
    measured = ["aten.t.default", "aten.addmm.default", "aten.tanh.default", "aten.add.Tensor"]
    profiles = []
    for step in range(5):
        if step == 2:
            keep_op_calls(model[1], [(1, "aten.addmm.default")], measured)
        if step == 4:
            keep_op_calls(model[1], [(1, "aten.addmm.default")], measured)  # the same plan again: nothing to learn
        model(x).sum().backward()
        profiles.append(region_profile(model[1]))
    assert all(profile is not None for profile in profiles)
    assert profiles[0] is profiles[1] and profiles[2] is profiles[3] is profiles[4] and profiles[2] is not profiles[1]
