"""The recompute contexts of `checkpointing/contexts.py` on their own: what `ForwardState` replays (nothing at all when
a forward changed nothing it replays, a buffer changed late, the live state put back whatever is raised), and
`Reenterable`'s entries."""

import gc
import weakref
from contextlib import AbstractContextManager
from types import TracebackType

import pytest
import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.contexts import (
    KEPT_BUFFER_BYTES,
    NO_CONTEXT,
    SMALL_BUFFER_BYTES,
    BufferSlot,
    BufferStarts,
    ForwardState,
    Reenterable,
)
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from tests.helpers import DIM


class Counted(nn.Module):
    """Scales by a buffer it never changes; once ``armed``, counts its calls in a second buffer, in place, and scales
    by the count too (a scalar, or ``count_size`` equal counts); with ``fail``, raises after counting. Holds a
    generator of its own."""

    def __init__(self, count_size: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.armed = False
        self.fail = False
        self.noise = torch.Generator().manual_seed(0)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("count", torch.ones(count_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.count += 1
        if self.fail:
            raise ValueError("the forward failed")
        return torch.tanh(self.linear(x) * self.scale * self.count.view(-1)[0])


def _slots(module: nn.Module) -> list[BufferSlot]:
    return [("scale", module, "scale"), ("count", module, "count")]


def _state(
    module: Counted, buffers: frozenset[str] | None, changed: list[str], read_otherwise: list[str] | None = None
) -> ForwardState:
    """A forward's state with a profile that lists ``buffers`` (``None``: a learning call, no profile); the names of
    the buffers it sees changed late go to ``changed``, those its recomputation gets otherwise to ``read_otherwise``."""
    profile = None if buffers is None else RegionProfile(saved=0, buffers=buffers)
    read = read_otherwise if read_otherwise is not None else []
    return ForwardState(
        module, profile, _slots(module), generators=False, changed=changed.append, read_otherwise=read.append
    )


def test_a_forward_that_changed_nothing_it_replays_is_recomputed_through_the_shared_no_op() -> None:
    # Its buffers kept from call to call (over `SMALL_BUFFER_BYTES`): nothing to put in for the recomputation.
    module, changed = Counted((SMALL_BUFFER_BYTES // 4 + 1,)), []
    module.scale = torch.ones(SMALL_BUFFER_BYTES // (4 * DIM) + 1, 1, DIM)  # broadcasts over the batch
    state = _state(module, frozenset(), changed)
    with state.capture():
        module(torch.ones(2, DIM))
    assert changed == []
    assert state.replay() is NO_CONTEXT
    # Small ones are recomputed from the copies taken as the forward started, written into the buffers themselves
    # (whatever wrote them since without a version bump), and their live values are written back after.
    module = Counted()
    state = _state(module, frozenset(), changed)
    with state.capture():
        module(torch.ones(2, DIM))
    live = dict(module.named_buffers())
    values = {name: buffer.clone() for name, buffer in live.items()}
    versions = {name: buffer._version for name, buffer in live.items()}
    module.scale.data.mul_(2.0)  # written through `.data`: no version bump
    with state.replay():
        for name, buffer in module.named_buffers():
            assert buffer is live[name] and torch.equal(buffer, values[name])
    assert dict(module.named_buffers()) == live
    assert torch.equal(module.scale, 2.0 * values["scale"])
    assert {name: buffer._version for name, buffer in live.items()} == versions
    # A learning call (no profile) replays every buffer, and a profile's buffers are replayed: a swap, not the no-op.
    for buffers in (None, frozenset({"scale"})):
        listed = _state(module, buffers, changed)
        with listed.capture():
            module(torch.ones(2, DIM))
        assert listed.replay() is not NO_CONTEXT


@pytest.mark.parametrize(
    "count_size",
    [(), (SMALL_BUFFER_BYTES // 4 + 1,), (KEPT_BUFFER_BYTES // 4 + 1,)],
    ids=["copied at each call", "kept from call to call", "large"],
)
def test_a_buffer_first_changed_by_this_forward_is_recomputed_from_its_start_if_small_and_changed_once(
    count_size: tuple[int, ...],
) -> None:
    torch.manual_seed(0)
    module, changed = Counted(count_size), []
    plain = Counted(count_size)
    plain.load_state_dict(module.state_dict())
    module.armed = plain.armed = True
    read_otherwise: list[str] = []
    state = _state(module, frozenset(), changed, read_otherwise)
    x = torch.randn(2, DIM)
    with state.capture():
        out = module(x)
    # The profile did not list it: seen changed at the forward's end, and replayed (decided at recomputation).
    assert changed == ["count"]
    large = bool(count_size) and count_size[0] * 4 > KEPT_BUFFER_BYTES
    # Reported as recomputed from other values than the forward started from where it was not copied: the large one
    # alone (not `scale`, the module's other buffer, which the forward left as it was).
    assert read_otherwise == (["count"] if large else [])
    replay = state.replay()
    assert replay is not NO_CONTEXT
    with replay:
        recomputed = module(x)
    expected = plain(x)
    assert torch.equal(out, expected)
    if large:
        # Too large to copy before it was known to change: recomputed from the value the forward left.
        assert torch.equal(recomputed, torch.tanh(plain.linear(x) * plain.scale * (plain.count[0] + 1)))
    else:
        # Copied as the forward started (or kept since the region's last call): recomputed from there, as a buffer
        # the profile lists.
        assert torch.equal(recomputed, out)
    # Either way the live value is given back: changed once, as without checkpointing.
    assert torch.equal(module.count, plain.count)
    assert float(module.count.view(-1)[0]) == 2.0


def test_the_live_buffers_and_generators_are_put_back_when_a_recomputation_raises() -> None:
    module = Counted()
    state = ForwardState(module, None, _slots(module), generators=True)
    module.armed = True
    with state.capture():
        module(torch.ones(2, DIM))
        torch.rand(1, generator=module.noise)
    count, live_count, live_noise = module.count, module.count.clone(), module.noise.get_state()
    with pytest.raises(ValueError, match="the recomputation failed"), state.replay():
        # The forward's starting values are in.
        assert float(module.count) == 1.0
        assert not torch.equal(module.noise.get_state(), live_noise)
        module(torch.ones(2, DIM))
        torch.rand(1, generator=module.noise)
        raise ValueError("the recomputation failed")
    assert module.count is count
    assert torch.equal(module.count, live_count)
    assert torch.equal(module.noise.get_state(), live_noise)


def test_a_forward_that_raised_notes_no_buffer_changed() -> None:
    module, changed = Counted(), []
    module.armed = module.fail = True
    state = _state(module, frozenset(), changed)
    with pytest.raises(ValueError, match="the forward failed"), state.capture():
        module(torch.ones(2, DIM))
    # As before the contexts were classes: the check at the forward's end runs only after a forward that returned.
    assert changed == []
    assert state.replay() is NO_CONTEXT


class _Recording(AbstractContextManager[None]):
    """Records its entry and what its exit saw; suppresses the exception when told to."""

    def __init__(self, log: list[str], suppress: bool) -> None:
        self._log = log
        self._suppress = suppress

    def __enter__(self) -> None:
        self._log.append("enter")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._log.append(f"exit {None if exc_type is None else exc_type.__name__}")
        return self._suppress


@pytest.mark.parametrize("factories", [1, 2])
def test_reenterable_enters_fresh_contexts_each_time_and_passes_exceptions_and_suppression_through(
    factories: int,
) -> None:
    log: list[str] = []
    suppress = [False]
    context = Reenterable([lambda: _Recording(log, suppress[0])] * factories)
    with context:
        pass
    with pytest.raises(KeyError), context:
        raise KeyError("x")
    suppress[0] = True
    with context:
        raise KeyError("x")
    assert log == ["enter"] * factories + ["exit None"] * factories + (
        ["enter"] * factories + ["exit KeyError"] * factories
    ) + ["enter"] * factories + ["exit KeyError"] + ["exit None"] * (factories - 1)


def test_a_kept_copy_goes_with_its_buffer() -> None:
    # A model moved to another dtype or device replaces its buffers: their copies are not held until a next forward.
    starts = BufferStarts()
    table = torch.zeros(4096)  # 16 KiB: kept from call to call
    copy = weakref.ref(starts.at_start([("table", None, "table", table, table._version)])[0])
    gc.collect()
    assert copy() is not None
    del table
    gc.collect()
    assert copy() is None
