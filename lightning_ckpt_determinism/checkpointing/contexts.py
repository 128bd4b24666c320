"""Recompute contexts that can be entered any number of times: host-RNG replay and the replay of a forward's state.

torch enters a region's recompute context each time the region is recomputed: twice under a gradient penalty
(``autograd.grad(..., create_graph=True)`` and then a backward through it) or with ``retain_graph=True``. A
:class:`Reenterable` enters fresh contexts from factories at each entry, so every recomputation starts from the same
state: the same host RNG, the same buffer values and generator states. (The attributes a forward rebinds are put
back by the region's call itself, :class:`AttributeReplay`, and its modules' ``training`` flags by
:class:`TrainingModes`.)
"""

import contextlib
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import (
    below_current_modes,
    buffer_version_counter,
    disable_current_modes,
    hook_handles_made,
    own_buffers,
)
from lightning_ckpt_determinism.checkpointing.module_hooks import HookSnapshot, hooks_added_since
from lightning_ckpt_determinism.checkpointing.modules import (
    SCALARS,
    buffer_written,
    generator_slots,
    is_framework_attribute,
    state_copy,
    write_values,
)
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from lightning_ckpt_determinism.checkpointing.rng import HostRNGState, capture_host_rng, replaying_host_rng

__all__ = [
    "KEPT_BUFFER_BYTES",
    "NO_CONTEXT",
    "SMALL_BUFFER_BYTES",
    "AttributeReplay",
    "BufferSlot",
    "BufferStarts",
    "ContextFactory",
    "ForwardState",
    "HostRNGReplay",
    "Reenterable",
    "TrainingModes",
    "default_dtype",
    "put_back_always",
    "same_context",
    "training_flags",
    "values_kept",
    "written_owners",
]

BufferSlot = tuple[str, nn.Module, str]
"""A buffer of a region: its name relative to the region, the module that holds it and its key there."""

ContextFactory = Callable[[], AbstractContextManager[Any]]
"""Makes a fresh context each time it is called."""

NO_CONTEXT: AbstractContextManager[None] = contextlib.nullcontext()
"""A context that does nothing, one for every use: a ``nullcontext`` holds no state, so it can be entered anywhere,
any number of times, without a fresh one per call."""


class Reenterable:
    """A context that can be entered any number of times, one entry after another.

    Args:
        factories: Called in order at each entry; their contexts are exited in reverse order.

    Example::

        >>> entered = []
        >>> both = Reenterable([lambda: contextlib.nullcontext(entered.append(1))])
        >>> with both:
        ...     pass
        >>> with both:
        ...     pass
        >>> entered
        [1, 1]
    """

    __slots__ = ("_entered", "_factories")

    def __init__(self, factories: list[ContextFactory]) -> None:
        self._factories = factories
        self._entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        if len(self._factories) == 1:
            # One context (the common case) is entered directly: an `ExitStack` would only wrap it.
            context = self._factories[0]()
            context.__enter__()
            self._entered.append(context)
            return
        with ExitStack() as stack:
            for factory in self._factories:
                stack.enter_context(factory())
            self._entered.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._entered.pop().__exit__(*exc_info))


def same_context(context: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
    """A factory's result for a context that is itself re-enterable, such as a dispatch mode."""
    return context


class HostRNGReplay:
    """Capture Python's and NumPy's RNG, and the host generators ``held`` (those the region's modules hold), at the
    forward; replay them during each recomputation, then put the live states back.

    Example::

        >>> import random
        >>> replay = HostRNGReplay()
        >>> with replay.capture():
        ...     drawn = random.random()
        >>> with replay.replay():
        ...     random.random() == drawn
        True
    """

    def __init__(self, held: Sequence[Any] = ()) -> None:
        self._held = held
        self._state: HostRNGState | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self._state = capture_host_rng(self._held)
        yield

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: recomputation ran before the forward it replays.")
        with replaying_host_rng(self._state):
            yield


class ForwardState:
    """What one forward of a region saw, put back for each of its recomputations and then returned to its live value:
    the values of the region's buffers (with ``protect_buffers``) and the states of the ``torch.Generator`` objects
    its modules hold (with ``preserve_rng_state``).

    Recomputation gets the buffer objects themselves, holding the values the forward started from (swapped in place
    without a version bump, and swapped back afterwards, so that what it writes to them is undone; a buffer the
    forward resized, as a per-channel observer sizes its statistics at their first update, takes a copy of them as
    its data, and its live storage back afterwards). Which buffers a forward changes comes from the region's
    profile: without one (a learning call) every buffer and generator is captured; otherwise only those the profile
    lists are, and every other buffer is checked at the forward's end by identity and version counter, so that one
    first changed later (or replaced by assignment) is reported to ``changed`` and captured from the next forward
    on. The small ones among them (up to :data:`SMALL_BUFFER_BYTES` each: an observer's statistics, a norm layer's),
    and up to :data:`KEPT_BUFFER_BYTES` (a positional table) are copied as the forward starts or have a copy kept
    from call to call (see :class:`BufferStarts`), so that the forward that first changes one is recomputed from the
    values it started from, as a learned buffer is. For a larger one that forward's recomputation starts from the
    value the forward left, and gives it back afterwards, with the other buffers of its module (BatchNorm's kernel
    updates its running statistics without a version bump): the buffer is changed once, as without checkpointing,
    though the recomputation may differ (the value the forward started from is gone; it is reported to
    ``read_otherwise``, and the sentinel and the check see it). A buffer the forward only read that something else
    writes before a recomputation (the region's caller, a module sharing it) is found as that recomputation starts,
    reported to ``written_between``, and replayed from the value the forward read where that is known (reported to
    ``read_otherwise`` where not). A buffer registered as ``None`` that the forward creates is taken
    away for its recomputation, which creates its own, and put back after it.

    Args:
        module: The region.
        profile: What the region learned about calls like this one; ``None`` for a learning call.
        buffers: The region's buffers, when they are replayed (``protect_buffers``); empty otherwise.
        generators: Replay the generators the region's modules hold.
        changed: Called with the name of each buffer this forward changed that ``profile`` does not list.
        written_between: Called with the name of each buffer this forward only read that was written before one of
            its recomputations (by the region's caller, or a module sharing it).
        read_otherwise: Called with the name of each buffer this forward's recomputation gets with other values
            than the forward started from or read, where those were not copied (a buffer over
            :data:`KEPT_BUFFER_BYTES` first changed by this forward, or written before the recomputation).
        starts: The region's copies of the buffers no forward was seen to change; by default copies made for this
            forward alone.

    Example::

        >>> norm = torch.nn.BatchNorm1d(2)
        >>> state = ForwardState(norm, None, [("running_mean", norm, "running_mean")], generators=False)
        >>> with state.capture():
        ...     _ = norm(torch.randn(4, 2))  # the forward updates the statistics once
        >>> updated = norm.running_mean.clone()
        >>> with state.replay():
        ...     bool(norm.running_mean.eq(0).all())  # recomputation sees the values the forward started from
        ...     _ = norm(torch.randn(4, 2))
        True
        >>> torch.equal(norm.running_mean, updated)  # and what it wrote is undone
        True
    """

    def __init__(
        self,
        module: nn.Module,
        profile: RegionProfile | None,
        buffers: Sequence[BufferSlot],
        *,
        generators: bool,
        changed: Callable[[str], None] = lambda name: None,
        written_between: Callable[[str], None] = lambda name: None,
        read_otherwise: Callable[[str], None] = lambda name: None,
        starts: "BufferStarts | None" = None,
    ) -> None:
        self._module = module
        self._profile = profile
        self._slots = buffers
        self._replays_generators = generators
        self._changed = changed
        self._written_between = written_between
        self._read_otherwise = read_otherwise
        self._captured: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._watched: list[tuple[str, nn.Module, str, torch.Tensor | None, int]] = []
        # The values the small watched buffers started from, by their place in `_watched`.
        self._kept_starts = starts if starts is not None else BufferStarts()
        self._starts: dict[int, torch.Tensor] = {}
        # The buffers changed late, each with whether the forward created it where it found ``None`` (a buffer sized
        # at the first forward).
        self._late: list[tuple[nn.Module, str, bool]] = []
        # The watched buffers the forward left unchanged, with their version counters and the values they held where
        # copied: one written before a recomputation (by code outside the region) is replayed from them.
        self._read: list[tuple[str, nn.Module, str, torch.Tensor, int, torch.Tensor | None]] = []
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []

    def capture(self) -> AbstractContextManager[None]:
        """The forward context: capture what the forward starts from; afterwards, note buffers changed unexpectedly."""
        return _Capture(self)

    def replay(self) -> AbstractContextManager[None]:
        """The recompute context: the forward's state in, the live state back afterwards, whatever is raised. Decided
        at each recomputation, once the forward has ended: with no buffer or generator to replay (none captured, none
        changed late, none the forward read written since), the shared :data:`NO_CONTEXT`."""
        if self._read:
            _written_between(self)
        if self._captured or self._late or self._generators:
            return _Replay(self)
        return NO_CONTEXT


class _Capture:
    """:meth:`ForwardState.capture`: the buffers the profile lists cloned (below every dispatch mode, so that a mode
    of the user's sees the model's ops, never the package's copies), the others' identities and version counters read
    (no op, so no guard), the generators' states taken; after a forward that raised nothing, the watched buffers
    checked."""

    __slots__ = ("_state",)

    def __init__(self, state: ForwardState) -> None:
        self._state = state

    def __enter__(self) -> None:
        state = self._state
        profile = state._profile
        cloned = []
        for name, owner, key in state._slots:
            buffer = own_buffers(owner).get(key)
            if buffer is None:  # registered as `None`: watched, in case the forward creates it
                state._watched.append((name, owner, key, None, 0))
            elif profile is None or name in profile.buffers:
                cloned.append((owner, key, buffer))
            else:
                state._watched.append((name, owner, key, buffer, buffer_version_counter(buffer)))
        if cloned:
            with torch.no_grad(), disable_current_modes():
                state._captured.extend((owner, key, buffer, state_copy(buffer)) for owner, key, buffer in cloned)
        if state._watched:
            state._starts = state._kept_starts.at_start(state._watched)
        if state._replays_generators:
            held = generator_slots(state._module) if profile is None else profile.generators
            state._generators = [(generator, generator.get_state()) for _, generator in held]

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        if exc_type is not None:
            return
        state = self._state
        owners = set()
        written = set()
        for name, owner, key, buffer, version in state._watched:
            if buffer_written(owner, key, buffer, version):
                state._changed(name)
                owners.add(owner)
                written.add(name)
        # A changed buffer's module may have changed its other buffers without a version bump (BatchNorm's kernel
        # updates its running statistics in place, its counter bumps one): they are recomputed from the values they
        # started from where those were copied, and given back after recomputation with it otherwise.
        for at, (name, owner, key, buffer, version) in enumerate(state._watched):
            if owner not in owners:
                start = state._starts.get(at)
                if buffer is not None and start is not None and put_back_always(buffer):
                    # Copied as this forward started: recomputed from that copy whatever wrote the buffer since,
                    # this forward without a version bump (`.data`, a kernel) as well as its caller. An inference
                    # tensor (a cache `trainer.validate` made) takes no write outside inference mode.
                    state._captured.append((owner, key, buffer, start))
                elif buffer is not None:
                    state._read.append((name, owner, key, buffer, version, start))
                else:  # `None` through this forward: recomputed from none, whatever a later call creates
                    state._late.append((owner, key, True))
                continue
            state._kept_starts.forget(name)
            start = state._starts.get(at)
            if start is not None and buffer is not None:
                state._captured.append((owner, key, buffer, start))
                continue
            # Recomputed from the value this forward left (a kernel's write unseen is not named); one this forward
            # created is recomputed from none, as the forward was (`_Replay`), exactly.
            if name in written and buffer is not None:
                state._read_otherwise(name)
            state._late.append((owner, key, buffer is None))
        state._watched, state._starts = [], {}


SMALL_BUFFER_BYTES = 4096
"""The largest buffer a region copies as each forward starts, before it is known to change it (see
:class:`BufferStarts`)."""

KEPT_BUFFER_BYTES = 1 << 20
"""The largest buffer a region keeps a copy of from call to call, before it is known to change it (see
:class:`BufferStarts`)."""


class BufferStarts:
    """The values that a region's buffers no forward was seen to change start each forward from, so that the forward
    that first changes one, or before whose recomputation something else writes one, is recomputed from them. A plain
    tensor of at most :data:`SMALL_BUFFER_BYTES` (an observer's or a norm layer's statistics) is copied as each
    forward starts. One of at most :data:`KEPT_BUFFER_BYTES` (a positional table, a wide layer's statistics) is copied
    once, and the copy kept from call to call while its buffer is the same object with the same storage and version
    counter; one written since (``load_state_dict``, a check putting a step's state back, an assignment) is copied
    again as the next forward starts, and a write through ``.data`` between calls, which moves no version counter,
    goes unseen. A kept copy is dropped with its buffer (a model moved to another dtype or device) or once the buffer
    is known to change (every forward then copies it as it starts).

    One per region: its wrapper holds it, and each call's :class:`ForwardState` reads it.

    Example::

        >>> table = torch.zeros(4096)  # 16 KiB: kept
        >>> starts = BufferStarts()
        >>> first = starts.at_start([("table", None, "table", table, table._version)])[0]
        >>> starts.at_start([("table", None, "table", table, table._version)])[0] is first  # unchanged: the same copy
        True
        >>> _ = table.add_(1)
        >>> float(starts.at_start([("table", None, "table", table, table._version)])[0][0])  # written: copied again
        1.0
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        # By buffer name: a weak reference to the buffer, its version counter and storage when copied, and the copy.
        self._kept: dict[str, tuple[weakref.ref[torch.Tensor], int, int, torch.Tensor]] = {}

    def at_start(self, watched: Sequence[tuple[str, Any, str, torch.Tensor | None, int]]) -> dict[int, torch.Tensor]:
        """The values the ``watched`` buffers (name, owner, key, buffer, version counter) start a forward from, by
        their place among them: the kept copies that still hold, and new ones for the others (below every dispatch
        mode, as the model's ops are not)."""
        starts: dict[int, torch.Tensor] = {}
        copied: list[tuple[int, str, torch.Tensor, int, bool]] = []
        for at, (name, _, _, buffer, version) in enumerate(watched):
            if type(buffer) is not torch.Tensor:
                continue
            if _is_small(buffer):
                copied.append((at, name, buffer, version, False))
            elif buffer.numel() * buffer.element_size() <= KEPT_BUFFER_BYTES:
                kept = self._kept.get(name)
                if kept is not None and kept[0]() is buffer and kept[1] == version and kept[2] == _storage(buffer):
                    starts[at] = kept[3]
                else:
                    copied.append((at, name, buffer, version, True))
        if copied:
            with below_current_modes():
                for at, name, buffer, version, keep in copied:
                    starts[at] = copy = buffer.detach().clone()
                    if keep:
                        dropped = partial(_drop_kept, self._kept, name)
                        self._kept[name] = (weakref.ref(buffer, dropped), version, _storage(buffer), copy)
        return starts

    def forget(self, name: str) -> None:
        """Keep no copy of buffer ``name``, now known to change (every later forward copies it as it starts)."""
        self._kept.pop(name, None)


def _is_small(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is a plain tensor of at most :data:`SMALL_BUFFER_BYTES`, which a region copies as each
    forward starts."""
    return type(buffer) is torch.Tensor and buffer.numel() * buffer.element_size() <= SMALL_BUFFER_BYTES


def put_back_always(buffer: torch.Tensor) -> bool:
    """Whether a region that protects its buffers recomputes from, and puts back, ``buffer`` at every call, changed or
    not: a plain tensor of at most :data:`SMALL_BUFFER_BYTES` (copied as each forward starts) that is not an inference
    tensor (which nothing writes outside inference mode).

    Args:
        buffer: The buffer.

    Example::

        >>> put_back_always(torch.zeros(8)), put_back_always(torch.zeros(4096))
        (True, False)
    """
    return _is_small(buffer) and not buffer.is_inference()


def _drop_kept(kept: dict[str, Any], name: str, ref: "weakref.ref[torch.Tensor]") -> None:
    """The kept copy of buffer ``name`` goes with the buffer it was made of (``ref``, now dead), unless a newer one
    replaced it."""
    entry = kept.get(name)
    if entry is not None and entry[0] is ref:
        del kept[name]


def _storage(buffer: torch.Tensor) -> int:
    """Where ``buffer``'s values are (``.data`` assigned moves them without a version bump); 0 without a storage."""
    return buffer.data_ptr() if buffer.layout == torch.strided else 0


def written_owners(read: Iterable[tuple[nn.Module, str, torch.Tensor, int]]) -> set[int]:
    """The ids of the modules one of whose buffers was replaced or written since it was read (each entry: its owner,
    key, the buffer object read and its version counter then). A module counts whole: BatchNorm's kernel updates its
    running statistics in place without a version bump, and only its counter shows one.

    Args:
        read: The buffers read.

    Example::

        >>> norm = torch.nn.BatchNorm1d(2)
        >>> read = [(norm, key, buffer, buffer._version) for key, buffer in norm.named_buffers()]
        >>> _ = norm(torch.randn(4, 2))  # the statistics change, only the counter's version moves
        >>> written_owners(read) == {id(norm)}
        True
    """
    return {id(owner) for owner, key, buffer, version in read if buffer_written(owner, key, buffer, version)}


class _Replay:
    """:meth:`ForwardState.replay` where something is replayed: one recomputation's swap, held until it ends."""

    __slots__ = ("_live_generators", "_state", "_swapped")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        # Each buffer swapped: its owner and key, the object the owner held, the buffer, and its live values (a copy,
        # or its live storage itself where the forward resized it).
        self._swapped: list[tuple[nn.Module, str, torch.Tensor | None, torch.Tensor, _LiveValues]] = []
        self._live_generators: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> None:
        state, swapped = self._state, self._swapped
        if state._captured or state._late:
            with torch.no_grad(), below_current_modes():
                for owner, key, buffer, value in state._captured:
                    swapped.append((owner, key, own_buffers(owner).get(key), buffer, _swap_in(buffer, value)))
                    own_buffers(owner)[key] = buffer
                for owner, key, created in state._late:
                    live = own_buffers(owner).get(key)
                    if live is not None:
                        swapped.append((owner, key, live, live, _LiveValues.copied(live)))
                        if created:  # recomputed from no buffer, as the forward was
                            own_buffers(owner)[key] = None
        self._live_generators = [(generator, generator.get_state()) for generator, _ in state._generators]
        for generator, generator_state in state._generators:
            generator.set_state(generator_state)

    def __exit__(self, *exc_info: Any) -> None:
        for generator, generator_state in self._live_generators:
            generator.set_state(generator_state)
        if self._swapped:
            with torch.no_grad(), below_current_modes():
                for owner, key, live, buffer, values in reversed(self._swapped):
                    _swap_back(buffer, values)
                    own_buffers(owner)[key] = live


def _written_between(state: ForwardState) -> None:
    """Find the buffers the forward only read that were written since (by the region's caller, or a module sharing
    them, between the forward and this recomputation), with the other buffers of their modules: each is reported, and
    replayed from the value the forward read (for this recomputation and the next; the region replays it from its next
    call on) where that is known: copied as the forward started, or the buffer object the forward read where that was
    replaced and left as it was."""
    owners = written_owners((owner, key, buffer, version) for _, owner, key, buffer, version, _ in state._read)
    if not owners:
        return
    unwritten = []
    for entry in state._read:
        name, owner, key, buffer, version, start = entry
        if id(owner) not in owners:
            unwritten.append(entry)
            continue
        state._written_between(name)
        state._kept_starts.forget(name)
        replaced = own_buffers(owner).get(key) is not buffer
        if start is None and replaced and buffer_version_counter(buffer) == version:
            start = buffer
        if start is not None:
            state._captured.append((owner, key, buffer, start))
        elif buffer_written(owner, key, buffer, version):  # read as written (not another of its module's)
            state._read_otherwise(name)
    state._read = unwritten


class _LiveValues(NamedTuple):
    """What gives a swapped buffer its live values back: a copy written back in place, or, where the forward resized
    the buffer (``resized``), its live storage itself, which it takes back."""

    tensor: torch.Tensor
    resized: bool

    @classmethod
    def copied(cls, buffer: torch.Tensor) -> "_LiveValues":
        """A copy of ``buffer``'s values, to write back in place."""
        return cls(state_copy(buffer), resized=False)


def _swap_in(buffer: torch.Tensor, value: torch.Tensor) -> _LiveValues:
    """Put ``value`` into ``buffer``, in place where their shapes agree (no version bump); where the forward resized
    the buffer (a per-channel observer's statistics, sized at their first update), or where its elements share memory
    and cannot be written (one value expanded), ``buffer`` takes a copy of ``value`` as its data, and keeps its live
    storage untouched to take back."""
    if buffer.shape == value.shape and _writable(buffer):
        live = _LiveValues.copied(buffer)
        write_values(buffer, value)
        return live
    live = _LiveValues(buffer.data, resized=True)
    buffer.data = value.clone()  # a copy: a second recomputation starts from `value` again
    return live


class _DefaultDtypeEntries:
    """The :func:`default_dtype` blocks open in this process, in the order they were entered, each with the dtype it
    found: torch's default dtype is one per process, and blocks of several threads (backward on each device's thread)
    may close out of order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[list[Any]] = []

    def enter(self, dtype: torch.dtype) -> list[Any]:
        with self.lock:
            entry = [torch.get_default_dtype()]
            torch.set_default_dtype(dtype)  # first: a dtype torch refuses leaves no entry open
            self.open.append(entry)
            return entry

    def exit(self, entry: list[Any]) -> None:
        with self.lock:
            position = next(index for index, held in enumerate(self.open) if held is entry)
            del self.open[position]
            if position == len(self.open):
                torch.set_default_dtype(entry[0])  # the last one entered: what it found comes back
            else:
                # One entered after it is still open: the dtype it found is this one's, which is now gone; it puts
                # back what this one found instead.
                self.open[position][0] = entry[0]


_DEFAULT_DTYPE_ENTRIES = _DefaultDtypeEntries()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside the block, and put back after it. Blocks open in several threads
    at once share the one default torch has (the last entered sets it), and whatever order they close in, the dtype
    the first one found comes back when the last closes.

    Args:
        dtype: A floating dtype.

    Example::

        >>> with default_dtype(torch.float64):
        ...     torch.tensor(0.5).dtype
        torch.float64
        >>> torch.tensor(0.5).dtype
        torch.float32
    """
    entry = _DEFAULT_DTYPE_ENTRIES.enter(dtype)
    try:
        yield
    finally:
        _DEFAULT_DTYPE_ENTRIES.exit(entry)


@contextlib.contextmanager
def values_kept(buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """The values ``buffers`` hold as the block starts, given back after it whatever it wrote to them (see
    :func:`_swap_back`); copied and written below every dispatch mode, so that no selective-checkpointing cache counts
    those ops among a recomputation's.

    Args:
        buffers: The buffers.

    Example::

        >>> counter = torch.zeros(1)
        >>> with values_kept([counter]):
        ...     _ = counter.add_(1)
        >>> counter.item()
        0.0
    """
    with torch.no_grad(), disable_current_modes():
        live = [(buffer, _LiveValues.copied(buffer)) for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad(), disable_current_modes():
            for buffer, values in live:
                _swap_back(buffer, values)


def _writable(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` share memory through a stride of 0 (``torch.zeros(1).expand(8)``), which
    an in-place copy refuses; a tensor of another layout (sparse) is written in place as before."""
    if tensor.layout != torch.strided:
        return True
    return all(stride or size <= 1 for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def _swap_back(buffer: torch.Tensor, live: _LiveValues) -> None:
    """Give ``buffer`` its live values back (see :func:`_swap_in`), whatever shape its recomputation left it in."""
    if live.resized or buffer.shape != live.tensor.shape:
        buffer.data = live.tensor
    else:
        write_values(buffer, live.tensor)


_TRAINING = operator.attrgetter("training")


def training_flags(modules: Sequence[nn.Module]) -> tuple[bool, ...]:
    """The ``training`` flag of each module.

    Example::

        >>> training_flags([torch.nn.Linear(2, 2), torch.nn.Dropout().eval()])
        (True, False)
    """
    return tuple(map(_TRAINING, modules))


class TrainingModes:
    """The ``training`` flags of a region's modules for one recomputation: as its forward started (where known), then
    the live ones back, whatever is raised.

    A forward that runs a layer in eval mode and switches it back would otherwise leave it in eval mode: its
    recomputation stops after the region's last saved tensor (torch's early stop), before the switch back. A model put
    in eval mode between a forward and its backward is recomputed as its forward ran.

    Args:
        modules: The region's modules.
        started: Their flags as the forward started, or ``None`` where not known (the recomputation starts from the
            live ones).

    Example::

        >>> layer = torch.nn.Dropout().eval()
        >>> with TrainingModes([layer], started=(True,)):
        ...     layer.training
        True
        >>> layer.training
        False
    """

    __slots__ = ("_live", "_modules", "_started")

    def __init__(self, modules: Sequence[nn.Module], started: tuple[bool, ...] | None) -> None:
        self._modules = modules
        self._started = started
        self._live: tuple[bool, ...] = ()

    def __enter__(self) -> None:
        self._live = live = training_flags(self._modules)
        if self._started is not None and self._started != live:
            _set_training(self._modules, self._started)

    def __exit__(self, *exc_info: Any) -> None:
        if training_flags(self._modules) != self._live:
            _set_training(self._modules, self._live)


def _set_training(modules: Sequence[nn.Module], flags: tuple[bool, ...]) -> None:
    for module, flag in zip(modules, flags, strict=True):
        module.training = flag


_MISSING = object()
# An attribute whose starting value is not held: recomputation starts from its live value, which it gets back after.
_LIVE = object()
# In place of the value a forward ended with, for an attribute it rebound (see `AttributeReplay`).
_NOT_KEPT = object()


def _registered(held: dict[str, Any], name: str) -> bool:
    """Whether the module whose ``vars`` are ``held`` registers ``name`` as a submodule, a parameter or a buffer."""
    return any(name in held.get(kind, ()) for kind in ("_modules", "_parameters", "_buffers"))


class AttributeReplay:
    """The plain attributes one forward of a region rebinds, creates or deletes, put back as the forward found them for
    each of its recomputations, then returned to their live values.

    The values of the modules' own attributes (framework bookkeeping, hooks and FSDP's flags, left out; ``training`` is
    :class:`TrainingModes`'s) are read as the forward starts and compared by identity as it ends, with how many
    attributes each module holds: what a forward changes is known at that very call, not from a call before (a counter,
    an attribute created lazily, a ``torch.Generator`` too, one that starts changing after a warm-up). Replayed are the
    attributes the forward created or deleted, and those whose value it started from is immutable
    (:data:`~lightning_ckpt_determinism.checkpointing.modules.SCALARS`), a generator, or a tensor whose storage holds at
    most 256 bytes (a length or a count kept as a tensor, which decides what the forward does as a number would). The
    value a larger tensor or a container started from is not held until the recomputation (that would keep its memory
    alive): recomputation starts from the live value. An attribute the forward left alone that is rebound, created or
    deleted before a recomputation (by a forward hook of the region's module, which runs outside the region, or by the
    caller between two calls of the region: a temperature set before each call) is as the forward ended for each
    recomputation where its value is small (see :func:`_after_forward`); a larger value is not kept alive for it (an
    activation a hook stores), so the recomputation reads the live one, which the sentinel sees. Hooks the forward
    registered on the region's modules are left out of each recomputation, and the live hooks are back after it: a
    forward that registers a hook once, behind an attribute it creates, registers it again in a recomputation that
    starts without that attribute. A hook the forward removed is not put back for the recomputation (a one-shot hook
    that removes itself): the sentinel sees what it changed.

    Args:
        attributes: The attribute dictionaries (``vars(module)``) of the region's modules.
        slots: The attributes to watch, as ``(module index, name)``: every one that is not framework bookkeeping.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> replay = AttributeReplay([vars(layer)], AttributeReplay.slots_of([vars(layer)]))
        >>> replay.start()
        >>> layer.calls = getattr(layer, "calls", 0) + 1  # what a forward does
        >>> replay.end()
        >>> with replay.replay():
        ...     hasattr(layer, "calls")  # recomputation starts where the forward started
        False
        >>> layer.calls
        1
    """

    __slots__ = (
        "_attributes",
        "_ended",
        "_ended_all",
        "_ended_sizes",
        "_found",
        "_hooks",
        "_hooks_made",
        "_sizes",
        "_slots",
        "_values",
    )

    def __init__(self, attributes: Sequence[dict[str, Any]], slots: Sequence[tuple[int, str]]) -> None:
        self._attributes = attributes
        self._slots = slots
        self._sizes: list[int] = []
        self._values: list[Any] = []
        # The watched values as the forward ended (or `_NOT_KEPT`), whether all are kept, and each module's size.
        self._ended: list[Any] = []
        self._ended_all = True
        self._ended_sizes: list[int] | None = None
        self._found: dict[tuple[int, str], Any] = {}
        self._hooks_made = 0
        # The hooks the forward registered on the region's modules, by the dictionary that holds them.
        self._hooks: list[tuple[dict[int, Any], list[int]]] = []

    @staticmethod
    def slots_of(attributes: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
        """The attributes of these dictionaries an :class:`AttributeReplay` watches (worked out once per layout)."""
        return [
            (index, name) for index, held in enumerate(attributes) for name in held if not is_framework_attribute(name)
        ]

    @property
    def dicts(self) -> Sequence[dict[str, Any]]:
        """The attribute dictionaries (``vars(module)``) of the region's modules."""
        return self._attributes

    def start(self) -> None:
        """The forward starts: the watched values, and how many attributes each module holds."""
        attributes = self._attributes
        self._sizes = list(map(len, attributes))
        self._values = [attributes[index].get(name, _MISSING) for index, name in self._slots]
        self._hooks_made = hook_handles_made()

    def end(self) -> None:
        """The forward ended: keep what it rebound, created or deleted, as it was at the start."""
        attributes, found = self._attributes, {}
        now = [attributes[index].get(name, _MISSING) for index, name in self._slots]
        # A module holding more or fewer attributes, or one deleted, may hold one the forward created.
        sizes = list(map(len, attributes))
        created = sizes != self._sizes
        if not all(map(operator.is_, self._values, now)):
            for slot, before, after in zip(self._slots, self._values, now, strict=True):
                if before is not after:
                    created = created or after is _MISSING
                    if after is _MISSING and _registered(attributes[slot[0]], slot[1]):
                        # The forward made it a submodule, a parameter or a buffer (`self.norm = nn.BatchNorm1d(...)`
                        # where it was None): the plain value would hide the one the forward made and trains.
                        continue
                    found[slot] = before if _held(before) else _LIVE
        if created:
            watched = set(self._slots)
            for index, held in enumerate(attributes):
                for name in held:
                    if (index, name) not in watched and not is_framework_attribute(name):
                        found[index, name] = _MISSING
        # What the forward ended with, for a recomputation after something else rebinds, creates or deletes an
        # attribute: the small values (see `_after_forward`), and the sizes.
        self._ended_all = not found and _KEPT_TYPES.issuperset(map(type, now))  # numbers, strings, flags, shapes
        if self._ended_all:
            self._ended = now
        else:
            self._ended = [
                _NOT_KEPT if slot in found else _after_forward(value)
                for slot, value in zip(self._slots, now, strict=True)
            ]
        self._ended_sizes = sizes
        self._values, self._found = [], found
        # Any hook registered anywhere moves the count; those on the region's modules are looked for only then.
        moved = hook_handles_made() != self._hooks_made
        self._hooks = hooks_added_since(attributes, self._hooks_made) if moved else []

    def replay(self) -> AbstractContextManager[None]:
        """The forward's starting values in, the live ones back afterwards, whatever is raised."""
        if self._ended_sizes is None:  # recomputed before its forward ended (a backward inside it): nothing since
            return self._replayed(None) if self._found or self._hooks else NO_CONTEXT
        attributes = self._attributes
        current = [attributes[index].get(name, _MISSING) for index, name in self._slots]
        if self._ended_all:
            changed = not all(map(operator.is_, self._ended, current))
        else:
            changed = any(
                ended is not value and ended is not _NOT_KEPT for ended, value in zip(self._ended, current, strict=True)
            )
        sizes = list(map(len, attributes))
        if changed or sizes != self._ended_sizes:
            return self._replayed(self._since_forward(current, sizes, self._ended_sizes))
        return self._replayed(None) if self._found or self._hooks else NO_CONTEXT

    @contextlib.contextmanager
    def _replayed(self, since: dict[tuple[int, str], Any] | None) -> Iterator[None]:
        """``since``: what changed since the forward ended, as :meth:`_since_forward` gives it (``None``: nothing)."""
        attributes = self._attributes
        replayed = {} if since is None else since
        replayed.update((at, value) for at, value in self._found.items() if value is not _LIVE)
        live = {(index, name): attributes[index].get(name, _MISSING) for index, name in {**self._found, **replayed}}
        hooks = HookSnapshot(attributes) if self._hooks else None
        self._set(replayed)
        for registered, ids in self._hooks:
            for key in ids:
                registered.pop(key, None)
        try:
            yield
        finally:
            self._set(live)
            if hooks is not None:
                hooks.restore()

    def _since_forward(self, current: list[Any], sizes: list[int], ended: list[int]) -> dict[tuple[int, str], Any]:
        """The attributes rebound, created or deleted since the forward ended (by a hook of the region's module, by
        its caller), with the values the forward ended with, where those are kept: from the watched values
        ``current`` and the modules' ``sizes`` now, and their sizes as the forward ``ended``."""
        replayed: dict[tuple[int, str], Any] = {}
        for slot, kept, value in zip(self._slots, self._ended, current, strict=True):
            if kept is not _NOT_KEPT and kept is not value:
                replayed[slot] = kept
        if sizes != ended:
            known = {*self._slots, *self._found}
            for index, held in enumerate(self._attributes):
                if sizes[index] != ended[index]:
                    for name in held:
                        if (index, name) not in known and not is_framework_attribute(name):
                            replayed[index, name] = _MISSING
        return replayed

    def _set(self, values: dict[tuple[int, str], Any]) -> None:
        for (index, name), value in values.items():
            if value is _MISSING:
                self._attributes[index].pop(name, None)
            else:
                self._attributes[index][name] = value


# The largest storage, in bytes, of a tensor attribute whose starting value recomputation gets back: a length, a
# step count or a flag kept as a tensor (transformers' dynamic RoPE keeps its cached length as one), which decides
# what the forward does, as a number would.
_HELD_BYTES = 256


# The types whose values `_after_forward` keeps as they are: immutable values, shapes and generators.
_KEPT_TYPES = frozenset((*SCALARS, tuple, torch.Generator))


def _after_forward(value: Any) -> Any:
    """What an attribute's value as a forward ended is kept as, for a recomputation after something rebinds it: the
    value itself where :func:`_held` holds it or it is a tuple (a shape, as a rule); :data:`_NOT_KEPT` for anything
    else, whose memory is not kept alive until the recomputation (an activation a hook stores on the module: plain
    training would have let it go)."""
    return value if isinstance(value, tuple) or _held(value) else _NOT_KEPT


def _held(value: Any) -> bool:
    """Whether the value a forward started from is held for its recomputation (see :class:`AttributeReplay`)."""
    if value is _MISSING or isinstance(value, (*SCALARS, torch.Generator)):
        return True
    if type(value) is not torch.Tensor or value.layout != torch.strided or value.is_mkldnn:
        return False  # a sparse or an MKL-DNN tensor has no storage to size
    return value.untyped_storage().nbytes() <= _HELD_BYTES
