"""Tests for `lightning_ckpt_determinism.checkpointing.rng` and the RNG replay of checkpointed regions."""

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, check_recomputation
from lightning_ckpt_determinism.checkpointing.rng import capture_host_rng, capture_rng, restore_host_rng, restore_rng
from tests.helpers import DropoutBlock, NumpyNoiseBlock, PythonRandomBlock, batch, make_stack, step_gradients


def _draws() -> tuple[float, float, float]:
    """The next number of torch's CPU stream, NumPy's global stream and Python's ``random``."""
    return torch.rand(1).item(), float(np.random.random()), random.random()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_restore_rng_rewinds_torch_numpy_and_python() -> None:
    _seed_all(0)
    state = capture_rng()
    first = _draws()
    assert _draws() != first
    restore_rng(state)
    assert _draws() == first


def test_restore_host_rng_rewinds_numpy_and_python_but_not_torch() -> None:
    _seed_all(0)
    state = capture_host_rng()
    torch_first, numpy_first, python_first = _draws()
    restore_host_rng(state)
    torch_second, numpy_second, python_second = _draws()
    assert (numpy_second, python_second) == (numpy_first, python_first)
    assert torch_second != torch_first


def test_capture_rng_ignores_cpu_and_meta_devices() -> None:
    state = capture_rng([torch.device("cpu"), torch.device("meta"), "cpu"])  # type: ignore[list-item]
    assert state.devices == {}
    assert torch.equal(state.torch_cpu, torch.get_rng_state())


def test_capture_rng_never_initialises_cuda() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("needs a process in which CUDA has not been initialised; an earlier test initialised it")
    state = capture_rng([torch.device("cuda")])
    assert state.devices == {}
    assert not torch.cuda.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_rng_captures_and_restores_an_initialised_cuda_device() -> None:
    torch.cuda.init()
    state = capture_rng([torch.device("cuda"), torch.device("cuda", 0)])
    assert list(state.devices) == [torch.device("cuda", 0)]
    first = torch.rand(4, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


# Replay of the host streams during recomputation.


def _host_rng_step(block: type[nn.Module], config: CheckpointingConfig | None) -> tuple[dict, tuple]:
    """Gradients of one step of a stack of ``block`` and the next draw of every stream after it."""
    model = make_stack(block)
    if config is not None:
        apply_activation_checkpointing(model, config)
    _seed_all(11)
    gradients = step_gradients(model)
    return gradients, _draws()


def _unequal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


@pytest.mark.parametrize("block", [NumpyNoiseBlock, PythonRandomBlock])
def test_host_rng_replay_reproduces_gradients_and_leaves_the_streams_as_unchecked(block: type[nn.Module]) -> None:
    reference_gradients, reference_draws = _host_rng_step(block, None)
    config = CheckpointingConfig(classes=[block.__name__], preserve_host_rng=True)
    gradients, draws = _host_rng_step(block, config)
    assert _unequal(reference_gradients, gradients) == []
    assert draws == reference_draws


@pytest.mark.parametrize("block", [NumpyNoiseBlock, PythonRandomBlock])
def test_without_host_rng_replay_gradients_and_streams_differ(block: type[nn.Module]) -> None:
    reference_gradients, reference_draws = _host_rng_step(block, None)
    gradients, draws = _host_rng_step(block, CheckpointingConfig(classes=[block.__name__], preserve_host_rng=False))
    differing = _unequal(reference_gradients, gradients)
    assert [f"blocks.{index}.linear.weight" for index in range(3)] == [
        name for name in differing if name.endswith(".linear.weight")
    ]
    torch_next, numpy_next, python_next = draws
    # Recomputation drew again from the live stream the block uses, leaving it ahead; torch forks its own stream.
    assert torch_next == reference_draws[0]
    if block is NumpyNoiseBlock:
        assert numpy_next != reference_draws[1]
        assert python_next == reference_draws[2]
    else:
        assert numpy_next == reference_draws[1]
        assert python_next != reference_draws[2]


def test_torch_rng_replay_leaves_torch_stream_as_unchecked() -> None:
    _, reference_draws = _host_rng_step(DropoutBlock, None)
    _, draws = _host_rng_step(DropoutBlock, CheckpointingConfig(classes=["DropoutBlock"]))
    assert draws == reference_draws


def test_host_rng_replay_with_torch_rng_off_still_replays_the_host_streams() -> None:
    reference_gradients, reference_draws = _host_rng_step(NumpyNoiseBlock, None)
    config = CheckpointingConfig(classes=["NumpyNoiseBlock"], preserve_host_rng=True, preserve_rng_state=False)
    gradients, draws = _host_rng_step(NumpyNoiseBlock, config)
    assert _unequal(reference_gradients, gradients) == []
    assert draws[1:] == reference_draws[1:]


class HeldGeneratorBlock(nn.Module):
    """Scales its output by draws from the NumPy and ``random`` generators it holds, as exploration code does."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.numpy_rng = np.random.default_rng(0)
        self.legacy_rng = np.random.RandomState(1)
        self.python_rng = random.Random(2)

    def generators(self) -> tuple[np.random.Generator, np.random.RandomState, random.Random]:
        return self.numpy_rng, self.legacy_rng, self.python_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        numpy_rng, legacy_rng, python_rng = self.generators()
        scale = 1.0 + numpy_rng.random() + legacy_rng.rand() + python_rng.random()
        return x + torch.tanh(self.linear(x) * scale)


class ContainedGeneratorBlock(HeldGeneratorBlock):
    """:class:`HeldGeneratorBlock` with its generators in a list and a dict, beside a ``random.SystemRandom`` (the
    system's entropy: no state to replay) it never draws from."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__(dim)
        self.rngs = [self.__dict__.pop("numpy_rng"), self.__dict__.pop("legacy_rng")]
        self.by_name = {"python": self.__dict__.pop("python_rng")}
        self.entropy = random.SystemRandom()

    def generators(self) -> tuple[np.random.Generator, np.random.RandomState, random.Random]:
        return self.rngs[0], self.rngs[1], self.by_name["python"]


def _held_generator_step(block: type[nn.Module], config: CheckpointingConfig | None) -> tuple[dict, list[float]]:
    """Gradients of one step of a stack of ``block``, and the next draw of each block's generators."""
    model = make_stack(block)
    if config is not None:
        apply_activation_checkpointing(model, config)
    gradients = step_gradients(model)
    draws = []
    for held in model.blocks:
        numpy_rng, legacy_rng, python_rng = held.generators()
        draws += [numpy_rng.random(), legacy_rng.rand(), python_rng.random()]
    return gradients, draws


@pytest.mark.parametrize("block", [HeldGeneratorBlock, ContainedGeneratorBlock])
def test_host_rng_replay_replays_the_generators_a_region_holds_and_leaves_them_as_unchecked(
    block: type[nn.Module],
) -> None:
    reference_gradients, reference_draws = _held_generator_step(block, None)
    replayed = CheckpointingConfig(classes=[block.__name__], preserve_host_rng=True)
    gradients, draws = _held_generator_step(block, replayed)
    assert _unequal(reference_gradients, gradients) == []
    assert draws == reference_draws
    # Without the replay, recomputation draws again: other gradients, and every generator ahead.
    unreplayed, ahead = _held_generator_step(block, CheckpointingConfig(classes=[block.__name__]))
    assert _unequal(reference_gradients, unreplayed) != []
    assert all(one != other for one, other in zip(ahead, reference_draws, strict=True))


@pytest.mark.parametrize("block", [HeldGeneratorBlock, ContainedGeneratorBlock])
def test_a_region_drawing_from_generators_it_holds_is_named_host_rng(block: type[nn.Module]) -> None:
    model = make_stack(block)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[block.__name__]))
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert report.diverged
    assert [(region.name, region.cause) for region in report.regions] == [
        (f"blocks.{index}", "host_rng") for index in range(3)
    ]
