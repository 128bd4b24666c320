"""What the sentinel reports: per region and over every region, and the description of a state change a
recomputation made."""

from dataclasses import dataclass, field

from lightning_ckpt_determinism.verify.cause import Cause

__all__ = ["SentinelRegion", "SentinelReport", "StateChange", "added"]


@dataclass(frozen=True)
class SentinelRegion:
    """What the sentinel found in one checkpointed region.

    Attributes:
        compared: Saved tensors whose recomputation was compared with the forward's.
        mismatches: Those whose recomputation differed, plus the parameters recomputation wrote in place and the
            buffers and metric states whose values it changed.
        first_mismatch: The first that differed: its position among the region's saved tensors, the op that
            produced it, its shape and dtype (and what differed, for metadata), or the parameter or buffer and what
            recomputation did to it; ``None`` when none did.
        not_compared: Saved tensors (activations) left out: opaque workspaces, tensors without bits to read, any the
            sentinel failed to read, and those of calls that took a code path the region had not learned yet.
        on_new_paths: Of ``not_compared``, those of calls that took a code path the region had not learned yet (its
            next call that takes that path learns it, and is compared).
        cause: The cause of ``first_mismatch`` when the sentinel knows it (``"parameter_write"``,
            ``"buffer_mutation"``, ``"metric_update"``); ``None`` for a saved tensor, whose cause a full check names.

    Example::

        >>> SentinelRegion().compared
        0
    """

    compared: int = 0
    mismatches: int = 0
    first_mismatch: str | None = None
    not_compared: int = 0
    cause: Cause | None = None
    on_new_paths: int = 0


@dataclass(frozen=True)
class SentinelReport:
    """What the sentinel found since its block was entered.

    Attributes:
        compared: Saved tensors whose recomputation was compared, over every region.
        mismatches: Mismatches over every region (see :class:`SentinelRegion`).
        regions: One :class:`SentinelRegion` per checkpointed region, by name relative to the module, every region
            present.
        compiled: The regions inside compiled modules, recomputed by the compiler (not compared unless they
            graph-break).
        not_compared: Saved tensors left out, over every region.
        on_new_paths: Of ``not_compared``, those of calls on code paths their region had not learned yet.

    Example::

        >>> SentinelReport(0, 0, {}).mismatches
        0
    """

    compared: int
    mismatches: int
    regions: dict[str, SentinelRegion]
    compiled: list[str] = field(default_factory=list)
    not_compared: int = 0
    on_new_paths: int = 0


@dataclass(frozen=True)
class StateChange:
    """A parameter or buffer a recomputation changed (or a saved tensor recomputed with other metadata), as a
    mismatch describes it."""

    description: str
    cause: Cause | None

    def describe(self) -> str:
        return self.description


def added(totals: dict[str, SentinelRegion], found: dict[str, SentinelRegion]) -> dict[str, SentinelRegion]:
    """``totals`` with ``found`` added, region by region (the first mismatch and its cause kept from the earliest)."""
    added = {}
    for name, total in totals.items():
        region = found[name]
        first = total.first_mismatch is None and region.first_mismatch is not None
        added[name] = SentinelRegion(
            total.compared + region.compared,
            total.mismatches + region.mismatches,
            region.first_mismatch if first else total.first_mismatch,
            total.not_compared + region.not_compared,
            region.cause if first else total.cause,
            total.on_new_paths + region.on_new_paths,
        )
    return added
