"""One training step of the sentinel: what it compared, kept on the device until read."""

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

WEIGHED_LATER = 1 << 15
"""The most words of row and column sums (8 bytes each: 256 KiB) a step of the light tier keeps for weighing in one
go; a region call whose sums would not fit weighs its own at once. Sums read again at the step's end cost more than
they save once they outgrow a core's cache: keeping up to 1 MiB cost the sampled tier about 2 % of a step at width 128
on a 2-core CPU, which is why it and the exact tier weigh each call's own."""


class SentinelStep:
    """What one step compared, kept on the device until it is read
    (:meth:`~lightning_ckpt_determinism.verify.sentinel.RecomputationSentinel.read`): the step of a mismatch is known
    when it is read, however much later.

    Attributes:
        compared: Saved tensors compared (known on the host, without reading the device).

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
        self._kept = 0

    @property
    def compared(self) -> int:
        """Saved tensors compared in this step (known on the host)."""
        return sum(call.compared + len(call.metadata_mismatches) for call in self.calls)

    def keeps(self, words: int) -> bool:
        """Whether the step has room to keep ``words`` more words of sums for :meth:`weigh` (counted if so).

        Args:
            words: A region call's sums, in words (:func:`~lightning_ckpt_determinism.verify.sentinel.calls.words_of`).
        """
        if self._kept + words > WEIGHED_LATER:
            return False
        self._kept += words
        return True

    def weigh(self) -> None:
        """Weigh the row and column sums every call of the step kept (its forward's, its recomputations') into their
        digests, all in one go: a few kernels for the step rather than four for each region call's forward and each
        recomputation. The sentinel weighs a step when it ends and when the next one starts, and its comparison
        weighs any sums a late recomputation adds."""
        pending = [(call, found) for call in self.calls if (found := call.unweighed())]
        self._kept = 0
        if not pending:
            return
        lengths = [len(sums) for _, found in pending for sums in found]
        try:
            with no_python_dispatch():
                digests = self._sentinel.plans.combined(
                    [entry for _, found in pending for sums in found for entry in sums]
                )
                parts = digests.split(lengths)
        except Exception as err:
            for call, _ in pending:
                call.weighed(None, err)
            return
        at = 0
        for call, found in pending:
            call.weighed(parts[at : at + len(found)])
            at += len(found)

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
            self.weigh()
            layout: list[Entry] = []
            forward, recomputed = [], []
            for call in self.calls:
                for items, before, after in call.pairs():
                    layout.append((call.region, items))
                    forward.append(before)
                    recomputed.append(after)
            for region, items, before, after in self.state_pairs:
                layout.append((region, items))
                forward.append(before)
                recomputed.append(after)
            flags = None
            if forward:
                with no_python_dispatch():
                    flags = (torch.cat(forward) != torch.cat(recomputed)).to(torch.int64)
            self._flags = (layout, flags)
        return self._flags

    def regions(self, *, clean: bool) -> dict[str, SentinelRegion]:
        """What the step found by region, reading the comparisons back unless ``clean``."""
        layout, flags = self.flags()
        names = self._sentinel.regions
        differed = [] if clean or flags is None else flags.tolist()
        found: dict[str, list[Any]] = {name: [] for name in names}
        compared = dict.fromkeys(names, 0)
        not_compared = dict.fromkeys(names, 0)
        at = 0
        for owner, items in layout:
            compared[owner] += sum(isinstance(item, KeptTensor) for item in items)
            for item, flag in zip(items, differed[at : at + len(items)], strict=False):
                if flag:
                    found[owner].append(item)
            at += len(items)
        for call in self.calls:
            compared[call.region] += len(call.metadata_mismatches)
            not_compared[call.region] += call.not_compared
            found[call.region].extend(StateChange(text, None) for text in call.metadata_mismatches)
        for owner, change in self.changes:
            found[owner].append(change)
        return {
            name: SentinelRegion(
                compared=compared[name],
                mismatches=len(found[name]),
                first_mismatch=found[name][0].describe() if found[name] else None,
                not_compared=not_compared[name],
                cause=found[name][0].cause if found[name] else None,
            )
            for name in names
        }
