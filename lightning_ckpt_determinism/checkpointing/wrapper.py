"""The region wrapper: a module's forward run under non-reentrant activation checkpointing, in place.

Wrapping sets an instance-level ``forward`` on each selected module, so the module object, its parameters, its
buffers and every ``state_dict`` key stay exactly as they were. Recomputation composes up to five contexts:
host-RNG replay, buffer protection, the selective-op policy, the guard that keeps data-dependent outputs (routing)
from the forward and, while one is registered with :func:`observing`, an observer's. Each recompute context can be
entered any number of times (a gradient penalty or ``retain_graph=True`` recomputes a region once per backward), and
each entry replays the same state. A region that needs only the selective-op policy gets torch's own pair of
dispatch modes. The guard (:mod:`~lightning_ckpt_determinism.checkpointing.routing`) is on at a region's first
checkpointed forward and stays on only where that forward ran a data-dependent op: a region without routing pays
nothing.

The traced path (under ``torch.compile``) reads only state dynamo can guard on (an attribute of the process-wide
switch, :mod:`~lightning_ckpt_determinism.checkpointing.switch`, never a ContextVar), never passes
``noop_context_fn`` (dynamo fails on it), and passes a ``context_fn`` only when a region has ``save_ops``, eager-only
options or ``keep_data_dependent``: see :mod:`~lightning_ckpt_determinism.checkpointing.compiled`. Every region
passes the package's own ``determinism_check`` name (:mod:`~lightning_ckpt_determinism.checkpointing.saved`).
"""

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt_determinism._torch_compat import checkpoint_debug_enabled
from lightning_ckpt_determinism.checkpointing.compiled import RecompileLimitFilter, region_contexts
from lightning_ckpt_determinism.checkpointing.contexts import (
    BufferSlot,
    ContextFactory,
    ForwardState,
    HostRNGReplay,
    Reenterable,
    same_context,
)
from lightning_ckpt_determinism.checkpointing.kv_cache import CacheSwitch, is_transformers_layer, without_cache
from lightning_ckpt_determinism.checkpointing.modules import buffer_slots, named_modules
from lightning_ckpt_determinism.checkpointing.nesting import (
    NestedCheckpoint,
    checkpoint_around,
    checkpoints_inside,
    warn_nested,
)
from lightning_ckpt_determinism.checkpointing.profile import FirstForwardProbe, RegionProfile
from lightning_ckpt_determinism.checkpointing.routing import KeptOutputs, mark_region_inputs
from lightning_ckpt_determinism.checkpointing.saved import DETERMINISM_CHECKS, Probing, probing_now
from lightning_ckpt_determinism.checkpointing.switch import _SWITCH
from lightning_ckpt_determinism.config import CheckpointingConfig, resolve_ops

__all__ = [
    "CheckpointedForward",
    "RegionCall",
    "RegionObserver",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "is_checkpointed",
    "observing",
    "remove_activation_checkpointing",
    "run_plainly",
]

_log = logging.getLogger(__name__)

_ContextPair = tuple[AbstractContextManager[Any], AbstractContextManager[Any]]


@dataclass(frozen=True)
class RegionCall:
    """One eager call of a checkpointed region, as an observer sees it.

    Attributes:
        region: The region's name.
        module: The checkpointed module.
        inputs: The tensors and values torch saves as the region's inputs.
        data_dependent: The call's log of data-dependent ops, filled during the forward (which ran, and whether
            each was kept).
    """

    region: str
    module: nn.Module
    inputs: tuple[Any, ...]
    data_dependent: KeptOutputs


class RegionObserver(Protocol):
    """What :func:`observing` plugs into every checkpointed region that runs eagerly.

    ``contexts`` is called at each checkpointed call and returns two factories: one context for the forward, and one
    for each recomputation (there can be several, e.g. under a gradient penalty). Their dispatch modes sit above
    every other context of the region and see every op.
    """

    def contexts(self, call: RegionCall) -> tuple[ContextFactory, ContextFactory]: ...


# One object per distinct config while regions hold it, so that identical blocks share compiled code whether they
# were given one config object or equal ones (compiled graphs guard on the config's identity).
_shared_configs: "weakref.WeakValueDictionary[CheckpointingConfig, CheckpointingConfig]" = weakref.WeakValueDictionary()


@contextlib.contextmanager
def checkpointing_disabled() -> Iterator[None]:
    """Run every checkpointed module with its plain forward (nothing is recomputed) inside this block.

    The recomputation check uses it for its reference pass. It nests and is restored whatever is raised. A
    compiled model compiles one more graph the first time it runs inside this block, and reuses both afterwards.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> apply_activation_checkpointing(model, CheckpointingConfig(classes=["Linear"]))
        ['0']
        >>> with checkpointing_disabled():
        ...     loss = model(torch.ones(1, 2)).sum()
    """
    _SWITCH.depth += 1
    _SWITCH.disabled = True
    try:
        yield
    finally:
        _SWITCH.depth -= 1
        _SWITCH.disabled = _SWITCH.depth > 0


@contextlib.contextmanager
def run_plainly(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the given checkpointed modules with their plain forward inside this block; the others stay checkpointed.

    Args:
        modules: Checkpointed modules; others are ignored.
    """
    wrappers = [module.__dict__["forward"] for module in modules if is_checkpointed(module)]
    for wrapper in wrappers:
        wrapper.plain_depth += 1
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.plain_depth -= 1


@contextlib.contextmanager
def observing(observer: RegionObserver) -> Iterator[None]:
    """Plug ``observer`` into every checkpointed region that runs eagerly inside this block (one at a time).

    Args:
        observer: Gives each call's forward and recompute contexts.
    """
    previous = _SWITCH.observer
    _SWITCH.observer = observer
    try:
        yield
    finally:
        _SWITCH.observer = previous


class CheckpointedForward:
    """The instance-level ``forward`` of a checkpointed module.

    Args:
        module: The module.
        region: Its name in reports.
        config: How to checkpoint it.
    """

    def __init__(self, module: nn.Module, region: str, config: CheckpointingConfig) -> None:
        self.module = module
        self.region = region
        self.config = _shared_configs.setdefault(config, config)
        self.previous_forward: Callable[..., Any] | None = module.__dict__.get("forward")
        self._save_ops = frozenset(resolve_ops(config.save_ops))
        # An instance attribute rather than a context variable: `torch.compile` can guard on it.
        self.plain_depth = 0
        # Whether a data-dependent op ran in the region's first checkpointed forward (None: none has finished yet).
        # Eager calls guard the region while it is None or True, so that the first forward is already guarded.
        self.data_dependent: bool | None = None
        # The eager call whose forward runs now, which takes the size rule's limit from the region's inputs.
        self._forward_kept: KeptOutputs | None = None
        # The transformers caches turned off while this region exists (see `kv_cache`).
        self.cache_switches: list[CacheSwitch] = []
        # A transformers layer runs without its key-value cache in training (see `kv_cache`); other modules keep
        # their keyword arguments.
        self._drops_cache = is_transformers_layer(module)
        # Whether the first eager forward has looked for another checkpointing around and inside (see `nesting`).
        self._probed = False
        # What the region's first eager checkpointed forward showed (see `profile`); None until it has run.
        self.profile: RegionProfile | None = None
        # The region's buffers, worked out once: a compiled call guards on what it reads here.
        self._buffer_slots: list[BufferSlot] = [
            (name, owner, key) for name, (owner, key, _) in buffer_slots(module).items()
        ]

    def __getstate__(self) -> dict[str, Any]:
        # Op overloads do not pickle (their pybind function records cannot), so a wrapped model with `save_ops`
        # could not be pickled or `torch.save`d; they are resolved again from the config on load.
        state = self.__dict__.copy()
        del state["_save_ops"]
        # Learned again after loading: it holds generators and module references of this process.
        state["profile"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.config = _shared_configs.setdefault(self.config, self.config)
        self._save_ops = frozenset(resolve_ops(self.config.save_ops))

    def plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, not checkpointed."""
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and self._drops_cache and self.module.training and torch.is_grad_enabled():
            # Also with checkpointing off, so that a check's reference pass runs the same forward.
            kwargs = without_cache(type(self.module).__name__, kwargs)
        if _SWITCH.disabled or self.plain_depth or not torch.is_grad_enabled():
            return self.plain_forward(*args, **kwargs)
        keys = tuple(kwargs)
        num_positional = len(args)
        # Dynamo reads `is_compiling()` as a constant. A traced call whose region dynamo cannot trace (it
        # graph-breaks inside) has torch run the region eagerly, with the traced call's `context_fn`, which holds
        # nothing of this region: `run` then enters the region's eager contexts itself.
        traced = torch.compiler.is_compiling()
        # The contexts `run` enters itself: those of a region dynamo could not trace, and every region's under
        # torch's checkpoint debug mode, which refuses a `context_fn`.
        in_run: tuple[AbstractContextManager[Any], AbstractContextManager[Any]] | None = None
        calls = 0
        probe = not traced and not self._probed
        if probe:
            self._probed = True
            around = checkpoint_around(sys._getframe(), _REGION_CALL)
            if around is not None:
                warn_nested(type(self.module).__name__, around, inside=False)
        learning = not traced and self.profile is None

        def run(*flat: Any) -> Any:
            nonlocal in_run, calls
            if torch.compiler.is_compiling():
                if self.config.keep_data_dependent:
                    flat = mark_region_inputs(flat)
                return self._forward_from(flat, num_positional, keys)
            # The first call is the forward, each later one a recomputation.
            forward = calls == 0
            calls += 1
            region: AbstractContextManager[Any] = contextlib.nullcontext()
            if traced and in_run is None:
                in_run = self._make_contexts(_SWITCH.observer, self._protects_buffers(), flat)
            if in_run is not None:
                region = in_run[0] if forward else in_run[1]
            watched = self._watched(forward)
            nested: AbstractContextManager[list[NestedCheckpoint]] = (
                checkpoints_inside(_REGION_CALL) if forward and probe else contextlib.nullcontext([])
            )
            first = FirstForwardProbe(self.module) if forward and learning else None
            probing = Probing(first) if first is not None or probing_now() else contextlib.nullcontext()
            with region, watched, nested as inside:
                with probing, first if first is not None else contextlib.nullcontext():
                    out = self._forward_from(flat, num_positional, keys)
                if first is not None and first.profile is not None and self.profile is None:
                    # Before the sentinel's forward ends, which reads it.
                    self.profile = first.profile
            if inside:
                warn_nested(type(self.module).__name__, inside[0], inside=True)
            return out

        # Keyword tensors travel as positional inputs so torch sees their devices when it stashes RNG state.
        inputs = (*args, *kwargs.values())
        options: dict[str, Any] = {}
        # A traced call never reaches the eager choice, which reads the observer.
        context_fn = self._compiled_context_fn() if traced else self._context_fn(inputs)
        if context_fn is not None and not traced and checkpoint_debug_enabled():
            in_run, context_fn = context_fn(), None
        if context_fn is not None:
            # Only when there is one: torch's default is taken by leaving the argument out.
            options["context_fn"] = context_fn
        if learning or (not traced and self.profile is not None and self.profile.filled_late):
            # The first call, and regions holding a saved tensor filled after it was saved, recompute to the end,
            # so that the op filling it runs again (a global `set_checkpoint_early_stop(True)` overrides this).
            options["early_stop"] = False
        return checkpoint(
            run,
            *inputs,
            use_reentrant=False,
            preserve_rng_state=self.config.preserve_rng_state,
            determinism_check=DETERMINISM_CHECKS[self.config.determinism_check],
            **options,
        )

    def _watched(self, forward: bool) -> AbstractContextManager[Any]:
        """The saved-tensor observer's context around this call's forward or one of its recomputations."""
        saved = _SWITCH.saved_observer
        if saved is None:
            return contextlib.nullcontext()
        if forward:
            return saved.region_forward(self.region, self.module)  # type: ignore[no-any-return]
        return saved.region_recompute(self.region, self.module, self._exposed_buffers())  # type: ignore[no-any-return]

    def _forward_from(self, flat: tuple[Any, ...], num_positional: int, keys: tuple[str, ...]) -> Any:
        """The plain forward of the region's flattened inputs; an eager forward first gives the data-dependent
        guard its size limit."""
        if self._forward_kept is not None and not torch.compiler.is_compiling():
            self._forward_kept.note_inputs(flat)
            self._forward_kept = None
        return self.plain_forward(*flat[:num_positional], **dict(zip(keys, flat[num_positional:], strict=True)))

    def _protects_buffers(self) -> bool:
        # A region without buffers has nothing to protect: skipping the context saves its cost on every call.
        return self.config.protect_buffers and bool(self._buffer_slots)

    def _exposed_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers whose live values a recomputation could change: every one without ``protect_buffers``, else
        those no forward was seen to change (which recomputation gets as they are)."""
        replayed: frozenset[str] = frozenset()
        if self.config.protect_buffers:
            if self.profile is None:
                return []
            replayed = self.profile.buffers
        buffers = ((name, owner._buffers.get(key)) for name, owner, key in self._buffer_slots)
        return [(name, buffer) for name, buffer in buffers if buffer is not None and name not in replayed]

    def _replays_state(self, protect_buffers: bool) -> bool:
        """Whether a forward's state must be captured for recomputation (see :class:`ForwardState`)."""
        profile = self.profile
        if profile is None or protect_buffers or profile.attributes:
            return True
        return self.config.preserve_rng_state and bool(profile.generators)

    def _buffer_changed(self, name: str) -> None:
        if self.profile is not None and name not in self.profile.buffers:
            _log.info(
                "lightning_ckpt_determinism: region `%s` changed its buffer `%s` in forward for the first time after"
                " its first call; its recomputation replays it from the next forward on.",
                self.region,
                name,
            )
            self.profile = replace(self.profile, buffers=self.profile.buffers | {name})

    def _compiled_context_fn(self) -> Callable[[], _ContextPair] | None:
        """The ``context_fn`` of a call dynamo traces (see :func:`region_contexts`), or ``None`` when it needs none."""
        # Read from the module, not from the slots the wrapper keeps: dynamo then guards on the module's structure,
        # so regions of other classes compile apart (one that graph-breaks never lends its partial graph to others).
        protect_buffers = self.config.protect_buffers and next(self.module.buffers(), None) is not None
        if self.config.keep_data_dependent or self.config.preserve_host_rng or protect_buffers or self._save_ops:
            # The policy runs only while the compiler traces the region: it costs nothing per step, so every region
            # gets it, and it finds the data-dependent ops itself.
            return partial(region_contexts, self.config, protect_buffers)
        return None

    def _context_fn(self, inputs: tuple[Any, ...]) -> Callable[[], _ContextPair] | None:
        observer = _SWITCH.observer
        protect_buffers = self._protects_buffers()
        if (
            self.config.preserve_host_rng
            or observer is not None
            or self._guarded()
            or self._replays_state(protect_buffers)
        ):
            return partial(self._make_contexts, observer, protect_buffers, inputs)
        if self._save_ops:
            # The pair of dispatch modes alone, as torch builds it: the form `torch.compile` accepts.
            return partial(create_selective_checkpoint_contexts, self._save_ops_policy)
        return None

    def _save_ops_policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self._save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def _guarded(self) -> bool:
        """Whether an eager call keeps data-dependent outputs: until the first forward showed the region has none."""
        return self.config.keep_data_dependent and self.data_dependent is not False

    def _found_data_dependent(self, found: bool) -> None:
        # A later forward that shows routing (one observed by a check) turns a dropped guard back on.
        if found or self.data_dependent is None:
            self.data_dependent = found

    def _enter_forward(self, kept: KeptOutputs) -> AbstractContextManager[Any]:
        self._forward_kept = kept
        return kept.forward()

    def _make_contexts(
        self, observer: RegionObserver | None, protect_buffers: bool, inputs: tuple[Any, ...]
    ) -> tuple[Reenterable, Reenterable]:
        forward: list[ContextFactory] = []
        recompute: list[ContextFactory] = []
        if self.config.preserve_host_rng:
            replay = HostRNGReplay()
            forward.append(replay.capture)
            recompute.append(replay.replay)
        if self._replays_state(protect_buffers):
            state = ForwardState(
                self.module,
                self.profile,
                self._buffer_slots if protect_buffers else (),
                generators=self.config.preserve_rng_state,
                changed=self._buffer_changed,
            )
            forward.append(state.capture)
            recompute.append(state.replay)
        if self._save_ops:
            sac_forward, sac_recompute = create_selective_checkpoint_contexts(self._save_ops_policy)
            forward.append(partial(same_context, sac_forward))
            recompute.append(partial(same_context, sac_recompute))
        guarded = self._guarded()
        kept = KeptOutputs(
            keep=guarded,
            save_ops=self._save_ops,
            on_forward=self._found_data_dependent,
            dropped=self.config.keep_data_dependent and not guarded,
        )
        if guarded or observer is not None:
            # Above selective checkpointing, whose cache serves `save_ops`: the union of both is kept. Without the
            # guard it only logs, for the observer, which data-dependent ops run.
            forward.append(partial(self._enter_forward, kept))
            if guarded:
                recompute.append(kept.recompute)
        if observer is not None:
            # Last, so its dispatch mode sits on top of the selective-checkpointing one and of the guard and sees
            # every op, including those whose outputs they serve from their caches.
            observe_forward, observe_recompute = observer.contexts(RegionCall(self.region, self.module, inputs, kept))
            forward.append(observe_forward)
            recompute.append(observe_recompute)
        return Reenterable(forward), Reenterable(recompute)


_REGION_CALL = CheckpointedForward.__call__.__code__


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` itself is checkpointed by this package.

    Example::

        >>> is_checkpointed(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def checkpointed_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The checkpointed submodules of ``module`` by name (``module`` itself included, under ``""``).

    Names leave out the ``_orig_mod`` of ``torch.compile`` wrappers, as configs write them.

    Args:
        module: The root module.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> list(checkpointed_modules(model))
        ['1']
    """
    return {name: sub for name, sub in named_modules(module) if is_checkpointed(sub)}


def checkpoint_module(module: nn.Module, region: str, config: CheckpointingConfig) -> None:
    """Checkpoint ``module`` itself (not a selection of its submodules); nothing happens if it already is.

    ``config``'s selection fields are ignored; its other fields say how to checkpoint.

    Args:
        module: The module to checkpoint.
        region: The name reports use for it, usually its name in the model.
        config: How to checkpoint it.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> layer = torch.nn.Linear(2, 2)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"]))
        >>> list(checkpointed_modules(layer))
        ['']
    """
    if not is_checkpointed(module):
        module.forward = CheckpointedForward(module, region, config)  # type: ignore[method-assign]
        RecompileLimitFilter(__file__, CheckpointedForward.__name__).install()


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`~lightning_ckpt_determinism.apply_activation_checkpointing` on ``module`` and its submodules.

    Args:
        module: The root module.

    Returns:
        The names of the modules that were checkpointed.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Linear"]))
        >>> remove_activation_checkpointing(model)
        ['0']
        >>> checkpointed_modules(model)
        {}
    """
    removed = []
    for name, sub in named_modules(module):
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward):
            for switch in wrapper.cache_switches:
                switch.release()
            wrapper.cache_switches = []
            if wrapper.previous_forward is None:
                del sub.forward
            else:
                sub.forward = wrapper.previous_forward  # type: ignore[method-assign]
            removed.append(name)
    return removed
