"""The package's ``determinism_check``: torch's own metadata check, with a slot for an observer of saved tensors.

torch's non-reentrant checkpoint calls a region's ``determinism_check`` extractor on every tensor it saves for
backward in the region's forward (under ``no_grad``) and keeps what it returns. At the region's first unpack in
backward, once the region is recomputed, it compares each kept value with the extractor of the recomputed tensor
(``saved != extract(recomputed)``, for every holder still alive) and raises its ``CheckpointError`` on a difference.
The extractor is looked up by the name given as ``determinism_check``, in a registry of torch's own.

The package registers two names there, which every checkpointed region passes instead of torch's ``"default"`` and
``"none"``: while no observer is registered they behave exactly as those (shapes, dtypes and devices compared, or
nothing), and while one is (:func:`observing_saved_tensors`) the observer gives what is kept at the forward and what
is compared at the recomputation. The traced path under ``torch.compile`` passes the same constant name, so dynamo
guards on nothing more; the compiler recomputes compiled regions itself and calls no extractor.

The extractor also hands each tensor a region's forward saves to that region call's probe, while one learns what the
region saves (:mod:`~lightning_ckpt_determinism.checkpointing.profile`): :class:`Probing` says which call that is.
"""

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, Protocol

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import determinism_checks
from lightning_ckpt_determinism.checkpointing.switch import _SWITCH

__all__ = [
    "DETERMINISM_CHECKS",
    "Probing",
    "SavedTensorObserver",
    "SavedTensorProbe",
    "observing_saved_tensors",
    "probing_now",
    "saved_tensor_observer",
]


class SavedTensorObserver(Protocol):
    """What :func:`observing_saved_tensors` plugs into every eagerly checkpointed region.

    ``region_forward`` is entered around each region call's forward; ``extract`` is the extractor torch calls, with
    ``strict`` telling whether the region's ``determinism_check`` is ``"default"`` (a difference of metadata must
    raise torch's error) or ``"none"``.

    ``region_recompute`` is entered around each recomputation of an eagerly checkpointed region, inside its recompute
    contexts, with the buffers whose live values that recomputation could change (those no recompute context puts
    back).
    """

    def region_forward(self, region: str, module: nn.Module) -> AbstractContextManager[None]: ...

    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> AbstractContextManager[None]: ...

    def extract(self, tensor: torch.Tensor, *, strict: bool) -> Any: ...


class SavedTensorProbe(Protocol):
    """What learns from the tensors one region call's forward saves: :meth:`packed` gets each, in order."""

    def packed(self, tensor: torch.Tensor) -> None: ...


# The region call whose forward runs now, when a probe learns from it: torch calls the extractor with the tensor alone,
# so the wrapper says which call it is. Context-local, and read only by eager calls (dynamo never traces it).
_PROBE: ContextVar[SavedTensorProbe | None] = ContextVar("lightning_ckpt_determinism_probe", default=None)


class Probing:
    """Hand the tensors saved inside this block to ``probe`` (``None``: to no probe, as inside a region call that is
    not probed within one that is).

    Args:
        probe: The probe of the region call whose forward runs inside the block.

    Example::

        >>> class Count:
        ...     saved = 0
        ...     def packed(self, tensor):
        ...         self.saved += 1
        >>> count = Count()
        >>> with Probing(count):
        ...     _ = _default(torch.ones(1))
        >>> count.saved
        1
    """

    __slots__ = ("_probe", "_token")

    def __init__(self, probe: SavedTensorProbe | None) -> None:
        self._probe = probe
        self._token: Token[SavedTensorProbe | None] | None = None

    def __enter__(self) -> None:
        self._token = _PROBE.set(self._probe)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _PROBE.reset(self._token)


def probing_now() -> bool:
    """Whether a probe learns from the region call whose forward runs now.

    Example::

        >>> probing_now()
        False
    """
    return _PROBE.get() is not None


def _default(tensor: torch.Tensor) -> Any:
    probe = _PROBE.get()
    if probe is not None:
        probe.packed(tensor)
    observer = _SWITCH.saved_observer
    if observer is None:
        return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device}
    return observer.extract(tensor, strict=True)


def _none(tensor: torch.Tensor) -> Any:
    probe = _PROBE.get()
    if probe is not None:
        probe.packed(tensor)
    observer = _SWITCH.saved_observer
    return None if observer is None else observer.extract(tensor, strict=False)


DETERMINISM_CHECKS = {"default": "lightning_ckpt_determinism", "none": "lightning_ckpt_determinism_none"}
"""The name a region passes to torch for each ``CheckpointingConfig.determinism_check``."""

determinism_checks().update({DETERMINISM_CHECKS["default"]: _default, DETERMINISM_CHECKS["none"]: _none})


def saved_tensor_observer() -> SavedTensorObserver | None:
    """The observer now registered, or ``None``.

    Example::

        >>> saved_tensor_observer() is None
        True
    """
    return _SWITCH.saved_observer


@contextlib.contextmanager
def observing_saved_tensors(observer: SavedTensorObserver) -> Iterator[None]:
    """Give ``observer`` every tensor the eagerly checkpointed regions save inside this block (one at a time).

    Args:
        observer: What keeps and compares the saved tensors.
    """
    previous = _SWITCH.saved_observer
    _SWITCH.saved_observer = observer
    try:
        yield
    finally:
        _SWITCH.saved_observer = previous
