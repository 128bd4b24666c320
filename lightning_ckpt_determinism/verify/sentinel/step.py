"""One training step of the sentinel: what it compared, kept on the device until read."""

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from lightning_ckpt_determinism._torch_compat import no_python_dispatch
from lightning_ckpt_determinism.verify.digest import DigestPlans
from lightning_ckpt_determinism.verify.sentinel.calls import KeptTensor, RegionCall
from lightning_ckpt_determinism.verify.sentinel.report import SentinelRegion, StateChange

__all__ = ["SentinelStep"]


class StepOwner(Protocol):
    """What a :class:`SentinelStep` needs of its sentinel: the regions, in order, and its digest plans."""

    plans: DigestPlans

    @property
    def regions(self) -> list[str]: ...


Entry = tuple[str, list[Any]]


class SentinelStep:
    """What one step compared, kept on the device until it is read
    (:meth:`~lightning_ckpt_determinism.verify.sentinel.RecomputationSentinel.read`): the step of a mismatch is known
    when it is read, however much later.

    Attributes:
        compared: Saved tensors compared (known on the host, without reading the device).
        on_new_paths: Saved tensors left out on calls down a code path their region had not learned yet (known on
            the host).

    Example::

        >>> from lightning_ckpt_determinism.verify.sentinel import RecomputationSentinel
        >>> sentinel = RecomputationSentinel(torch.nn.Linear(2, 2))
        >>> step = sentinel.end_step()
        >>> step.compared, step.mismatch_counts("cpu").tolist()
        (0, [])
    """

    def __init__(self, sentinel: "StepOwner") -> None:
        self._sentinel = sentinel
        self.calls: list[RegionCall] = []
        self.state_pairs: list[tuple[str, list[Any], torch.Tensor, torch.Tensor]] = []
        self.changes: list[tuple[str, StateChange]] = []
        self.read: dict[str, SentinelRegion] | None = None
        self._flags: tuple[list[Entry], torch.Tensor | None] | None = None

    @property
    def compared(self) -> int:
        """Saved tensors compared in this step (known on the host)."""
        return sum(call.compared + len(call.metadata_mismatches) for call in self.calls)

    @property
    def on_new_paths(self) -> int:
        """Saved tensors not compared in this step because their call took a code path its region had not learned
        yet (known on the host)."""
        return sum(call.on_new_paths for call in self.calls)

    def updated(self) -> None:
        """Something was added to the step (comparisons made after :meth:`flags` are compared again)."""
        self._flags = None

    def mismatch_counts(self, device: torch.device | str) -> torch.Tensor:
        """How many mismatches each region had in this step, as an integer tensor on ``device`` in region order;
        computed on the device, not read back.

        Args:
            device: Where the counts go (the device the collective backend needs).
        """
        names = self._sentinel.regions
        layout, flags = self.flags()
        index = {name: position for position, name in enumerate(names)}
        if flags is None:
            counts = torch.zeros(len(names), dtype=torch.int64, device=device)
        else:
            # Each comparison's region, as a vector kept from step to step (the same regions compare alike).
            owners = self._sentinel.plans.vector(
                tuple(index[region] for region, items in layout for _ in items), flags.device
            )
            with no_python_dispatch():
                found = torch.zeros(len(names), dtype=torch.int64, device=flags.device).index_add_(0, owners, flags)
            counts = found.to(device)
        known = [0] * len(names)
        for call in self.calls:
            known[index[call.region]] += len(call.metadata_mismatches)
        for region, _ in self.changes:
            known[index[region]] += 1
        if any(known):
            counts = counts + torch.tensor(known, dtype=torch.int64, device=device)
        return counts

    def flags(self) -> tuple[list[Entry], torch.Tensor | None]:
        """Every comparison of the step, in order, and whether each differed (an int64 vector, on the device;
        ``None`` when nothing was compared): one comparison for all of them."""
        if self._flags is None:
            # Digests kept one by one are stacked in one go, ahead of the vectors (exact calls', buffers').
            layout: list[Entry] = []
            one_by_one: list[tuple[torch.Tensor, torch.Tensor]] = []
            vectors: list[tuple[Entry, torch.Tensor, torch.Tensor]] = []
            for call in self.calls:
                for items, before, after in call.pairs():
                    if isinstance(before, list):
                        layout.append((call.region, items))
                        one_by_one.extend(zip(before, after, strict=True))  # type: ignore[arg-type]
                    else:
                        vectors.append(((call.region, items), before, after))  # type: ignore[arg-type]
            vectors.extend(((region, items), before, after) for region, items, before, after in self.state_pairs)
            layout.extend(entry for entry, _, _ in vectors)
            flags = None
            if layout:
                with no_python_dispatch():
                    forward = [before for _, before, _ in vectors]
                    recomputed = [after for _, _, after in vectors]
                    if one_by_one:
                        forward.insert(0, torch.stack([before for before, _ in one_by_one]))
                        recomputed.insert(0, torch.stack([after for _, after in one_by_one]))
                    flags = (torch.cat(forward) != torch.cat(recomputed)).to(torch.int64)
            self._flags = (layout, flags)
        return self._flags

    def first_saved_mismatches(self) -> dict[str, tuple[int, str]]:
        """Per region, the first saved tensor whose recomputation differed in this step, read back from the device:
        its call's :attr:`~lightning_ckpt_determinism.verify.sentinel.calls.RegionCall.ordinal` and its description.
        Regions where none differed are left out."""
        layout, flags = self.flags()
        first: dict[str, tuple[int, int, str]] = {}
        for owner, item, differed in _flagged(layout, [] if flags is None else flags.tolist()):
            if differed and isinstance(item, KeptTensor):
                found = (item.call.ordinal, item.position, item.describe())
                first[owner] = min(first.get(owner, found), found)
        return {owner: (ordinal, description) for owner, (ordinal, _, description) in first.items()}

    def regions(self, *, clean: bool) -> dict[str, SentinelRegion]:
        """What the step found by region, reading the comparisons back unless ``clean``."""
        layout, flags = self.flags()
        names = self._sentinel.regions
        differed = [] if clean or flags is None else flags.tolist()
        found: dict[str, list[Any]] = {name: [] for name in names}
        compared = dict.fromkeys(names, 0)
        not_compared = dict.fromkeys(names, 0)
        on_new_paths = dict.fromkeys(names, 0)
        for owner, item, flag in _flagged(layout, differed):
            compared[owner] += isinstance(item, KeptTensor)
            if flag:
                found[owner].append(item)
        # The saved tensors that differed, earliest call first (an RNN's cell: the earliest timestep).
        for items in found.values():
            items.sort(key=_earliest)
        for call in self.calls:
            compared[call.region] += len(call.metadata_mismatches)
            not_compared[call.region] += call.not_compared
            on_new_paths[call.region] += call.on_new_paths
            found[call.region].extend(StateChange(text, None) for text in call.metadata_mismatches)
        for owner, change in self.changes:
            found[owner].append(change)
        return {
            name: SentinelRegion(
                compared=compared[name],
                mismatches=len(found[name]),
                first_mismatch=self._described(found[name][0]) if found[name] else None,
                not_compared=not_compared[name],
                cause=found[name][0].cause if found[name] else None,
                on_new_paths=on_new_paths[name],
            )
            for name in names
        }

    def _described(self, mismatch: Any) -> str:
        """A mismatch in words; for a saved tensor of a region called several times before its backward (an RNN's
        cell), with the call."""
        if not isinstance(mismatch, KeptTensor):
            return str(mismatch.describe())
        if not any(call.position for call in self.calls if call.region == mismatch.call.region):
            return mismatch.describe()  # called once a pass
        return f"{mismatch.describe()}, at the region's call {mismatch.call.position} (from 0) of its forward pass"


def _earliest(item: Any) -> tuple[int, int, int]:
    """Orders a step's mismatches: saved tensors by call, then position; what else differed after, as found."""
    return (0, item.call.ordinal, item.position) if isinstance(item, KeptTensor) else (1, 0, 0)


def _flagged(layout: list[Entry], differed: list[int]) -> Iterator[tuple[str, Any, bool]]:
    """Each item of a step's comparisons, in order, with its region and whether it differed: ``differed`` holds the
    comparisons' flags as read back, or nothing where they were not read."""
    at = 0
    for owner, items in layout:
        for offset, item in enumerate(items, start=at):
            yield owner, item, offset < len(differed) and bool(differed[offset])
        at += len(items)
