"""What a recomputation changes in a region's state: parameters written in place, buffers no recompute context puts
back, and the tensor states of the torchmetrics metrics inside it."""

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_ckpt_determinism._library_compat import metric_state_names
from lightning_ckpt_determinism._torch_compat import no_python_dispatch, own_parameters, version_counter
from lightning_ckpt_determinism.checkpointing.modules import parameter_version
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.digest import EXACT, DigestPlans, readable
from lightning_ckpt_determinism.verify.gradients import local_tensor
from lightning_ckpt_determinism.verify.sentinel.report import StateChange
from lightning_ckpt_determinism.verify.state import named_metrics

__all__ = ["RegionParameters", "StateWatch", "changed", "metric_states"]


class StateOwner(Protocol):
    """What a :class:`StateWatch` needs of the sentinel that made it: its hooks are private, called by the sentinel's
    own modules only."""

    plans: DigestPlans

    def _changed(self, region: str, changes: list[StateChange]) -> None: ...

    def _state_compared(self, region: str, items: list[Any], before: torch.Tensor, after: torch.Tensor) -> None: ...


class StateWatch:
    """One recomputation of a region, watched for what it changes: the version counters of the region's parameters,
    the digests of the parameters its forward writes in place (a write counts only where it changed values), of the
    buffers no recompute context puts back, and of the tensor states of the torchmetrics metrics inside it."""

    def __init__(
        self,
        sentinel: "StateOwner",
        region: str,
        parameters: "RegionParameters",
        now: tuple[list[torch.Tensor | None], tuple[int, ...]],
        exposed: Sequence[tuple[str, torch.Tensor]],
        forward_written: frozenset[str],
        metrics: Sequence[tuple[str, Any, str]] = (),
    ) -> None:
        self.sentinel = sentinel
        self.region = region
        self.names = parameters.names
        self.held, self.versions = now
        self.parameters = (
            [
                (name, local_tensor(param))
                for name, param in zip(self.names, self.held, strict=True)
                if param is not None and name in forward_written and readable(param)
            ]
            if forward_written
            else []
        )
        self.buffers = [(name, local_tensor(buffer)) for name, buffer in exposed if readable(buffer)]
        self.metrics = [(name, metric, state) for name, metric, state in metrics if readable(getattr(metric, state))]
        self.parameters_before = self._digests(self.parameters)
        self.before = self._digests(self.buffers)
        self.metrics_before = self._digests(self._metric_values())

    def _metric_values(self) -> list[tuple[str, torch.Tensor]]:
        # Read through the metric at each digest: an update may bind a new tensor (`self.total = self.total + x`).
        return [(name, local_tensor(getattr(metric, state))) for name, metric, state in self.metrics]

    def _digests(self, tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
        if not tensors:
            return None
        with no_python_dispatch(), torch.no_grad():
            plans = self.sentinel.plans
            return torch.stack([plans.digest_of(tensor, EXACT) for _, tensor in tensors])  # type: ignore[misc]

    def done(self) -> None:
        versions = versions_of(self.held)
        digested = {name for name, _ in self.parameters}
        written = [name for name in (self.names[at] for at in changed(self.versions, versions)) if name not in digested]
        if written:
            self.sentinel._changed(self.region, [self._parameter_change(name) for name in written])
        if self.parameters_before is not None:
            after = self._digests(self.parameters)
            items = [self._parameter_change(name) for name, _ in self.parameters]
            self.sentinel._state_compared(self.region, items, self.parameters_before, after)  # type: ignore[arg-type]
        if self.before is not None:
            after = self._digests(self.buffers)
            items = [
                StateChange(f"buffer `{self.region}.{name}` changed by recomputation", Cause.BUFFER_MUTATION)
                for name, _ in self.buffers
            ]
            self.sentinel._state_compared(self.region, items, self.before, after)  # type: ignore[arg-type]
        if self.metrics_before is not None:
            after = self._digests(self._metric_values())
            items = [
                StateChange(f"metric `{self.region}.{name}` ({state}) updated by recomputation", Cause.METRIC_UPDATE)
                for name, _, state in self.metrics
            ]
            self.sentinel._state_compared(self.region, items, self.metrics_before, after)  # type: ignore[arg-type]

    def _parameter_change(self, name: str) -> "StateChange":
        return StateChange(f"parameter `{self.region}.{name}` written in place by recomputation", Cause.PARAMETER_WRITE)


class RegionParameters:
    """A region's parameters by name, read through their owners' own parameters (FSDP2 swaps the parameter objects in
    and out; the dicts stay), with their version counters, read in one pass at every region call.

    Args:
        module: The region.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> parameters = RegionParameters(layer)
        >>> _, before = parameters.now()
        >>> with torch.no_grad():
        ...     _ = layer.weight.mul_(2)
        >>> parameters.names, changed(before, parameters.now()[1])
        (('weight', 'bias'), [0])
    """

    def __init__(self, module: nn.Module) -> None:
        places = parameter_places(module)
        self.names = tuple(name for name, _, _ in places)
        self._owners = tuple(owned for _, owned, _ in places)
        self._attributes = tuple(attribute for _, _, attribute in places)

    def now(self) -> tuple[list[torch.Tensor | None], tuple[int, ...]]:
        """The parameters the owners hold now (``None`` where one holds none under its name) and their versions."""
        held = list(map(dict.get, self._owners, self._attributes))
        return held, versions_of(held)


def versions_of(held: Sequence[torch.Tensor | None]) -> tuple[int, ...]:
    """The version counters of ``held`` (``-1`` for ``None``), in their order.

    Example::

        >>> versions_of([torch.zeros(1).add_(1), None])
        (1, -1)
    """
    try:
        versions = tuple(map(version_counter, held))  # type: ignore[arg-type]
    except AttributeError:  # an owner holds no parameter under its name
        return tuple(-1 if param is None else parameter_version(param) for param in held)
    # A wrapper subclass (a quantized weight) also counts the writes to its inner tensors.
    return versions if _PLAIN.issuperset(map(type, held)) else tuple(map(parameter_version, held))  # type: ignore[arg-type]


_PLAIN = frozenset((torch.Tensor, nn.Parameter))


def changed(before: tuple[int, ...], after: tuple[int, ...]) -> list[int]:
    """The positions whose version moved between ``before`` and ``after`` (parameters held at both).

    Example::

        >>> changed((0, 3, -1), (0, 4, 2))
        [1]
    """
    if before == after:
        return []
    return [at for at, (old, new) in enumerate(zip(before, after, strict=True)) if old != new and -1 not in (old, new)]


def metric_states(module: nn.Module) -> list[tuple[str, Any, str]]:
    """Each tensor state of the torchmetrics metrics inside ``module``, as ``(metric name, metric, state)``: a metric
    its forward updates, recomputation updates a second time."""
    return [
        (name, metric, state)
        for name, metric in named_metrics(module)
        for state in metric_state_names(metric)
        if isinstance(getattr(metric, state), torch.Tensor)
    ]


def parameter_places(module: nn.Module) -> list[tuple[str, dict[str, Any], str]]:
    """Each parameter of ``module`` as ``(name, its owner's own parameters, attribute)``: the dict's ``attribute`` is
    the parameter (the dict stays the owner's when FSDP2 swaps its entries)."""
    places = []
    for name, _ in module.named_parameters():
        path, _, attribute = name.rpartition(".")
        places.append((name, own_parameters(module.get_submodule(path) if path else module), attribute))
    return places
