"""One region call as the sentinel sees it: the tensors its forward saves, kept as digests once their values are
final, and their comparison with the recomputation's (see the package's description)."""

import copy
from collections.abc import Container, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from lightning_ckpt_determinism._text import describe_saved
from lightning_ckpt_determinism._torch_compat import no_python_dispatch, view_base
from lightning_ckpt_determinism.checkpointing.determinism_check import (
    EVERY_POSITION,
    Recomputed,
    SavedPlan,
    recomputed_tensor,
)
from lightning_ckpt_determinism.checkpointing.modules import plain_parts, storage_pointer
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.digest import DigestMode, DigestPlans, Sums, readable
from lightning_ckpt_determinism.verify.gradients import local_tensor
from lightning_ckpt_determinism.verify.sentinel.light_layout import SavedLayout

__all__ = ["Digests", "KeptTensor", "RegionCall", "as_vector", "from_parameters", "joined"]

Digests = torch.Tensor | list[torch.Tensor]
"""The digests of some of a call's saved tensors, in slot order: a digest each, where each was small enough to digest
in one pass, else one vector, weighed from their row and column sums together."""


class CallOwner(Protocol):
    """What a :class:`RegionCall` needs of the sentinel that made it: its hooks are private, called by the sentinel's
    own modules only."""

    mode: DigestMode
    plans: DigestPlans

    @property
    def failure(self) -> Exception | None: ...

    def _stop(self, err: Exception) -> None: ...

    def _failed(self, region: str, what: str, err: Exception) -> None: ...

    def _unreadable(self, region: str, tensor: torch.Tensor) -> None: ...

    def _learned(self, region: str, layout: SavedLayout | None) -> None: ...

    def _comparing(self, call: "RegionCall") -> "RegionCall": ...

    def _compared(self, call: "RegionCall") -> None: ...


class KeptTensor:
    """What torch keeps of one saved tensor at the forward, and compares with ``!=`` after the recomputation.

    ``slot`` is its place among the call's digests: ``None`` for a parameter, a buffer or a tensor left out. ``mode``
    is what its digests read (the light tier's rotating tensor reads another window than the call's others).
    """

    __slots__ = ("broken", "call", "device", "dtype", "mode", "position", "producer", "shape", "slot", "strict")

    def __init__(self, call: "RegionCall", position: int, *, strict: bool) -> None:
        self.call = call
        self.position = position
        self.strict = strict
        self.slot: int | None = None
        self.shape: torch.Size | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.mode = call.mode
        self.producer = ""
        # The sentinel failed to keep it: never compared, and never a reason for torch to raise.
        self.broken = False

    def __ne__(self, other: object) -> bool:
        if self.broken:
            return False
        try:
            tensor = recomputed_tensor(other)
            if tensor is not None:
                if self.call.sentinel.failure is not None:  # stopped: torch's own metadata check alone
                    return self.strict and not self.same_metadata(tensor)
                return self.call.recomputed(self, tensor)
        except Exception as err:  # the sentinel's own failure stops it, never the backward
            self.broken = True
            self.call.sentinel._stop(err)
            return False
        if isinstance(other, Recomputed):  # freed since
            return False
        # The recomputation ran outside the sentinel (torch's metadata, or nothing under "none").
        return self.strict and self.metadata() != other

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.metadata())

    def metadata(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "device": self.device}

    def same_metadata(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (this rank's shard of a DTensor) has the shape, dtype and device kept."""
        local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
        return (local.shape, local.dtype, local.device) == (self.shape, self.dtype, self.device)

    @property
    def cause(self) -> Cause | None:
        """``parameter_write`` where the region's parameters changed in place between its forward and this
        recomputation (see :attr:`RegionCall.parameters_written`): recomputation read other values; else unknown."""
        return Cause.PARAMETER_WRITE if self.call.parameters_written else None

    def describe(self) -> str:
        described = describe_saved(self.position, self.producer or None, self.shape, self.dtype)
        if not self.call.parameters_written:
            return described
        names = ", ".join(f"`{self.call.region}.{name}`" for name in self.call.parameters_written)
        return (
            f"{described}, recomputed after {names} changed in place since the region's forward (by its forward, or"
            " by code between the forward and this backward, such as an optimizer step)"
        )


class RegionCall:
    """One forward of one region: its saved tensors' digests and, after each recomputation, the digests to compare.

    Which saved tensors it digests: every one, or under the light tier the targets of the region's
    :class:`~lightning_ckpt_determinism.verify.sentinel.light_layout.SavedLayout` (``targets``); a call of a region
    without a layout yet looks at every saved tensor, learns the layout at its forward's end and digests that step's
    targets. Each digested tensor is read once its value is final (see the package's description): a small read (the
    light and sampled tiers' windows, as a rule) is digested in one pass, a larger one by its row and column sums
    (:meth:`~lightning_ckpt_determinism.verify.digest.DigestPlans.digest_or_sums`). Where a forward's, or a
    recomputation's, were all digested in one pass, they are kept as they are until the step compares every call's in
    one go; else they are weighed into one vector when the forward ends, and at the comparison of the recomputation's
    last tensor. The others are given back as torch's own extractor would keep them.
    """

    def __init__(
        self,
        sentinel: "CallOwner",
        region: str,
        buffers: frozenset[int | None],
        profile: RegionProfile | None,
        layout: SavedLayout | None,
    ) -> None:
        self.sentinel = sentinel
        # The sentinel's step that counts what this call compares (set when its forward joins one).
        self.step: object | None = None
        # Its place among the calls of its region the sentinel saw start, from 0: those that save nothing count too.
        self.ordinal = 0
        # Its place among those calls since the region's last recomputation or the step's start, from 0 (an RNN's
        # cell: its timestep).
        self.position = 0
        self.region = region
        # Its region's parameter versions when its forward started, and the parameters whose versions moved between
        # then and its latest recomputation (set when that starts comparing).
        self.forward_versions: tuple[int, ...] | None = None
        self.parameters_written: tuple[str, ...] = ()
        self.buffers = buffers
        self.profile = profile
        self.mode = sentinel.mode
        self.layout = layout
        self.targets = None if layout is None else layout.targets(self.mode)
        # The positions :meth:`save` handles: the others keep torch's own metadata without reaching it.
        self.positions: Container[int] = EVERY_POSITION if self.targets is None else self.targets
        # Light without a layout: the layout is learned from this call, at its forward's end.
        self.learning = layout is None and self.mode.tier == "light"
        self._seen: list[tuple[int, int]] = []
        # The position a learning call digests in turn (see `_in_turn`), drawn at its first saved tensor.
        self._turn: int | None = None
        # The positions a learning call saw computed from parameters alone (see `SavedLayout.weights`).
        self._weights: set[int] = set()
        # How many tensors the forward saved, known when it ends.
        self.packs = 0
        self.saved: list[KeptTensor] = []
        self.slotted: list[KeptTensor] = []
        self.saved_bytes = 0
        self.not_compared = 0 if layout is None else layout.left_out
        # Of those, the tensors left out because the call took a code path its region had not learned yet.
        self.on_new_paths = 0
        # The forward's digests by slot, once the forward returned; each recomputation's, with the slots it compares.
        self.forward: Digests | None = None
        self.comparisons: list[tuple[list[int], Digests]] = []
        self.metadata_mismatches: list[str] = []
        self._digests: list[Sums | torch.Tensor] = []
        self._held: list[tuple[KeptTensor, torch.Tensor]] = []
        self._recomputed: list[tuple[int, Sums | torch.Tensor]] = []

    def plan(self) -> SavedPlan:
        """What the call does with its saved tensors: :meth:`save` handles every one, or under the light tier its
        targets; a tensor the light tier does not digest at this call keeps what torch's own extractor keeps."""
        return SavedPlan(self.save, self.positions)

    def save(self, tensor: torch.Tensor, position: int, strict: bool) -> Any:
        """Keep the metadata of ``tensor``, saved at ``position``, and its digest once its value is final."""
        saved = KeptTensor(self, position, strict=strict)
        self.saved.append(saved)
        try:
            local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
            saved.shape, saved.dtype, saved.device = local.shape, local.dtype, local.device
            saved.producer = tensor.grad_fn.name() if tensor.grad_fn is not None else ""
            if is_state(tensor, local, self.buffers):
                return saved
            if self.learning and from_parameters(tensor):
                self._weights.add(position)
            if self.targets is not None:
                saved.mode = self.targets[position]
            self.saved_bytes += (
                local.numel() * local.element_size() if type(local) is torch.Tensor else held_bytes(local)
            )
            profile = self.profile
            if profile is not None and position in profile.left_out:
                self.not_compared += 1
            elif self.learning and profile is not None:
                self._roll(saved, local)
            elif profile is None or position in profile.filled_late:
                self._held.append((saved, local))  # read when the forward ends, once the op saving it has run
            else:
                self._take(saved, local)
        except Exception as err:  # the sentinel's own failure stops it observing this tensor, never the step
            self._leave_out(saved, err)
        return saved

    def _roll(self, saved: KeptTensor, local: torch.Tensor) -> None:
        """A learning call notes each comparable activation and holds only the last one and the last computed
        floating-point one (the targets it digests; the last floating-point one while none requires grad), so that
        learning holds no more memory than two tensors. It digests one more as it comes, its tensor in turn
        (:meth:`_in_turn`), where that one's value is final when saved."""
        if not readable(local):
            self._unreadable(local)
            return
        kind = self._kind(saved, local)
        self._seen.append((saved.position, kind))
        if saved.position == self._in_turn() and kind != _WEIGHTS and saved.position not in self._filled_late():
            self._take(saved, local)
            return
        if kind == _WEIGHTS:  # never a fixed target: not held
            return
        # The held one that stays besides the new one: the best candidate for the computed target, unless the new
        # one is at least as good (a later one of the same kind wins).
        best = max((self._kind(held, tensor) for held, tensor in self._held), default=0)
        kept = [] if kind >= best else [entry for entry in self._held if self._kind(*entry) == best][-1:]
        self._held = [*kept, (saved, local)]

    def _in_turn(self) -> int:
        """The position a learning call digests besides its last activations: drawn from the step's offset and the
        call's place among its region's calls by a multiplicative hash, over as many positions as its profile saves.

        A region whose calls keep taking other code paths (a branch on the input, a shared block whose first call in a
        loop saves fewer tensors) learns at every call, so no layout's rotation reaches it; a hash, unlike a turn
        taken call by call, covers every position of every path whatever the period of the paths.
        """
        if self._turn is None:
            mixed = ((self.mode.offset + 1) * _TURN_HASH ^ (self.ordinal + 1) * _CALL_HASH) % (1 << 64)
            self._turn = (mixed >> 17) % max(self.profile.saved if self.profile is not None else 1, 1)
        return self._turn

    def _filled_late(self) -> frozenset[int]:
        return self.profile.filled_late if self.profile is not None else frozenset()

    def _kind(self, saved: KeptTensor, local: torch.Tensor) -> int:
        """How well a saved activation stands for the region's values: :data:`_COMPUTED` for a floating-point one
        autograd tracks (it has a ``grad_fn``, or its local tensor requires grad), :data:`_FLOATING` for one it does
        not (dropout's noise), :data:`_WEIGHTS` for one computed from parameters alone, 0 for any other dtype."""
        if saved.position in self._weights:
            return _WEIGHTS
        if not local.dtype.is_floating_point:
            return 0
        return _COMPUTED if saved.producer or local.requires_grad else _FLOATING

    def _take(self, saved: KeptTensor, local: torch.Tensor) -> None:
        found = self._digest(local, saved)
        if found is None:
            self._unreadable(local)
            return
        saved.slot = len(self._digests)
        self._digests.append(found)
        self.slotted.append(saved)

    def _digest(self, local: torch.Tensor, saved: KeptTensor) -> Sums | torch.Tensor | None:
        """``local``'s digest in ``saved``'s mode, or its row and column sums to weigh with the call's others
        (:meth:`~lightning_ckpt_determinism.verify.digest.DigestPlans.digest_or_sums`); ``None`` for a tensor without
        bits to read (or unreadable)."""
        plans = self.sentinel.plans
        try:
            with no_python_dispatch():  # a dispatch mode of the region (selective checkpointing) must not see it
                if type(local) is not torch.Tensor:  # a subclass: its inner tensors
                    return plans.digest_of(local, saved.mode)
                matrix = plans.read(local, saved.mode)
                if matrix is None:
                    return None
                return plans.digest_or_sums(matrix)
        except Exception as err:
            self.sentinel._failed(self.region, saved.describe(), err)
            return None

    def _unreadable(self, local: torch.Tensor) -> None:
        """A saved activation without bits to read: counted as not compared (a tensor subclass, said once)."""
        self.not_compared += 1
        if type(local) is not torch.Tensor:
            self.sentinel._unreadable(self.region, local)

    def _leave_out(self, saved: KeptTensor, err: Exception) -> None:
        saved.broken, saved.slot = True, None
        self.not_compared += 1
        self.sentinel._failed(self.region, f"saved tensor {saved.position}", err)

    def forward_done(self, *, digest: bool, profile: RegionProfile | None, packs: int) -> None:
        """The region's forward ended: digest the tensors held until now and stack the digests into one vector (or
        drop them, when it raised; a call that took another path than the profile it started with keeps only what
        was final when digested, the rest counted as not compared); a call that learned its region's layout, or
        saved another number of tensors than it, tells the sentinel.

        Args:
            digest: Whether the forward returned.
            profile: The profile of the path the call took (learned during this forward when it is a learning
                call; ``None`` for a path the region does not know).
            packs: How many tensors the forward saved.
        """
        self.packs = packs
        another_path = self.profile is not None and (profile is None or profile.path != self.profile.path)
        if digest and another_path:
            self._another_path(profile)
        if digest:
            left_out = profile.left_out if profile is not None else frozenset()
            held = [(saved, local) for saved, local in self._held if saved.position not in left_out]
            self.not_compared += len(self._held) - len(held)
            if self.learning:
                held = [(saved, local) for saved, local in self._learn(held) if saved.slot is None]
            elif self.layout is not None and (another_path or self.packs != self.layout.saved):
                self.sentinel._learned(self.region, None)  # another code path: its layout is learned again
            for saved, local in held:
                self._take(saved, local)
            if self._digests:
                try:
                    self.forward = joined(self.sentinel.plans, self._digests)
                except Exception as err:
                    self.sentinel._failed(self.region, "the forward's digests", err)
                    self.not_compared += len(self.slotted)
                    self.slotted = []
        self._digests, self._held = [], []

    @property
    def digested(self) -> bool:
        """Whether the forward's digests are taken."""
        return self.forward is not None

    @property
    def compared(self) -> int:
        """How many saved tensors the call's recomputations compared by digest."""
        if not self.digested:
            return 0
        return sum(len(slots) for slots, _ in self.comparisons)

    def _another_path(self, profile: RegionProfile | None) -> None:
        """The call took another path than the one its profile was learned on: of what it digested as it went, only
        the tensors its own path's profile says were final when saved are kept (none, on a path without one)."""
        early = frozenset(range(self.packs)) if profile is None else profile.filled_late | profile.left_out
        digested = zip(self.slotted, self._digests, strict=True)
        kept = [(saved, found) for saved, found in digested if saved.position not in early]
        for saved in self.slotted:
            saved.slot = None
        dropped = len(self.slotted) - len(kept)
        self.slotted, self._digests = [saved for saved, _ in kept], [found for _, found in kept]
        for slot, saved in enumerate(self.slotted):
            saved.slot = slot
        if profile is None:
            dropped += len(self._held)
            if self.targets is not None:
                # The light tier's targets, placed on the path it knew: those the new path never saved count too.
                dropped = max(dropped, len(self.targets))
            self.on_new_paths += dropped
            self._held = []
        self.not_compared += dropped

    def _learn(self, held: list[tuple[KeptTensor, torch.Tensor]]) -> list[tuple[KeptTensor, torch.Tensor]]:
        """Learn the region's layout from this call, and keep the held activations its targets name.

        The region's first call (no profile yet) held every activation, read off here; a later one noted them as
        they came and held only the last and the last floating-point one.
        """
        seen = self._seen
        if self.profile is None:
            comparable = []
            for saved, local in held:
                if readable(local):
                    comparable.append((saved, local))
                else:
                    self._unreadable(local)
            seen = [(saved.position, self._kind(saved, local)) for saved, local in comparable]
            held = comparable
        layout = SavedLayout(
            saved=self.packs,
            compared=tuple(position for position, _ in seen),
            floating=tuple(position for position, kind in seen if kind >= _FLOATING),
            derived=tuple(position for position, kind in seen if kind == _COMPUTED),
            left_out=self.not_compared,
            weights=tuple(position for position, kind in seen if kind == _WEIGHTS),
        )
        self.sentinel._learned(self.region, layout)
        targets = layout.targets(self.mode)
        for saved, _ in held:
            saved.mode = targets.get(saved.position, self.mode)
        return [(saved, local) for saved, local in held if saved.position in targets]

    def recomputed(self, saved: KeptTensor, tensor: torch.Tensor) -> bool:
        """torch compares ``saved`` with its recomputation: the metadata and the digest now, the comparison of the
        digests (stacked at the call's last tensor) at the step's end."""
        call = self.sentinel._comparing(self)
        if call is not self:  # the call continues in a later step (see `continued`)
            return call.recomputed(saved, tensor)
        local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
        if not saved.same_metadata(local):
            if saved.strict:
                return True  # torch raises its CheckpointError, naming the metadata
            recomputed_as = f"{tuple(local.shape)} {local.dtype} on {local.device}"
            self.metadata_mismatches.append(f"{saved.describe()} was recomputed as {recomputed_as}")
        elif saved.slot is not None and self.digested:
            found = self._digest(local, saved)
            if found is None:
                self.not_compared += 1
            else:
                self._recomputed.append((saved.slot, found))
        if saved is self.saved[-1]:
            self.recomputation_done()
        return False

    def continued(self) -> "RegionCall":
        """This call, for a step after the one its forward ran in: the forward's digests shared, the comparisons its
        own from now on, so that each step counts what was compared in it (a graph kept with ``retain_graph=True``
        and run backward again after its step ended; a backward run after the step of its forward). The saved
        tensors torch keeps compare through the continuation.

        Example::

            >>> from lightning_ckpt_determinism.verify.sentinel import RecomputationSentinel
            >>> call = RegionCall(RecomputationSentinel(torch.nn.Linear(2, 2)), "0", frozenset(), None, None)
            >>> call.comparisons.append(([0], [torch.tensor(1)]))
            >>> later = call.continued()
            >>> later.comparisons, len(call.comparisons), later.forward is call.forward
            ([], 1, True)
        """
        later = copy.copy(self)
        later.comparisons, later.metadata_mismatches, later.not_compared, later.on_new_paths = [], [], 0, 0
        later._recomputed, later._digests, later._held = [], [], []
        for saved in self.saved:
            saved.call = later
        return later

    def recomputation_done(self) -> None:
        """Keep this recomputation's digests for the step to compare, any sums among them weighed (also reached later,
        when the last tensor's holder was freed)."""
        if self._recomputed:
            slots = [slot for slot, _ in self._recomputed]
            try:
                self.comparisons.append((slots, joined(self.sentinel.plans, [found for _, found in self._recomputed])))
            except Exception as err:
                self.sentinel._failed(self.region, "the recomputation's digests", err)
                self.not_compared += len(slots)
        self._recomputed = []
        self.sentinel._compared(self)

    def pairs(self) -> Iterator[tuple[list[Any], Digests, Digests]]:
        """Each recomputation's saved tensors, with the forward's digests of them and the recomputed ones: both a
        digest each, or both a vector (a recomputation that compared only some of the forward's tensors may have
        digested in one pass all it compared, where the forward weighed sums)."""
        forward = self.forward
        if forward is None:  # nothing digested, so no slots
            return
        for slots, recomputed in self.comparisons:
            items: list[Any] = [self.slotted[slot] for slot in slots]
            if isinstance(forward, list):
                before: Digests = [forward[slot] for slot in slots]
            elif len(slots) == len(forward) and slots == list(range(len(slots))):
                before = forward
            else:
                before = forward.index_select(0, self.sentinel.plans.vector(tuple(slots), forward.device))
            if isinstance(before, list) != isinstance(recomputed, list):
                before, recomputed = as_vector(before), as_vector(recomputed)
            yield items, before, recomputed


# How `RegionCall._kind` ranks a saved activation: one computed from parameters alone (below every other), a
# floating-point one that does not require grad (dropout's noise), or one that does (computed from the region's values
# or inputs autograd tracks).
_WEIGHTS = -1
_FLOATING = 1
_COMPUTED = 2

# The multipliers of `RegionCall._in_turn`'s hash (odd 64-bit constants of splitmix64).
_TURN_HASH = 0x9E3779B97F4A7C15
_CALL_HASH = 0xBF58476D1CE4E5B9

# The most autograd nodes `from_parameters` walks: a weight's cast, transpose or reparametrization takes a few.
_WEIGHT_NODES = 16


def from_parameters(tensor: torch.Tensor) -> bool:
    """Whether autograd computed ``tensor`` from parameters alone: every path back through its graph ends, within a few
    nodes, at the gradient accumulator of an ``nn.Parameter`` (a weight cast to ``torch.autocast``'s dtype, a
    weight-norm weight). A path that ends anywhere else (an input, a tensor autograd does not track) makes it the
    region's own; so does a tensor without a graph.

    Args:
        tensor: A saved tensor.

    Example::

        >>> linear = nn.Linear(2, 2)
        >>> from_parameters(linear.weight.to(torch.bfloat16)), from_parameters(linear(torch.ones(1, 2)))
        (True, False)
    """
    pending = [tensor.grad_fn]
    walked = 0
    while pending:
        node = pending.pop()
        walked += 1
        if node is None or walked > _WEIGHT_NODES:
            return False
        if type(node).__name__ == "AccumulateGrad":
            if not isinstance(getattr(node, "variable", None), nn.Parameter):
                return False
            continue
        pending.extend(next_node for next_node, _ in node.next_functions)
    return True


def joined(plans: DigestPlans, found: list[Sums | torch.Tensor]) -> Digests:
    """Some saved tensors' digests as :data:`Digests`: as they are where each is a digest, else weighed together from
    their sums (:meth:`~lightning_ckpt_determinism.verify.digest.DigestPlans.combined`).

    Args:
        plans: Where the weights come from.
        found: Each tensor's digest or row and column sums, from
            :meth:`~lightning_ckpt_determinism.verify.digest.DigestPlans.digest_or_sums`.

    Example::

        >>> plans = DigestPlans()
        >>> matrix = torch.arange(6).view(2, 3)
        >>> joined(plans, [plans.digest(matrix)])[0] == joined(plans, [plans.sums(matrix)])[0]
        tensor(True)
    """
    if all(type(entry) is not tuple for entry in found):
        return found  # type: ignore[return-value]
    with no_python_dispatch():
        return plans.combined(found)


def as_vector(found: Digests) -> torch.Tensor:
    """``found`` as one vector of digests.

    Args:
        found: A digest each, or one vector already.

    Example::

        >>> as_vector([torch.tensor(3), torch.tensor(5)]).tolist()
        [3, 5]
    """
    if not isinstance(found, list):
        return found
    with no_python_dispatch():
        return torch.stack(found)


def is_state(tensor: torch.Tensor, local: torch.Tensor, buffers: frozenset[int | None]) -> bool:
    """Whether a saved tensor is a parameter or a buffer, or a view of one (``addmm`` saves ``weight.t()``).

    A parameter is known by the tensor it views (FSDP2 swaps in unsharded parameters at each forward, so their
    storage moves); a buffer by its storage, which stays.
    """
    base = view_base(tensor)
    if base is None:
        base = tensor
    # A plain tensor is never a parameter: only the rarer types pay for `Parameter`'s instance check.
    if type(base) is not torch.Tensor and isinstance(base, nn.Parameter):
        return True
    if not buffers:
        return False
    pointer = storage_pointer(local)
    return pointer is not None and pointer in buffers


def held_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor subclass holds: its inner tensors' (see :func:`plain_parts`), or as its metadata says."""
    parts = plain_parts(tensor)
    if parts is None:
        return tensor.numel() * tensor.element_size()
    return sum(part.numel() * part.element_size() for part in parts)
