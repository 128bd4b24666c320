"""The package's ``determinism_check``: torch's own metadata check, with a slot for one region call's observer.

torch's non-reentrant checkpoint calls a region's ``determinism_check`` extractor on every tensor it saves for
backward in the region's forward (under ``no_grad``) and keeps what it returns. At the region's first unpack in
backward, once the region is recomputed, it compares each kept value with the extractor of the recomputed tensor
(``saved != extract(recomputed)``, for every holder still alive, the saved value on the left: pinned in
:mod:`~lightning_ckpt_determinism._torch_compat`) and raises its ``CheckpointError`` on a difference. The extractor
is looked up by the name given as ``determinism_check``, in a registry of torch's own.

The package registers two names there, which a region's eager call passes instead of torch's ``"default"`` and
``"none"`` where a probe learns from the call, an observer reads it, or torch's frame cannot count what it saves
(:func:`~lightning_ckpt_determinism._torch_compat.checkpoint_saved_counter`; a call that runs a backward inside its
forward saves tensors the package's extractor leaves out of its count). Every other eager call passes torch's own name,
and its tensors cost what a hand-written checkpoint's do. torch calls the extractor with the tensor alone, so each eager
region call says which call it is while its forward runs (:class:`InRegionCall`): its probe, while one learns what the
region saves (:mod:`~lightning_ckpt_determinism.checkpointing.profile`), and the saved-tensor observer registered on
that region (:func:`~lightning_ckpt_determinism.checkpointing.wrapper.observing_saved_tensors`, on one model's own
regions). Where neither is set they behave exactly as torch's (shapes, dtypes and devices compared, or nothing); where
an observer is, its plan says which tensors it handles and gives what is kept of them at the forward, and the recomputed
tensor reaches what it kept (:func:`recomputed_tensor`). Each recomputation says whose tensors torch compares next
(:func:`recomputing`), so that the comparisons of a call no observer watched cost what torch's own do, plus a context
lookup. The traced path under ``torch.compile`` always passes the package's constant name, so dynamo guards on
nothing more; the compiler recomputes compiled regions itself and calls no extractor.
"""

import sys
import weakref
from collections.abc import Callable, Container, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import current_graph_task_id, determinism_checks

__all__ = [
    "DETERMINISM_CHECKS",
    "EVERY_POSITION",
    "InRegionCall",
    "Recomputed",
    "SavedPlan",
    "SavedTensorObserver",
    "kept_by_torch",
    "recomputed_tensor",
    "recomputing",
    "register_determinism_checks",
]


Extractor = Callable[[torch.Tensor, int, bool], Any]
"""What one region call's observer does with a tensor its forward saves: ``extract(tensor, position, strict)`` gives
the value torch keeps, ``position`` being the tensor's place among those the call saved and ``strict`` telling whether
the region's ``determinism_check`` is ``"default"`` (a difference of metadata must raise torch's error) or
``"none"``."""

EVERY_POSITION: Container[int] = range(sys.maxsize)
"""The positions of a :class:`SavedPlan` whose extractor handles every saved tensor."""


class SavedPlan(NamedTuple):
    """What one region call's observer does with the tensors its forward saves, decided when the call starts: its
    extractor handles the tensors at ``positions``, and the others keep what torch's own extractor keeps, at the cost of
    an index and a branch.

    Attributes:
        extract: Handles each tensor at one of ``positions``.
        positions: The positions ``extract`` handles (:data:`EVERY_POSITION`: all of them).

    Example::

        >>> class ReadsTheSecond:
        ...     def extractor(self):
        ...         return SavedPlan(lambda tensor, position, strict: f"read {position}", positions=frozenset({1}))
        >>> with InRegionCall(None, ReadsTheSecond()):  # type: ignore[arg-type]
        ...     kept = [_default(torch.ones(1)) for _ in range(3)]
        >>> kept[1], kept[2]["shape"]
        ('read 1', torch.Size([1]))
    """

    extract: Extractor
    positions: Container[int] = EVERY_POSITION


class SavedTensorObserver(Protocol):
    """What :func:`~lightning_ckpt_determinism.checkpointing.wrapper.observing_saved_tensors` plugs into one model's
    eagerly checkpointed regions.

    ``region_forward`` is entered around each region call's forward. Inside it, when the call starts, ``extractor``
    gives what handles the tensors that forward saves (a :class:`SavedPlan`; ``None`` keeps torch's own metadata for
    every one): asked once per region call, so that each decision the observer can make per call (which tensors it
    reads) is made once, not per tensor. What the plan's extractor returns is compared after the recomputation with
    the extractor's value of the recomputed tensor, which :func:`recomputed_tensor` turns into that tensor.

    ``region_recompute`` is entered around each recomputation of an eagerly checkpointed region, inside its recompute
    contexts, with the buffers whose live values that recomputation could change (those no recompute context puts
    back).

    ``watching`` says whether the observer reads the region calls that start now: a call it does not read (a paused
    sentinel's) enters none of its contexts and keeps torch's own extractor, at a hand-written checkpoint's cost.
    """

    @property
    def watching(self) -> bool: ...

    def region_forward(self, region: str, module: nn.Module) -> AbstractContextManager[None]: ...

    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> AbstractContextManager[None]: ...

    def extractor(self) -> SavedPlan | None: ...


class SavedTensorProbe(Protocol):
    """What learns from the tensors one region call's forward saves: :meth:`packed` gets each, in order."""

    def packed(self, tensor: torch.Tensor) -> None: ...


class _Call:
    """One region call as the extractor sees it. While its forward runs: what learns from and what handles each tensor
    it saves, decided when the call starts, and how many tensors it saved so far; ``fast`` says that the extractor
    counts a tensor and follows the plan without asking torch which backward runs (no probe learns from the call, and
    no backward ran inside its forward since its last tensor, see :func:`recomputing`). After its recomputation, where
    torch compares its tensors (``comparing``): the value the extractor gave last and a weak reference to the tensor it
    was given, so that a value an observer kept finds the recomputed tensor (:func:`recomputed_tensor`).

    One class for both, so that each attribute the extractor reads is read from one type (Python specialises such
    reads).
    """

    __slots__ = ("comparing", "extract", "fast", "packs", "positions", "probe", "task", "tensor", "value")

    def __init__(self, probe: SavedTensorProbe | None, plan: SavedPlan | None, *, comparing: bool = False) -> None:
        self.probe = probe
        self.extract: Extractor | None = None if plan is None else plan.extract
        self.positions: Container[int] = frozenset() if plan is None else plan.positions
        self.packs = 0
        # A backward run inside the forward (a gradient penalty) compares tensors of other calls: not this call's.
        self.task = current_graph_task_id()
        self.fast = probe is None and not comparing
        self.comparing = comparing
        self.value: object = self  # never an extractor value
        self.tensor: Callable[[], torch.Tensor | None] = _gone


def _gone() -> None:
    return None


# The comparisons of a call no observer watched, shared: the extractor gives torch's metadata and notes nothing.
_PLAIN = _Call(None, None, comparing=True)
# Where no region call is current (nor was recomputed) in this context: the extractor asks torch which backward runs.
_NONE = _Call(None, None)
_NONE.fast = False

# The one piece of state the package keeps besides the checkpointing switch: the eager region call whose forward runs
# now, or, after a recomputation, whose tensors torch compares. torch calls the extractor with the tensor alone, so the
# wrapper says which call it is. Context-local, so that threads never see each other's calls (autograd's device
# threads recompute and compare in their own context), and read only by eager calls (dynamo never traces it).
_CURRENT: ContextVar[_Call] = ContextVar("lightning_ckpt_determinism_region_call", default=_NONE)


class InRegionCall:
    """Say, inside this block, which region call's forward runs: its probe and its saved-tensor observer; count the
    tensors it saves (:attr:`saved`), which tell the region whether the call took the path its profile was learned on.

    Create it inside the observer's ``region_forward`` block: it asks the observer for the call's plan at once. A region
    call inside another one's forward enters its own block, so that the outer call's probe and observer never see what
    the inner region saves, nor count it.

    Args:
        probe: The probe learning from this call's forward, or ``None``.
        observer: The saved-tensor observer registered on the region, or ``None``.

    Example::

        >>> class Count:
        ...     saved = 0
        ...     def packed(self, tensor):
        ...         self.saved += 1
        >>> count = Count()
        >>> with InRegionCall(count, None):
        ...     _ = _default(torch.ones(1))
        >>> count.saved
        1
        >>> call = InRegionCall(None, None)
        >>> with call:
        ...     _ = _default(torch.ones(1)), _default(torch.ones(1))
        >>> call.saved
        2
    """

    __slots__ = ("_call", "_token")

    def __init__(self, probe: SavedTensorProbe | None, observer: SavedTensorObserver | None) -> None:
        self._call = _Call(probe, None if observer is None else observer.extractor())
        self._token: Token[_Call] | None = None

    @property
    def saved(self) -> int:
        """How many tensors the call's forward saved inside this block."""
        return self._call.packs

    @property
    def observed(self) -> bool:
        """Whether the observer handles some of the call's tensors (it gave a plan), so that their comparisons after a
        recomputation find the recomputed tensors (:func:`recomputing`)."""
        return self._call.extract is not None

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._call)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)


def recomputing(*, observed: bool) -> None:
    """A region call is recomputed now, and torch compares its tensors once the recomputation ends: say whether an
    observer kept them (``observed``). The extractor gives torch's own metadata at those comparisons, and for a call
    an observer watched also notes the tensor it was given (weakly), for :func:`recomputed_tensor`.

    Called at each recomputation of an eager region call. Where a region call's forward runs in this context (a backward
    inside it, as a gradient penalty runs), that call asks torch which backward runs at its next tensor instead, and
    the comparisons meanwhile get a :class:`Recomputed`.

    Args:
        observed: Whether the recomputed call's forward had a saved-tensor observer.

    Example::

        >>> recomputing(observed=False)
        >>> _default(torch.ones(2))["shape"]
        torch.Size([2])
    """
    state = _CURRENT.get()
    if state is not _NONE and not state.comparing:
        state.fast = False
    else:
        _CURRENT.set(_Call(None, None, comparing=True) if observed else _PLAIN)


def recomputed_tensor(value: object) -> torch.Tensor | None:
    """The recomputed tensor whose extractor value ``value`` is, where torch compares it with what an observer kept at
    the forward (the saved value's ``__ne__`` gets ``value``); ``None`` for a value from elsewhere, or for a tensor
    freed since.

    Args:
        value: What the extractor gave for a recomputed tensor.

    Example::

        >>> recomputed_tensor({"shape": torch.Size([2])}) is None
        True
    """
    state = _CURRENT.get()
    if state.comparing and state.value is value:
        return state.tensor()
    if isinstance(value, Recomputed):
        return value()
    return None


class Recomputed(weakref.ref):  # type: ignore[type-arg]
    """What the extractor gives for a recomputed tensor where a backward runs inside a region call's forward (or no
    recomputation said whose tensors torch compares): a weak reference to it, called to get it, for the comparison
    torch runs at once.

    What an observer kept at the forward compares itself with it (torch puts the saved value on the left of ``!=``);
    torch's own metadata, kept where no observer watched the forward, compares here. It holds the tensor weakly:
    torch keeps the extractor's value of a tensor packed in a region's forward while a backward runs inside it
    (``autograd.grad(..., create_graph=True)``), and a strong reference there would close a cycle through autograd's
    C++ nodes (frame, tensor, its ``grad_fn``, the saved holder, the hook, the frame) that Python's collector cannot
    break. At a real comparison the recomputed tensor is alive, held by torch's frame. A weak reference itself, so
    that making one per recomputed tensor costs one allocation.

    Args:
        tensor: The recomputed tensor.

    Example::

        >>> kept = {"shape": torch.Size([2]), "dtype": torch.float32, "device": torch.device("cpu")}
        >>> recomputed = torch.ones(2)
        >>> Recomputed(recomputed) != kept, Recomputed(recomputed)() is recomputed
        (False, True)
    """

    __slots__ = ()

    def __ne__(self, other: object) -> bool:
        tensor = self()
        if other is None or tensor is None:
            return False
        if type(other) is dict:  # torch's metadata, kept where no observer watched: compared field by field
            return other["shape"] != tensor.shape or other["dtype"] != tensor.dtype or other["device"] != tensor.device
        return _metadata(tensor) != other

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        tensor = self()
        return repr(_metadata(tensor)) if tensor is not None else "<freed>"


def _metadata(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device}


def kept_by_torch(tensor: torch.Tensor, *, strict: bool) -> Any:
    """What the package's ``determinism_check`` keeps of a saved tensor that no observer watches: torch's own
    metadata, or nothing where the region's ``determinism_check`` is ``"none"``.

    Args:
        tensor: A tensor a region's forward saves.
        strict: Whether the region's ``determinism_check`` is ``"default"``.

    Example::

        >>> kept_by_torch(torch.ones(2), strict=False) is None
        True
    """
    return _metadata(tensor) if strict else None


def _extractor(strict: bool) -> Callable[[torch.Tensor], Any]:
    """The extractor torch calls for each saved tensor of a region whose ``determinism_check`` is ``"default"``
    (``strict``) or ``"none"``, and for each recomputed one at the comparison.

    What a call does with its tensors was decided when it started, so a tensor no observer reads costs a context
    lookup, a count and a branch more than torch's own extractor at the forward, and a context lookup more at the
    comparison of a call no observer watched. Learning calls, and a call whose forward ran a backward (whose
    comparisons reach the extractor while the call is current), ask torch which backward runs (:func:`_asked`).
    """
    get, ref, task, plain = _CURRENT.get, weakref.ref, current_graph_task_id, _PLAIN

    def extract(tensor: torch.Tensor) -> Any:
        # torch's metadata is written out here rather than taken from `kept_by_torch`: a call per saved tensor is
        # what this path is measured to save.
        call = get()
        if call is plain:
            return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device} if strict else None
        if call.fast:
            position = call.packs
            call.packs = position + 1
            if call.extract is None or position not in call.positions:
                return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device} if strict else None
            return call.extract(tensor, position, strict)
        if call.comparing and task() != -1:  # after a recomputation an observer watched
            value = {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device} if strict else None
            call.value = value
            call.tensor = ref(tensor)
            return value
        return _asked(call, tensor, strict)

    return extract


def _asked(call: _Call, tensor: torch.Tensor, strict: bool) -> Any:
    """The extractor's value of ``tensor`` where the call must ask torch which backward runs: a pack of the call whose
    forward runs (handed to its probe), or a comparison after a recomputation."""
    if call is not _NONE and not call.comparing and call.task == current_graph_task_id():
        call.fast = call.probe is None  # no backward runs inside the forward now
        position = call.packs
        call.packs = position + 1
        if call.probe is not None:
            call.probe.packed(tensor)
        if call.extract is not None and position in call.positions:
            return call.extract(tensor, position, strict)
    elif current_graph_task_id() != -1:  # a comparison after a recomputation: the kept value compares with it
        return Recomputed(tensor)
    return kept_by_torch(tensor, strict=strict)


_default = _extractor(strict=True)
_none = _extractor(strict=False)

DETERMINISM_CHECKS = {"default": "lightning_ckpt_determinism", "none": "lightning_ckpt_determinism_none"}
"""The name a region passes to torch for each ``CheckpointingConfig.determinism_check``."""


def register_determinism_checks() -> None:
    """Register the package's two ``determinism_check`` names in torch's registry, once: the first region wrapped (or
    loaded) does it, never the import. torch has no public way to add a name yet (see
    :func:`~lightning_ckpt_determinism._torch_compat.determinism_checks`).

    Example::

        >>> register_determinism_checks()
        >>> DETERMINISM_CHECKS["default"] in determinism_checks()
        True
    """
    registry = determinism_checks()
    if registry.get(DETERMINISM_CHECKS["default"]) is not _default:
        registry.update({DETERMINISM_CHECKS["default"]: _default, DETERMINISM_CHECKS["none"]: _none})
