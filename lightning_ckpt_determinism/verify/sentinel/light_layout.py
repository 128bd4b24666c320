"""Which of a region call's saved tensors the sentinel's ``"light"`` tier digests.

A region's saved tensors come in the same order at every call of the same code path: a :class:`SavedLayout`, learned
from one call whose every saved tensor was looked at, says how many there are and which of them are activations the
sentinel can compare (not parameters or buffers, not opaque workspaces, with bits to read). At each later call, the
light tier digests only :meth:`SavedLayout.targets`:

- the region's last compared saved tensor and its last floating-point one computed from the region's values (one that
  requires grad), at every step: a change anywhere upstream of them (a redrawn dropout mask, host noise in the first
  op, a counter, rows reordered, another scale) reaches them. A region ending in dropout saves dropout's noise last,
  which no value upstream reaches; the computed one before it does. Where no floating-point one requires grad, the
  last floating-point one stands in. Neither is a tensor computed from the region's parameters alone (``weights``: a
  weight cast to ``torch.autocast``'s dtype, which a linear layer saves last, or a weight-norm weight): no value of
  the call reaches it, and a change of the parameters reaches the activations computed from them;
- one more position, rotating from step to step over the compared ones, so that a change confined to one saved
  tensor of a side branch, which no later saved tensor depends on, is seen within as many steps as the region has
  compared saved tensors. Its window of elements moves on once per turn, so that every window of every tensor comes
  round in turn.

A call that took another code path than its layout's (another number of saved tensors or autograd nodes, or its output
from another op) is still compared where its targets fell, and the region's layout is learned again at its next call.
A call that learns (every call of a region whose paths keep alternating) digests its last activations and one more
position drawn by a hash (``RegionCall._in_turn``) in place of the rotating one.
"""

from dataclasses import dataclass, field

from lightning_ckpt_determinism.verify.digest import DigestMode

__all__ = ["SavedLayout"]


@dataclass(frozen=True)
class SavedLayout:
    """The saved tensors of one region's calls, as the light tier selects among them.

    Attributes:
        saved: How many tensors a call saves.
        compared: The positions of those the sentinel compares (activations with bits to read), in order.
        floating: The positions among ``compared`` holding floating-point tensors, in order.
        derived: The positions among ``floating`` whose tensors require grad when saved: computed from the region's
            values or inputs autograd tracks, unlike dropout's noise.
        left_out: Activations among them the sentinel cannot compare (opaque workspaces, tensors without bits to
            read): each call counts them as not compared.
        weights: The positions among ``compared`` whose tensors autograd computed from the region's parameters alone
            (not in ``floating`` nor ``derived``): compared in turn, never a fixed target.

    Example::

        >>> layout = SavedLayout(saved=5, compared=(0, 2, 3), floating=(0, 2), derived=(0,))
        >>> sorted(layout.targets(DigestMode("light", offset=1)))  # the last, the last computed float, 2 in turn
        [0, 2, 3]
        >>> sorted(layout.targets(DigestMode("light", offset=3)))
        [0, 3]
        >>> cast = SavedLayout(saved=3, compared=(0, 1, 2), floating=(0, 1), derived=(1,), weights=(2,))
        >>> sorted(cast.targets(DigestMode("light", offset=0)))  # the weight cast saved last only in turn
        [0, 1]
    """

    saved: int
    compared: tuple[int, ...]
    floating: tuple[int, ...]
    derived: tuple[int, ...] = ()
    left_out: int = 0
    weights: tuple[int, ...] = ()
    # The fixed targets, worked out once: the last compared activation and the last computed one.
    _last: int | None = field(default=None, init=False, repr=False, compare=False)
    _computed: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        activations = [position for position in self.compared if position not in self.weights] or self.compared
        computed = self.derived or self.floating
        object.__setattr__(self, "_last", activations[-1] if activations else None)
        object.__setattr__(self, "_computed", computed[-1] if computed else None)

    def targets(self, mode: DigestMode) -> dict[int, DigestMode]:
        """The positions a call digests at ``mode``'s step, each with the mode its digests read.

        Args:
            mode: The step's mode; the fixed targets read its window, the rotating one the window of its turn.

        Example::

            >>> SavedLayout(saved=2, compared=(0, 1), floating=(0,)).targets(DigestMode("light", offset=4))
            {1: DigestMode(tier='light', offset=4), 0: DigestMode(tier='light', offset=4)}
        """
        if self._last is None:
            return {}
        chosen = {self._last: mode}
        if self._computed is not None:
            chosen.setdefault(self._computed, mode)
        turn, position = divmod(mode.offset, len(self.compared))
        chosen.setdefault(self.compared[position], DigestMode(mode.tier, turn))
        return chosen
