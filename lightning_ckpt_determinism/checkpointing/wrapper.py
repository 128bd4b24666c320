"""The region wrapper: a module's forward run under non-reentrant activation checkpointing, in place.

Wrapping sets an instance-level ``forward`` on each selected module, so the module object, its parameters, its
buffers and every ``state_dict`` key stay exactly as they were. Which contexts a region's recomputation composes is
decided once, by its :class:`~lightning_ckpt_determinism.checkpointing.region_plan.RegionPlan`: host-RNG replay, the
forward's state (buffers, attributes, generators), the selective-op policy, the guard that keeps data-dependent
outputs (routing) from the forward, and the observers registered on the region's model (:func:`observing`,
:func:`observing_saved_tensors`), which plug in as contexts of the same call. Each recompute context can be
entered any number of times (a gradient penalty or ``retain_graph=True`` recomputes a region once per backward), and
each entry replays the same state. A region that needs only the selective-op policy gets torch's own pair of
dispatch modes. The guard (:mod:`~lightning_ckpt_determinism.checkpointing.routing`) is on at a region's first
checkpointed forward and stays on only where that forward ran a data-dependent op: a region without routing pays
nothing.

What a region learns from its calls (:mod:`~lightning_ckpt_determinism.checkpointing.profile`) is kept by key: each call
reads the ``training`` flags of the region's modules and how many attributes each holds, checks that the generators it
replays are still in place, and after its forward that it took its profile's path (as many saved tensors and autograd
nodes, its output from the same op); a call unlike those learned from is probed, or recomputed to its end and learned
from at the next call. A call whose saved tensors include one filled late is recomputed to its end by an end marker: one
more tensor saved after the forward, whose holder dies at once, so that torch's early stop (which ends a recomputation
once it has saved as many tensors as the forward) stops only after the region's last op. Every other call keeps torch's
early stop, as a hand-written checkpoint does, also a learning one (a recomputation that saves more tensors than its
forward trains as under torch). The attributes each forward rebinds are found at that call and put back for its
recomputation (:class:`~lightning_ckpt_determinism.checkpointing.contexts.AttributeReplay`).

The traced path (under ``torch.compile``) reads only state dynamo can guard on (the plan, and the one process-wide
switch, :mod:`~lightning_ckpt_determinism.checkpointing.switch`, never a ContextVar), never passes
``noop_context_fn`` (dynamo fails on it), and passes a ``context_fn`` only when a region has ``save_ops``, eager-only
options or ``keep_data_dependent``: see :mod:`~lightning_ckpt_determinism.checkpointing.compile_context`. A traced
call, and an eager call a probe learns from or an observer reads, passes the package's own ``determinism_check``
name (:mod:`~lightning_ckpt_determinism.checkpointing.determinism_check`); any other eager call passes torch's, and
torch's frame counts what it saves.
"""

import collections
import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt_determinism._library_compat import reads_cache_only
from lightning_ckpt_determinism._torch_compat import (
    KeptOutputsServedAgain,
    autograd_nodes_made,
    checkpoint_debug_enabled,
    checkpoint_saved_counter,
    child_modules,
    disable_current_modes,
    is_kept_output_mutation,
    own_buffers,
    saved_tensors_hooks_enabled,
)
from lightning_ckpt_determinism.checkpointing.compile_context import RecompileLimitFilter
from lightning_ckpt_determinism.checkpointing.contexts import (
    KEPT_BUFFER_BYTES,
    NO_CONTEXT,
    AttributeReplay,
    BufferStarts,
    ContextFactory,
    ForwardState,
    HostRNGReplay,
    Reenterable,
    TrainingModes,
    default_dtype,
    put_back_always,
    same_context,
    training_flags,
    values_kept,
)
from lightning_ckpt_determinism.checkpointing.determinism_check import (
    DETERMINISM_CHECKS,
    InRegionCall,
    SavedTensorObserver,
    recomputing,
    register_determinism_checks,
)
from lightning_ckpt_determinism.checkpointing.framework_ops import FrameworkOps
from lightning_ckpt_determinism.checkpointing.kv_cache import (
    CacheParameters,
    CacheSwitch,
    is_transformers_layer,
    restored_switch,
)
from lightning_ckpt_determinism.checkpointing.modules import buffer_slots, named_modules
from lightning_ckpt_determinism.checkpointing.nesting import probing_for_nesting
from lightning_ckpt_determinism.checkpointing.profile import FirstForwardProbe, RegionProfile
from lightning_ckpt_determinism.checkpointing.region_plan import RegionPlan
from lightning_ckpt_determinism.checkpointing.registered_buffers import (
    RegisteredBuffer,
    buffer_count,
    buffers_left_out,
    registered_since,
)
from lightning_ckpt_determinism.checkpointing.rng import held_host_generators
from lightning_ckpt_determinism.checkpointing.routing import KeptOutputs, mark_region_inputs
from lightning_ckpt_determinism.checkpointing.switch import _SWITCH
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    CheckpointingTypeError,
    LightningCkptDeterminismWarning,
)

__all__ = [
    "KEPT_OUTPUT_WRITTEN_HINT",
    "CheckpointedForward",
    "RegionCall",
    "buffers_read_otherwise",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_config",
    "checkpointing_disabled",
    "is_checkpointed",
    "keep_op_calls",
    "observing",
    "observing_saved_tensors",
    "recomputations",
    "recomputations_by_region",
    "remove_activation_checkpointing",
    "replays_torch_rng",
    "routes",
    "run_plainly",
    "tracing_noted",
]

_log = logging.getLogger(__name__)

_ContextPair = tuple[AbstractContextManager[Any], AbstractContextManager[Any]]

# A call's key: the `training` flag of each of the region's modules, and how many attributes each holds.
_CallKey = tuple[tuple[bool, ...], tuple[int, ...]]

# A call's path: how many tensors its forward saved, how many autograd nodes it made, and the type of the node its
# output came from (the op it ended in).
_Path = tuple[int, int, type | None]

# How many profiles a region keeps (train and eval, a few code paths); the oldest goes first.
_PROFILES = 8

# How many calls in a row probe for a code path seen without a profile while they take other paths, at first (a branch
# taken every other call is learned at the next call that takes it); halved each time a key gives up on a path.
_PROBES_FOR_A_PATH = 8
# How many positions in a pass a region awaits a path at, at most (see `CheckpointedForward._await_at`).
_AWAITED = 64


@dataclass(frozen=True)
class RegionCall:
    """One eager call of a checkpointed region, as an observer sees it.

    Attributes:
        region: The region's name.
        module: The checkpointed module.
        inputs: The tensors and values torch saves as the region's inputs.
        data_dependent: The call's log of data-dependent ops, filled during the forward (which ran, and whether
            each was kept).
        protects_buffers: Whether the region puts its buffers back around each recomputation (``protect_buffers``):
            what is written to them between its forward and a recomputation is then no write of the recomputation.
        exposed_buffers: The buffers whose live values the call's recomputations could change (none it puts back:
            with ``protect_buffers``, the larger ones no forward was seen to change).
        recomputed_from: The arguments the recomputation of the call under way started from, appended as it starts
            and emptied as it ends (saved tensors come back through the saved-tensor hooks around the forward, which
            may give other values).
        replays_rng: Whether the region replays torch's generators in recomputation (``preserve_rng_state``).
    """

    region: str
    module: nn.Module
    inputs: tuple[Any, ...]
    data_dependent: KeptOutputs
    protects_buffers: bool = True
    exposed_buffers: frozenset[str] = frozenset()
    recomputed_from: list[tuple[Any, ...]] = field(default_factory=list)
    replays_rng: bool = True


class RegionObserver(Protocol):
    """What :func:`observing` plugs into one model's checkpointed regions that run eagerly.

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
    It is process-wide, for one training thread (the thread contract of
    :mod:`~lightning_ckpt_determinism.checkpointing.switch`): a region another thread runs meanwhile runs plainly too.

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
def observing(observer: RegionObserver, module: nn.Module) -> Iterator[None]:
    """Plug ``observer`` into the checkpointed regions of ``module`` that run eagerly inside this block.

    It registers on ``module``'s own regions only: another model's regions, even with the same names, are never
    seen. Blocks nest; each region has one observer at a time, the innermost.

    Args:
        observer: Gives each call's forward and recompute contexts.
        module: The model whose regions to observe.
    """
    with _registered(module, "region_observer", observer):
        yield


@contextlib.contextmanager
def observing_saved_tensors(
    observer: SavedTensorObserver, module: nn.Module, *, unwatched_only: bool = False
) -> Iterator[None]:
    """Give ``observer`` every tensor the eagerly checkpointed regions of ``module`` save inside this block.

    It registers on ``module``'s own regions only: another model's regions, even with the same names, are never
    seen. Blocks nest; each region has one observer at a time, the innermost.

    Args:
        observer: What keeps and compares the saved tensors.
        module: The model whose checkpointed regions to observe.
        unwatched_only: Register only on the regions no observer that reads the calls starting now is registered on
            (one paused is replaced for the block): an observer of the caller's keeps what it watches.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Tanh"]))
        >>> with observing_saved_tensors(object(), model):  # type: ignore[arg-type]
        ...     model[1].forward.saved_observer is not None
        True
        >>> model[1].forward.saved_observer is None
        True
    """
    skip = CheckpointedForward.saved_tensors_watched if unwatched_only else None
    with _registered(module, "saved_observer", observer, skip=skip):
        yield


@contextlib.contextmanager
def _registered(
    module: nn.Module, slot: str, observer: Any, *, skip: "Callable[[CheckpointedForward], bool] | None" = None
) -> Iterator[None]:
    """Set ``slot`` of each region wrapper of ``module`` (but those ``skip`` names) to ``observer`` inside this block,
    then put back each one's."""
    wrappers = [sub.__dict__["forward"] for sub in checkpointed_modules(module).values()]
    wrappers = [wrapper for wrapper in wrappers if skip is None or not skip(wrapper)]
    previous = [getattr(wrapper, slot) for wrapper in wrappers]
    for wrapper in wrappers:
        setattr(wrapper, slot, observer)
    try:
        yield
    finally:
        for wrapper, before in zip(wrappers, previous, strict=True):
            setattr(wrapper, slot, before)


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
        self.plan = RegionPlan.of(module, self.config)
        RecompileLimitFilter.serve(self, __file__, CheckpointedForward.__name__)
        # An instance attribute rather than a context variable: `torch.compile` can guard on it.
        self.plain_depth = 0
        # Whether a data-dependent op ran in the region's first checkpointed forward (None: none has finished yet).
        # Eager calls guard the region while it is None or True, so that the first forward is already guarded.
        self.data_dependent: bool | None = None
        # The transformers caches turned off while this region exists (see `kv_cache`).
        self.cache_switches: list[CacheSwitch] = []
        # A transformers layer runs without its key-value cache in training, passed by keyword or by position (see
        # `kv_cache`); other modules keep their arguments. Read from the signature here, never per call.
        self._cache_parameters = (
            CacheParameters.of(
                type(module).__name__,
                module.forward,
                reads_cache_only=reads_cache_only(module),
            )
            if is_transformers_layer(module)
            else None
        )
        # Whether the first eager forward has looked for another checkpointing around and inside (see `nesting`).
        self._probed = False
        # What the region learned about calls like the one under way (or the last one; see `profile`): None before
        # a learning call's forward ends, and after a call whose path matched no profile.
        self.profile: RegionProfile | None = None
        self._found_modules()
        # Profiles by key and path, and each key's path at its last call (expected next).
        self._profiles: dict[tuple[_CallKey, _Path], RegionProfile] = {}
        self._paths: dict[_CallKey, _Path] = {}
        # How many more calls of each key probe for its expected path while it has no profile, and for how many calls
        # each key probes for the next such path (see `_next_path`).
        self._probes_left: dict[_CallKey, int] = {}
        self._probe_budget: dict[_CallKey, int] = {}
        # Where in a pass (the calls between two backwards) a path no profile knew was taken, with how many more
        # passes its call there learns it if it comes (see `_await_at`): an RNN's cell that branches at one timestep
        # takes it at that call of every step, however many calls lie between.
        self._awaited: dict[tuple[_CallKey, int], tuple[_Path, int]] = {}
        self._await_budget: dict[_CallKey, int] = {}
        self._pass_mark = 0
        self._calls_in_pass = 0
        # The generators the profiles replay, where they are held: one replaced makes the region learn again.
        self._generators: tuple[tuple[dict[str, Any], str, torch.Generator], ...] = ()
        # The buffers every profile replays: those any call was seen to change.
        self._replayed: frozenset[str] = frozenset()
        # Copies of the small buffers no call was seen to change, kept from call to call (see `BufferStarts`).
        self._buffer_starts = BufferStarts()
        # The attributes each call watches (see `AttributeReplay`), worked out again when the modules' sizes change.
        self._attribute_slots: tuple[tuple[int, ...], list[tuple[int, str]]] = ((), [])
        # How many tensors the latest eager forward saved, and whether its recomputation runs to the region's end
        # past torch's early stop (the saved-tensor observers read both when that forward ends).
        self.saved = 0
        self.recomputes_to_end = False
        # Whether torch's checkpoint frame could be counted so far: a call no probe learns from and no observer reads
        # then passes torch's own `determinism_check` name, and the frame counts what it saves.
        self._frame_counted = True
        # The observers registered on this region, by `observing` and `observing_saved_tensors` on its model: read
        # only by eager calls, so compiled graphs never guard on them.
        self.region_observer: RegionObserver | None = None
        self.saved_observer: SavedTensorObserver | None = None
        # The op calls whose outputs an eager forward keeps (a `budget_granularity="op"` plan): their overloads by
        # position in the measured call, whose op calls (overloads, in order) each forward follows. Traced calls keep
        # none (the compiled graph holds no per-call policy).
        self.kept_calls: dict[int, str] = {}
        self.measured_calls: tuple[str, ...] = ()
        # Whether a call ran an op the measured call does not run from there on (said once per region).
        self.said_mismatch = False
        # How many eager recomputations the region has run: a check reads whether any ran inside a forward.
        self.recomputations = 0
        # Whether a compiled function ran the region since `tracing_noted` cleared it: its recomputations then run
        # uncounted, in graphs (dynamo replays the store at each compiled call).
        self.traced = False
        # By buffer name, how many calls' recomputations got other values of it than their forward started from or
        # read (see `ForwardState`'s `read_otherwise`): a check names them as its cause.
        self.buffers_read_otherwise: collections.Counter[str] = collections.Counter()
        # How many times the region read its modules again, after one was added, removed or replaced: the sentinel
        # reads its own view of the region's buffers and parameters again when it moves.
        self.modules_read = 0

    def _found_modules(self) -> None:
        """Read the region's modules, as wrapping finds them and again after one was added, removed or replaced."""
        # The region's modules, whose modes and attributes key its profiles, and their children as each call checks.
        self._region_modules = tuple(self.module.modules())
        self._children = child_modules(map(vars, self._region_modules))
        # How many buffers they held when the plan was made: a forward that registers one makes the plan again.
        self._buffer_count = buffer_count(map(vars, self._region_modules))
        # Its lazy modules not initialised yet: their initialisation draws from torch's RNG in the forward alone, so
        # a call that initialises them runs plainly (a recomputation would draw what follows from other numbers).
        self._lazy = tuple(sub for sub in self._region_modules if isinstance(sub, LazyModuleMixin))
        # Where its `nn.RReLU` modules are among them: one in training mode fills its noise after saving it.
        self._rrelu = tuple(at for at, sub in enumerate(self._region_modules) if isinstance(sub, nn.RReLU))

    def _modules_changed(self) -> tuple[dict[str, Any], ...]:
        """A submodule was added to the region, removed from it or replaced since its last call (an adapter or a
        quantized layer swapped in after wrapping): its plan, what it learned and the copies it kept are of the old
        modules. Read them again, as wrapping does, and learn again at the next call. Returns the modules' ``vars``."""
        _log.info(
            "lightning_ckpt_determinism: region `%s` holds other submodules than at its last call; it learns them"
            " again.",
            self.region,
        )
        self._found_modules()
        self.modules_read += 1
        self.plan = RegionPlan.of(self.module, self.config)
        self._profiles.clear()
        self._generators, self._replayed, self._buffer_starts = (), frozenset(), BufferStarts()
        self._attribute_slots = ((), [])
        self._probed = False  # a new module may hold a checkpoint call of its own (see `nesting`)
        self.data_dependent = None  # a new module may route: guarded until a call shows whether it does
        return tuple(map(vars, self._region_modules))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Learned again after loading: it holds generators and module references of this process.
        state["profile"] = None
        state["_profiles"], state["_paths"], state["_generators"], state["_replayed"] = {}, {}, (), frozenset()
        state["_probes_left"], state["_probe_budget"], state["_buffer_starts"] = {}, {}, BufferStarts()
        state["_awaited"], state["_await_budget"] = {}, {}
        state["region_observer"] = state["saved_observer"] = None
        state["plain_depth"] = 0  # a copy made under `run_plainly` is checkpointed, as the original is after it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        register_determinism_checks()  # a region loaded in a fresh process
        self.__dict__.update(state)
        self.config = _shared_configs.setdefault(self.config, self.config)
        self.plan = replace(self.plan, config=self.config)
        RecompileLimitFilter.serve(self, __file__, CheckpointedForward.__name__)
        # Restored without holders (see `CacheSwitch.__getstate__`); a copy sharing its config joins the live switch.
        self.cache_switches = [restored_switch(switch) for switch in self.cache_switches]
        for switch in self.cache_switches:
            switch.hold()

    def plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, not checkpointed."""
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._cache_parameters is not None and torch.is_grad_enabled():
            # Also with checkpointing off, so that a check's reference pass runs the same forward; in eval mode too,
            # where a region with grad enabled is checkpointed all the same.
            args, kwargs = self._cache_parameters.without_cache(args, kwargs)
        if _SWITCH.disabled or self.plain_depth or not torch.is_grad_enabled():
            return self.plain_forward(*args, **kwargs)
        # Keyword tensors travel as positional inputs so torch sees their devices when it stashes RNG state.
        inputs = (*args, *kwargs.values()) if kwargs else args
        # Dynamo reads `is_compiling()` as a constant: a traced call never reaches the eager path.
        if torch.compiler.is_compiling():
            self.traced = True
            context_fn = self.plan.compiled_context(next(self.module.buffers(), None) is not None)
            return self._checkpoint(self._traced_run(len(args), tuple(kwargs)), inputs, context_fn)
        attributes = self._current_modules()
        if self._lazy and self._initialises():
            return self.plain_forward(*args, **kwargs)
        return self._eager_call(inputs, len(args), tuple(kwargs), attributes)

    def _current_modules(self) -> tuple[dict[str, Any], ...]:
        """The ``vars`` of the region's modules, read again first where a submodule was added, removed or replaced
        since the last call (see :meth:`_modules_changed`)."""
        attributes = tuple(map(vars, self._region_modules))
        if child_modules(attributes) != self._children:
            return self._modules_changed()
        return attributes

    def _initialises(self) -> bool:
        """Whether this eager call initialises lazy modules of the region (a traced call never asks: a guard on
        :attr:`_lazy` would go stale as eager calls prune it)."""
        # An initialised one has become its plain class (`cls_to_become`), or reports no uninitialised parameter.
        self._lazy = tuple(
            sub
            for sub in self._lazy
            if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params()  # type: ignore[operator]
        )
        return bool(self._lazy)

    def _traced_run(self, num_positional: int, keys: tuple[str, ...]) -> Callable[..., Any]:
        """The function a traced call checkpoints. A region dynamo cannot trace (it graph-breaks inside) has torch run
        it eagerly, with the traced call's ``context_fn``, which holds nothing of this region: it then enters the
        region's eager contexts itself."""
        fallback: list[_EagerCall] = []

        def run(*flat: Any) -> Any:
            if torch.compiler.is_compiling():
                if self.plan.keep_data_dependent:
                    flat = mark_region_inputs(flat)
                return self._forward_from(flat, num_positional, keys)
            if not fallback:
                attributes = self._current_modules()
                replay = AttributeReplay(attributes, AttributeReplay.slots_of(attributes))
                call = _EagerCall(self, num_positional, keys, None, replay, first=False)
                call.contexts = self._make_contexts(flat, call)
                fallback.append(call)
            return fallback[0].run(*flat)

        return run

    def _eager_call(
        self,
        inputs: tuple[Any, ...],
        num_positional: int,
        keys: tuple[str, ...],
        attributes: tuple[dict[str, Any], ...],
    ) -> Any:
        first = not self._probed
        self._probed = True
        sizes = tuple(map(len, attributes))
        buffers = buffer_count(attributes)
        if buffers != self._buffer_count:
            self._buffers_registered(buffers)
        key = (training_flags(self._region_modules), sizes)
        if self._attribute_slots[0] != sizes:
            self._attribute_slots = (sizes, AttributeReplay.slots_of(attributes))
        position = self._position_in_pass()
        awaited = self._awaited.get((key, position))
        # Awaited while still unknown (a probe of the next calls may have learned it since).
        awaiting = awaited is not None and (key, awaited[0]) not in self._profiles
        path = awaited[0] if awaited is not None and awaiting else self._paths.get(key)
        self.profile = None if path is None else self._profiles.get((key, path))
        if self.profile is not None and not self._generators_in_place():
            self._profiles.clear()  # what the profiles replay is stale
            self.profile = None
        replay = AttributeReplay(attributes, self._attribute_slots[1])
        # A call that nothing learns from nor reads keeps torch's own extractor: it costs a hand-written checkpoint's.
        torch_keeps = self.profile is not None and self._watching_observer() is None and self._frame_counted
        call = _EagerCall(
            self,
            num_positional,
            keys,
            None,
            replay,
            first=first,
            key=key,
            position=position,
            awaiting=awaiting,
            torch_keeps=torch_keeps,
        )
        context_fn = self._context_fn(inputs, call)
        if context_fn is not None and checkpoint_debug_enabled():
            # torch's checkpoint debug mode refuses a `context_fn`: the call enters the contexts itself.
            call.contexts, context_fn = context_fn(), None
        return self._checkpoint(call.run, inputs, context_fn, torch_keeps=torch_keeps)

    def forget_paths(self) -> None:
        """Forget the code paths and profiles the region learned: its next call learns again (a plan that keeps other
        op outputs changes what every path saves)."""
        self._paths.clear()
        self._profiles.clear()
        self._awaited.clear()
        self._await_budget.clear()
        self.profile = None

    def _buffers_registered(self, count: int) -> list[RegisteredBuffer]:
        """The region's modules hold ``count`` buffers now, another number than when its plan was made (a buffer
        registered in a forward, sized at its first call): the plan takes them in, and every call learns again which
        buffers it changes, so that the new ones are protected too. Returns those the plan did not know."""
        registered = registered_since(self._region_modules, self.plan.buffer_slots)
        self._buffer_count = count
        self.plan = RegionPlan.of(self.module, self.config)
        self._profiles.clear()
        return registered

    def _generators_in_place(self) -> bool:
        """Whether the modules still hold the generators the profiles replay (none was replaced by a new one)."""
        if not self._generators:
            return True
        return all(held.get(name) is generator for held, name, generator in self._generators)

    def _path_taken(
        self, key: _CallKey, path: _Path, learned: RegionProfile | None, position: int, awaiting: bool
    ) -> bool:
        """A forward of ``key``, the ``position``-th call of its pass, took ``path`` (and a probe ``learned`` its
        profile): the profile of that path becomes the region's :attr:`profile` (``None`` for a path no profile
        knows); whether its recomputation must run to its end (a saved tensor filled late, a path not known on one
        process, or an ``nn.RReLU`` in training mode). A call that probed for a path awaited at its position
        (``awaiting``) and took a known one leaves that one's profile as it was: the conditions at that position
        (a flag set at one timestep) may differ from those it was learned under."""
        if learned is not None and awaiting and (key, path) in self._profiles:
            learned = None
        if learned is not None:
            self._replay_buffers(learned.buffers)
            self._profiles.pop((key, path), None)
            self._profiles[key, path] = replace(learned, buffers=self._replayed, nodes=path[1], ends_in=path[2])
            while len(self._profiles) > _PROFILES:
                del self._profiles[next(iter(self._profiles))]
            self._generators = tuple(
                (vars(owner), name, value)
                for owner in self._region_modules
                for name, value in vars(owner).items()
                if isinstance(value, torch.Generator)
            )
        self.profile = self._profiles.get((key, path))
        self._paths[key] = self._next_path(key, path)
        self._await_at((key, position), path)
        if self.profile is None:
            # A path no profile knows may hold a tensor filled late, so it recomputes to its end; but not across
            # ranks: one rank may take the path alone, and on that rank alone the recomputation would then run the
            # collectives after the region's last saved tensor again (the others stop early), out of step with the
            # others. There it stops as torch's checkpoint does (a module `nn.RReLU` still recomputes to its end).
            if not _across_ranks():
                return True
        elif self.profile.filled_late or self.profile.mode_dependent:
            return True
        # A region holding an `nn.RReLU` in training mode recomputes to its end whatever its profile says: a path that
        # runs it may look like one learned without it (a LayerDrop choosing between like-shaped layers).
        return any(key[0][at] for at in self._rrelu)

    def _next_path(self, key: _CallKey, path: _Path) -> _Path:
        """The path the next call of ``key`` is expected to take, whose profile it starts with: the one this call
        took. A path taken without a profile stays expected instead while the calls probing for it take other paths,
        so that the next call that takes it learns it: a branch taken every other call would otherwise never be
        learned, each probe taking the other, known path. A key probes for such a path :data:`_PROBES_FOR_A_PATH`
        calls at first, half as many after each time it gave up, and at least the one call after it: a region whose
        paths rarely come back (experts without tokens) probes about as often as one that never waits for a path."""
        expected = self._paths.get(key)
        if self.profile is None:
            self._probes_left[key] = self._probe_budget.get(key, _PROBES_FOR_A_PATH)
            return path
        left = self._probes_left.pop(key, 0)
        if expected is None or expected == path or (key, expected) in self._profiles or not left:
            return path
        if left == 1:  # given up: the next path waited for is probed for half as long
            self._probe_budget[key] = max(1, self._probe_budget.get(key, _PROBES_FOR_A_PATH) // 2)
            return path
        self._probes_left[key] = left - 1
        return expected

    def _position_in_pass(self) -> int:
        """How many eager calls of the region came before this one in the pass under way: a pass ends where a
        recomputation of the region ran (its backward)."""
        if self.recomputations != self._pass_mark:
            self._pass_mark, self._calls_in_pass = self.recomputations, 0
        position = self._calls_in_pass
        self._calls_in_pass += 1
        return position

    def _await_at(self, at: tuple[_CallKey, int], path: _Path) -> None:
        """The call at ``at`` (its key, and its position in the pass) took ``path``, known or not (:attr:`profile`).
        A path taken there without a profile is awaited there in the next passes: the call at that position learns
        it, however many calls of other paths lie between (which :meth:`_next_path`'s probes, a few calls long, do
        not reach). A call there that takes another path counts one try; after :data:`_PROBES_FOR_A_PATH` tries at
        first, half as many after each time the key gave up, and at least one, it gives up."""
        awaited = self._awaited.pop(at, None)
        if self.profile is None:
            self._awaited[at] = (path, self._await_budget.get(at[0], _PROBES_FOR_A_PATH))
            while len(self._awaited) > _AWAITED:
                del self._awaited[next(iter(self._awaited))]
            return
        if awaited is None or awaited[0] == path or (at[0], awaited[0]) in self._profiles:
            return
        if awaited[1] > 1:
            self._awaited[at] = (awaited[0], awaited[1] - 1)
        else:
            self._await_budget[at[0]] = max(1, self._await_budget.get(at[0], _PROBES_FOR_A_PATH) // 2)

    def _replay_buffers(self, names: frozenset[str]) -> None:
        """Every profile, and the call under way, replays ``names`` too, with the other buffers of the modules that
        hold them (BatchNorm's kernel updates its running statistics without a version bump, so a later change of
        theirs could not be seen; a momentum of 0 at the first call changes only its counter): what the region
        replays only grows."""
        owners = {owner for name, owner, _ in self.plan.buffer_slots if name in names}
        names = names | {name for name, owner, _ in self.plan.buffer_slots if owner in owners}
        if names <= self._replayed:
            return
        replayed = self._replayed = self._replayed | names
        self._profiles = {at: replace(profile, buffers=replayed) for at, profile in self._profiles.items()}
        if self.profile is not None:
            self.profile = replace(self.profile, buffers=replayed)

    def _checkpoint(
        self,
        run: Callable[..., Any],
        inputs: tuple[Any, ...],
        context_fn: Callable[[], _ContextPair] | None,
        *,
        torch_keeps: bool = False,
    ) -> Any:
        """torch's non-reentrant checkpoint of ``run``; ``context_fn`` only when given, so that torch's default is
        taken by leaving it out; torch's own ``determinism_check`` name where ``torch_keeps``, the package's
        otherwise."""
        options: dict[str, Any] = {}
        if context_fn is not None:
            options["context_fn"] = context_fn
        try:
            return checkpoint(
                run,
                *inputs,
                use_reentrant=False,
                preserve_rng_state=self.config.preserve_rng_state,
                determinism_check=(
                    self.config.determinism_check if torch_keeps else DETERMINISM_CHECKS[self.config.determinism_check]
                ),
                **options,
            )
        except RuntimeError as error:
            if not saved_tensors_hooks_enabled() and hasattr(error, "add_note"):
                error.add_note(self._hooks_disabled_note())
            raise

    def _hooks_disabled_note(self) -> str:
        """The line under torch's error where a region is called with saved-tensor hooks disabled."""
        return (
            f"lightning_ckpt_determinism: the checkpointed {type(self.module).__name__} cannot run here: activation "
            "checkpointing needs saved-tensor hooks, and they are disabled (torch.func's grad, vjp, jacrev and "
            "hessian disable them). Run this call inside `with lightning_ckpt_determinism.checkpointing_disabled():`, "
            "where checkpointed modules run their plain forward."
        )

    def _forward_from(self, flat: tuple[Any, ...], num_positional: int, keys: tuple[str, ...]) -> Any:
        """The plain forward of the region's flattened inputs."""
        if not keys:
            return self.plain_forward(*flat)
        return self.plain_forward(*flat[:num_positional], **dict(zip(keys, flat[num_positional:], strict=True)))

    def _exposed_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers whose live values a recomputation could change: every one without ``protect_buffers``, else
        the larger ones no forward was seen to change (which recomputation gets as they are; the small ones it puts
        back always, see :func:`~lightning_ckpt_determinism.checkpointing.contexts.put_back_always`)."""
        buffers = ((name, own_buffers(owner).get(key)) for name, owner, key in self.plan.buffer_slots)
        if not self.config.protect_buffers:
            return [(name, buffer) for name, buffer in buffers if buffer is not None]
        if not self._profiles:  # a learning call replays every buffer
            return []
        replayed = self._replayed
        return [
            (name, buffer)
            for name, buffer in buffers
            if buffer is not None and name not in replayed and not put_back_always(buffer)
        ]

    def _buffer_changed(self, name: str) -> None:
        if name not in self._replayed:
            _log.info(
                "lightning_ckpt_determinism: region `%s` changed its buffer `%s` in forward, which it had not been seen"
                " to do (or created it); the region replays it from now on.",
                self.region,
                name,
            )
            self._replay_buffers(frozenset({name}))

    def _buffer_read_otherwise(self, name: str) -> None:
        self.buffers_read_otherwise[name] += 1
        _log.info(
            "lightning_ckpt_determinism: region `%s` recomputes with other values of its buffer `%s` than its forward"
            " started from or read (not copied before a forward was seen to change it: over %d bytes, or not a"
            " plain tensor): that call's recomputation may differ from its forward, once.",
            self.region,
            name,
            KEPT_BUFFER_BYTES,
        )

    def _buffer_written_between(self, name: str) -> None:
        if name not in self._replayed:
            _log.info(
                "lightning_ckpt_determinism: region `%s`'s buffer `%s` was written between its forward and its"
                " recomputation (by code outside the region, or a module sharing the buffer); the region replays it"
                " from now on.",
                self.region,
                name,
            )
            self._replay_buffers(frozenset({name}))

    def _context_fn(self, inputs: tuple[Any, ...], call: "_EagerCall") -> Callable[[], _ContextPair] | None:
        """The ``context_fn`` of an eager call, as the plan says: the package's contexts, torch's selective pair alone
        (the form `torch.compile` accepts), or none."""
        # The saved-tensor observer is entered by the call itself (`_EagerCall.run`), so it composes nothing here.
        observed = self.region_observer is not None
        if self.plan.composes_contexts(self.profile, self.data_dependent, observed):
            return partial(self._make_contexts, inputs, call)
        if self.plan.save_ops or self.kept_calls:
            return self._selective_pair
        return None

    def _selective_pair(self) -> _ContextPair:
        """torch's selective-checkpointing pair for one call: ``save_ops``, and the kept op calls counted afresh."""
        policy = _KeptCallsPolicy(self) if self.kept_calls else self._save_ops_policy
        forward, recompute = create_selective_checkpoint_contexts(policy)
        return forward, _KeptOutputWritten(KeptOutputsServedAgain(recompute), self.region, self.plan.save_ops)

    def _save_ops_policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self.plan.save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def kept_call_differs(self, position: int, found: Any) -> None:
        """A call ran ``found`` as its op call ``position``, where the measured call ran another op: it keeps no op
        output from there; said once per region."""
        if not self.said_mismatch:
            self.said_mismatch = True
            ran = self.measured_calls[position] if position < len(self.measured_calls) else "none"
            warnings.warn(
                f"lightning_ckpt_determinism: region `{self.region}` ran {found} as its op call {position}, where"
                f" the measured call of its `budget_granularity`='op' plan ran {ran}: its calls that differ from the"
                " measured one keep no op outputs from there (exact, at more recompute cost). Plan again on"
                " batches that take the same path.",
                LightningCkptDeterminismWarning,
                stacklevel=2,
            )

    def _found_data_dependent(self, found: bool) -> None:
        # A later forward that shows routing (one observed by a check) turns a dropped guard back on.
        if found or self.data_dependent is None:
            self.data_dependent = found

    def _make_contexts(self, inputs: tuple[Any, ...], call: "_EagerCall") -> tuple[Reenterable, Reenterable]:
        """One eager call's forward and recompute contexts, in the order the plan composes them: host RNG, the
        forward's state, selective checkpointing, the data-dependent guard, then the op observer registered on the
        region (the saved-tensor observer's contexts the call enters itself, innermost)."""
        plan, profile = self.plan, self.profile
        forward: list[ContextFactory] = []
        recompute: list[ContextFactory] = []
        if plan.host_rng:
            replay = HostRNGReplay(held_host_generators(self._region_modules, inputs))
            forward.append(replay.capture)
            recompute.append(replay.replay)
        if plan.replays_state(profile):
            slots = plan.buffer_slots if plan.protect_buffers else ()
            state = ForwardState(
                self.module,
                profile,
                slots,
                generators=plan.generators,
                changed=self._buffer_changed,
                written_between=self._buffer_written_between,
                read_otherwise=self._buffer_read_otherwise,
                starts=self._buffer_starts,
            )
            forward.append(state.capture)
            recompute.append(state.replay)
        if plan.save_ops or self.kept_calls:
            sac_forward, sac_recompute = self._selective_pair()
            forward.append(partial(same_context, sac_forward))
            recompute.append(partial(same_context, sac_recompute))
        guarded = plan.guards(self.data_dependent)
        observer = self.region_observer
        if not guarded and observer is None:
            return Reenterable(forward), Reenterable(recompute)
        kept = KeptOutputs(
            keep=guarded,
            save_ops=plan.save_ops,
            on_forward=self._found_data_dependent,
            dropped=plan.keep_data_dependent and not guarded,
        )
        # Above selective checkpointing, whose cache serves `save_ops`: the union of both is kept. Without the guard it
        # only logs, for the observer, which data-dependent ops run.
        forward.append(partial(_kept_forward, kept, inputs))
        if guarded:
            recompute.append(kept.recompute)
        if observer is not None:
            # Above the other contexts, so its dispatch mode sits on top of the selective-checkpointing one and of the
            # guard and sees every op, including those whose outputs they serve from their caches.
            observed = RegionCall(
                self.region,
                self.module,
                inputs,
                kept,
                self.plan.protect_buffers,
                frozenset(name for name, _ in self._exposed_buffers()),
                replays_rng=self.config.preserve_rng_state,
            )
            # The call holds the list alone, not the inputs: what the forward saved stays torch's to keep or drop.
            call.recomputed_from = observed.recomputed_from
            observe_forward, observe_recompute = observer.contexts(observed)
            forward.append(observe_forward)
            recompute.append(observe_recompute)
        return Reenterable(forward), Reenterable(recompute)

    def _saved_forward(self) -> AbstractContextManager[Any]:
        """The saved-tensor observer's context around this call's forward (the call enters it inside every recompute
        context, so that it sees the forward as they leave it)."""
        saved = self._watching_observer()
        return NO_CONTEXT if saved is None else saved.region_forward(self.region, self.module)

    def _saved_recompute(self) -> AbstractContextManager[Any]:
        """The saved-tensor observer's context around a recomputation (the observer registered now, if any)."""
        saved = self._watching_observer()
        if saved is None:
            return NO_CONTEXT
        return saved.region_recompute(self.region, self.module, self._exposed_buffers())

    def saved_tensors_watched(self) -> bool:
        """Whether a saved-tensor observer that reads the calls starting now is registered on the region."""
        return self._watching_observer() is not None

    def _watching_observer(self) -> SavedTensorObserver | None:
        """The saved-tensor observer registered on the region, if it reads the calls starting now (``watching``)."""
        saved = self.saved_observer
        return saved if saved is not None and saved.watching else None


KEPT_OUTPUT_WRITTEN_HINT = (
    "An op output the region keeps (`save_ops`, or a `budget_granularity`='op' plan) was written in place after the"
    " forward kept it (by an in-place op, such as `nn.ReLU(inplace=True)` after `aten.addmm`): torch cannot give the"
    " recomputation the value it kept. Remove that op from `save_ops`, or make the later op out of place"
    " (`inplace=False`); a `memory_budget` at `budget_granularity: op` leaves such outputs out itself."
)
"""What to do where torch refuses a kept output written in place (see
:func:`~lightning_ckpt_determinism._torch_compat.is_kept_output_mutation`)."""

KEPT_OUTPUT_WRITTEN_BY_ANOTHER_PATH_HINT = (
    "An op output the plan keeps was written in place after the forward kept it: this call ran the measured call's"
    " ops up to that op, then another path (a branch taken after the measured batch) whose in-place op wrote it, which"
    " torch cannot undo. Take that path at the measured batch too (the fit's first), make the in-place op out of"
    " place, or set `budget_granularity: module`."
)
"""What to do where torch refuses an output a `budget_granularity`='op' plan keeps, written in place by a call that
left the measured path after keeping it."""


class _KeptOutputWritten:
    """torch's recompute context of selective checkpointing, re-enterable as it is, whose error on a kept output that
    was written in place after the forward kept it (by a `ReLU(inplace=True)` after `aten.addmm`) names the region and
    what keeps outputs there."""

    __slots__ = ("_context", "_region", "_save_ops")

    def __init__(self, context: Any, region: str, save_ops: frozenset[Any]) -> None:
        self._context = context
        self._region = region
        self._save_ops = save_ops

    def __enter__(self) -> Any:
        return self._context.__enter__()

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> Any:
        handled = self._context.__exit__(kind, error, trace)
        if error is not None and is_kept_output_mutation(error):
            # Named as the config names them (`aten.addmm`, every overload), read only here, off the per-call path.
            kept = list(dict.fromkeys(str(op).rsplit(".", 1)[0] for op in self._save_ops))
            keeps = f"`save_ops` {kept}" if kept else "a `budget_granularity`='op' plan"
            # A plan leaves out what its measured call writes in place: this call took another path after a kept op.
            hint = KEPT_OUTPUT_WRITTEN_HINT if kept else KEPT_OUTPUT_WRITTEN_BY_ANOTHER_PATH_HINT
            # A `RuntimeError` still, as torch's was: the words name the region, what keeps outputs, and the fix.
            raise RuntimeError(
                f"lightning_ckpt_determinism: region `{self._region}` keeps op outputs by {keeps}. {hint}"
            ) from error
        return handled


@functools.cache
def _overload_name(op: Any) -> str:
    """``str(op)`` (``"aten.addmm.default"``), built once per op: an op plan's policy names every op call of its
    region's forwards, and torch builds the string afresh at each ``str`` (over a microsecond)."""
    return str(op)


class _KeptCallsPolicy:
    """The selective-checkpointing policy of one forward with kept op calls: follows the measured call op by op (as
    the meter counted them) and keeps the calls at the positions the plan names while the forward has run the same
    ops as the measured call.

    From the first op the measured call did not run there, the forward keeps nothing (exact, at more recompute cost),
    with one warning per region: an op at a kept position of a call that ran other ops before it (a branch, a cache
    the measured call built) may be another op's output, wider than planned or written in place later, which torch
    cannot keep."""

    def __init__(self, wrapper: CheckpointedForward) -> None:
        self._wrapper = wrapper
        self._position = 0
        self._differed = False
        self._framework = FrameworkOps()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self._framework.skips(op, args):  # an FSDP2 unit's gathering, uncounted as the meter left it out
            return CheckpointPolicy.PREFER_RECOMPUTE
        # Every other call counts, `save_ops`' too, as the meter counted them.
        position = self._position
        self._position += 1
        if not self._differed:
            measured = self._wrapper.measured_calls
            if position >= len(measured) or measured[position] != _overload_name(op):
                self._differed = True
                if any(kept >= position for kept in self._wrapper.kept_calls):
                    self._wrapper.kept_call_differs(position, op)
        if op in self._wrapper.plan.save_ops:
            return CheckpointPolicy.MUST_SAVE
        if self._differed or position not in self._wrapper.kept_calls:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


@dataclass(slots=True, eq=False)
class _EagerCall:
    """One eager call of a checkpointed region: its forward, then each recomputation (torch's own frame is one call's
    state in one object too).

    Attributes:
        wrapper: The region.
        num_positional: How many of the flattened inputs are positional; the rest are keyword values.
        keys: The keywords.
        contexts: The forward and recompute contexts the call enters itself (under torch's checkpoint debug mode, and
            for a region dynamo could not trace), or ``None`` when torch enters them through ``context_fn``.
        attributes: The attributes the forward rebinds, put back for each recomputation.
        first: Whether this is the region's first eager call, which looks for checkpointing around and inside it.
        key: The call's key, by which the region keeps what it learns (``None``: the call neither learns nor
            checks its path, as for a region dynamo could not trace).
        position: How many eager calls of the region came before it in the pass (since the region's last
            recomputation), where a path it takes without a profile is awaited in the next passes.
        awaiting: Whether it probes for a path awaited at its position.
        full: Whether its recomputations run to the region's end (a saved tensor filled late, a path not known on one
            process, or an ``nn.RReLU`` in training mode).
        runs: How many times torch ran it: the forward, then each recomputation.
        observed: Whether a saved-tensor observer kept the forward's tensors (torch compares them after each
            recomputation).
        registered: The buffers its forward registered, left out of each recomputation.
        made: Where the buffers of the submodules its forward made are held (``self.norm = nn.BatchNorm1d(...)`` in
            forward): each recomputation updates them again, so their values as it starts are put back after it (the
            region's next call reads its modules again and protects them).
        modules: The region's modules as the call started, whose training flags its key holds.
        torch_keeps: Whether the call passed torch's own ``determinism_check`` name (no probe learns from it and no
            observer reads it): torch's extractor keeps its tensors' metadata, and torch's frame counts them.
        recomputed_from: Where the region's observer reads what each recomputation starts from (its
            ``RegionCall.recomputed_from``), emptied after each; ``None`` without an observer.
        default_dtype: torch's default dtype as the forward ran, which each recomputation runs with: Lightning's
            ``"bf16-true"``, ``"16-true"`` and ``"64-true"`` set it around ``training_step`` only, so backward, where
            recomputation runs, would make the region's new tensors (``torch.linspace``, ``torch.tensor(0.1)``) in
            float32.
    """

    wrapper: CheckpointedForward
    num_positional: int
    keys: tuple[str, ...]
    contexts: _ContextPair | None
    attributes: AttributeReplay
    first: bool = field(kw_only=True)
    key: _CallKey | None = field(default=None, kw_only=True)
    position: int = field(default=0, kw_only=True)
    awaiting: bool = field(default=False, kw_only=True)
    torch_keeps: bool = field(default=False, kw_only=True)
    full: bool = field(default=False, init=False)
    runs: int = field(default=0, init=False)
    observed: bool = field(default=False, init=False)
    registered: list[RegisteredBuffer] = field(default_factory=list, init=False)
    made: list[tuple[nn.Module, str]] = field(default_factory=list, init=False)
    modules: tuple[nn.Module, ...] = field(default=(), init=False)
    default_dtype: torch.dtype = field(default=torch.float32, init=False)
    recomputed_from: list[tuple[Any, ...]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # The region's modules as the call starts: its forward may make others, which the next call reads.
        self.modules = self.wrapper._region_modules

    def run(self, *flat: Any) -> Any:
        """The region's forward at the first run, a recomputation at each later one."""
        forward = self.runs == 0
        self.runs += 1
        wrapper = self.wrapper
        entered: AbstractContextManager[Any] = NO_CONTEXT
        if self.contexts is not None:
            entered = self.contexts[0] if forward else self.contexts[1]
        if not forward:
            wrapper.recomputations += 1
            recomputing(observed=self.observed)
            modes = TrainingModes(self.modules, None if self.key is None else self.key[0])
            left_out = buffers_left_out(self.registered) if self.registered else NO_CONTEXT
            # The buffers of submodules the forward made, which the region protects from its next call on.
            made = values_kept(_held_buffers(self.made)) if self.made else NO_CONTEXT
            dtype = NO_CONTEXT if torch.get_default_dtype() is self.default_dtype else default_dtype(self.default_dtype)
            started = self.recomputed_from
            if started is not None:
                started.append(flat)
            try:
                with entered, wrapper._saved_recompute(), self.attributes.replay(), modes, left_out, made, dtype:
                    out = wrapper._forward_from(flat, self.num_positional, self.keys)
            finally:
                if started is not None:
                    started.clear()
            if self.full:
                _mark_end()
            return out
        self.default_dtype = torch.get_default_dtype()
        nested = probing_for_nesting(type(wrapper.module).__name__, _REGION_CALL) if self.first else NO_CONTEXT
        learning = self.key is not None and wrapper.profile is None
        probe = FirstForwardProbe(wrapper.module) if learning else None
        with entered, wrapper._saved_forward(), nested:
            # Read only while the region may still count with torch's frame: once it counted otherwise, never again.
            counter = checkpoint_saved_counter() if wrapper._frame_counted else None
            region_call = None if self.torch_keeps else InRegionCall(probe, wrapper.saved_observer)
            self.observed = region_call is not None and region_call.observed
            self.attributes.start()
            with region_call if region_call is not None else NO_CONTEXT, probe if probe is not None else NO_CONTEXT:
                start = autograd_nodes_made()
                out = wrapper._forward_from(flat, self.num_positional, self.keys)
                nodes = autograd_nodes_made() - start
            self.attributes.end()
            if child_modules(self.attributes.dicts) != wrapper._children:
                self.made = _buffers_made(self.modules, wrapper.module)
            count = buffer_count(self.attributes.dicts)
            if count != wrapper._buffer_count:
                self.registered = wrapper._buffers_registered(count)
                probe = None  # what it learned predates the buffers: the next call learns again
            # torch's frame counts what a call torch keeps saved; where it counts otherwise than the package's
            # extractor (a backward run inside the forward saves tensors the extractor leaves out of its count), or
            # cannot be read, the region's later calls count with the extractor.
            counted = counter() if counter is not None else None
            saved = region_call.saved if region_call is not None else -1 if counted is None else counted
            if counted != saved:
                wrapper._frame_counted = False
            # Before the saved-tensor observer's forward context ends, which reads the count and the profile of the
            # path taken.
            wrapper.saved = saved
            if self.key is not None:
                path = (saved, nodes, _output_node(out))
                self.full = wrapper._path_taken(
                    self.key, path, None if probe is None else probe.profile, self.position, self.awaiting
                )
            wrapper.recomputes_to_end = self.full
        if self.full:
            _mark_end()
        return out


def _buffers_made(known: tuple[nn.Module, ...], region: nn.Module) -> list[tuple[nn.Module, str]]:
    """The buffers of the submodules of ``region`` that are not among the ``known`` modules, as their module and key."""
    ids = set(map(id, known))
    return [(owner, key) for owner, key, _ in buffer_slots(region).values() if id(owner) not in ids]


def _held_buffers(places: list[tuple[nn.Module, str]]) -> list[torch.Tensor]:
    """The buffers held at ``places`` now (see :func:`_buffers_made`)."""
    return [buffer for owner, key in places if (buffer := own_buffers(owner).get(key)) is not None]


def _kept_forward(kept: KeptOutputs, inputs: tuple[Any, ...]) -> AbstractContextManager[Any]:
    """The data-dependent guard's forward context of one call, its size limit taken from that call's inputs."""
    kept.note_inputs(inputs)
    return kept.forward()


def _output_node(out: Any) -> type | None:
    """The type of the autograd node a region's output came from (``RreluWithNoiseBackward0``: the op its forward ended
    in), read from the output or, for a tuple, list or dict of outputs, its first tensor; ``None`` without one.

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> _output_node(torch.tanh(x)).__name__, _output_node((None, x * 2)).__name__, _output_node({"loss": x})
        ('TanhBackward0', 'MulBackward0', None)
    """
    if not isinstance(out, torch.Tensor):
        values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
        out = next((value for value in values if isinstance(value, torch.Tensor)), None)
        if out is None:
            return None
    node = out.grad_fn
    return None if node is None else type(node)


def _across_ranks() -> bool:
    """Whether this process trains with others (a process group of more than one rank)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _mark_end() -> None:
    """Save one more tensor at the region's end, whose holder dies at once: torch's early stop ends a recomputation
    once it has saved as many tensors as its forward, so it then stops only after the region's last op. Its own
    region call and below every dispatch mode, so that no observer, probe or selective-checkpointing cache sees it."""
    with InRegionCall(None, None), disable_current_modes():
        torch.empty(0, requires_grad=True).sin()


_REGION_CALL = CheckpointedForward._checkpoint.__code__


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` itself is checkpointed by this package.

    Example::

        >>> is_checkpointed(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def checkpointing_config(module: nn.Module) -> CheckpointingConfig | None:
    """The config ``module`` was checkpointed with, or ``None`` when it is not checkpointed.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> layer = torch.nn.Linear(2, 2)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"], every_n=1))
        >>> checkpointing_config(layer).classes, checkpointing_config(torch.nn.ReLU())
        (['Linear'], None)
    """
    wrapper = module.__dict__.get("forward")
    return wrapper.config if isinstance(wrapper, CheckpointedForward) else None


def replays_torch_rng(module: nn.Module) -> bool:
    """Whether every region checkpointed in ``module`` replays torch's RNG in its recomputations
    (``preserve_rng_state``, torch's stash and restore), so that none can leave it elsewhere than its forward did.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> layer = torch.nn.Linear(2, 2)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"], preserve_rng_state=False))
        >>> replays_torch_rng(layer), replays_torch_rng(torch.nn.ReLU())
        (False, True)
    """
    configs = (checkpointing_config(sub) for sub in module.modules())
    return all(config.preserve_rng_state for config in configs if config is not None)


def routes(module: nn.Module) -> bool | None:
    """Whether the checkpointed ``module``'s first eager checkpointed forward ran a data-dependent op (``topk``,
    ``nonzero``, ``.item()`` ...), whose outputs ``keep_data_dependent`` keeps; ``None`` before that forward has run
    (a compiled region's never does) and for a module that is not checkpointed.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> layer = torch.nn.Linear(4, 4)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"]))
        >>> routes(layer)
        >>> _ = layer(torch.ones(2, 4, requires_grad=True))
        >>> routes(layer)
        False
    """
    wrapper = module.__dict__.get("forward")
    return wrapper.data_dependent if isinstance(wrapper, CheckpointedForward) else None


def buffers_read_otherwise(module: nn.Module) -> dict[str, int]:
    """How many calls of the checkpointed regions in ``module`` recomputed with other values of a buffer than their
    forward started from or read, by buffer name (relative to ``module``): a buffer over
    :data:`~lightning_ckpt_determinism.checkpointing.contexts.KEPT_BUFFER_BYTES` that a forward changed for the first
    time after the region's first call, or that something wrote between a forward and its recomputation. A check
    compares the counts before and after a step to name such a buffer as the cause of that step's difference.

    Args:
        module: The root module.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> buffers_read_otherwise(model)
        {}
    """
    counts = {}
    for region, sub in checkpointed_modules(module).items():
        for name, count in vars(sub)["forward"].buffers_read_otherwise.items():
            counts[f"{region}.{name}" if region else name] = count
    return counts


def recomputations(module: nn.Module) -> int:
    """How many eager recomputations the checkpointed regions in ``module`` have run so far: a check compares the
    count before and after a forward to know whether a backward inside it (a gradient penalty) recomputed a region.

    Args:
        module: The root module.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> recomputations(model)
        1
    """
    return sum(recomputations_by_region(module).values())


def recomputations_by_region(module: nn.Module) -> dict[str, int]:
    """How many eager recomputations each checkpointed region in ``module`` has run so far, by name (as
    :func:`checkpointed_modules` names them).

    Args:
        module: The root module.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
        >>> model[1](torch.ones(1, 2, requires_grad=True)).sum().backward()
        >>> recomputations_by_region(model)
        {'1': 1, '2': 0}
    """
    return {name: vars(sub)["forward"].recomputations for name, sub in checkpointed_modules(module).items()}


@contextlib.contextmanager
def tracing_noted(module: nn.Module) -> Iterator[list[bool]]:
    """A block after which the list it gives holds whether a compiled function (a compiled model, step or closure)
    ran a checkpointed region of ``module`` inside it: that region's recomputations run inside graphs, where
    :func:`recomputations` does not count them. (Each compiled call of a region marks it, as dynamo replays the
    mark.)

    Args:
        module: The root module.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> with tracing_noted(model) as traced:
        ...     _ = model(torch.ones(1, 2))
        >>> traced
        [False]
    """
    wrappers = [vars(sub)["forward"] for sub in checkpointed_modules(module).values()]
    for wrapper in wrappers:
        wrapper.traced = False
    noted: list[bool] = []
    try:
        yield noted
    finally:
        noted.append(any(wrapper.traced for wrapper in wrappers))


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


_HOW_FIELDS = (
    "save_ops",
    "preserve_rng_state",
    "preserve_host_rng",
    "protect_buffers",
    "determinism_check",
    "keep_data_dependent",
)
"""The fields of a :class:`CheckpointingConfig` that say how a module is checkpointed (the others select modules)."""


def checkpoint_module(module: nn.Module, region: str, config: CheckpointingConfig) -> None:
    """Checkpoint ``module`` itself (not a selection of its submodules); nothing happens if it already is, checkpointed
    the same way.

    ``config``'s selection fields are ignored; its other fields say how to checkpoint.

    Args:
        module: The module to checkpoint.
        region: The name reports use for it, usually its name in the model.
        config: How to checkpoint it.

    Raises:
        CheckpointingTypeError: If an argument has the wrong type (arguments given in another order).
        CheckpointingConfigError: If ``module`` is checkpointed already with a config that checkpoints it otherwise
            (another field than a selection field differs), which this call would not change
            (:func:`remove_activation_checkpointing` first).

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, checkpoint_module, checkpointed_modules
        >>> layer = torch.nn.Linear(2, 2)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"]))
        >>> list(checkpointed_modules(layer))
        ['']
    """
    for name, value, kind in (
        ("module", module, nn.Module),
        ("region", region, str),
        ("config", config, CheckpointingConfig),
    ):
        if not isinstance(value, kind):
            raise CheckpointingTypeError(
                f"`{name}` must be a {kind.__name__}, got {type(value).__name__}: call"
                " `checkpoint_module(module, region, config)`."
            )
    own = checkpointing_config(module)
    if own is None:
        register_determinism_checks()
        module.forward = CheckpointedForward(module, region, config)  # type: ignore[method-assign]
    elif any(getattr(own, name) != getattr(config, name) for name in _HOW_FIELDS):
        raise CheckpointingConfigError(
            f"`{region}` is checkpointed already with another `CheckpointingConfig`, which checkpointing it again"
            " would not change: call `remove_activation_checkpointing(module)` first, then checkpoint it."
        )


def keep_op_calls(module: nn.Module, calls: Iterable[tuple[int, str]], measured: Sequence[str] = ()) -> None:
    """Make the checkpointed ``module``'s eager forwards keep the outputs of ``calls`` (position among the op calls
    selective checkpointing sees in the ``measured`` call, overload name) and recompute its other ops; no calls keeps
    none.

    Each forward keeps them while it runs the measured call's ops, in order; from its first op call that differs (a
    branch, a cache the measured call built) it keeps nothing, with one warning per region. Compiled calls keep none
    of them.

    Args:
        module: A checkpointed module.
        calls: The op calls to keep, as ``CheckpointingPlan.saved_ops`` lists them.
        measured: The overloads of the measured call's op calls in order, as its candidate's ``ops`` list them
            (needed where ``calls`` is not empty).

    Raises:
        ValueError: If ``measured`` does not hold a call's overload at its position.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> layer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Sequential"]))
        >>> keep_op_calls(layer, [(1, "aten.addmm.default")], ["aten.t.default", "aten.addmm.default"])
        >>> layer(torch.ones(1, 2, requires_grad=True)).sum().backward()
    """
    wrapper = module.__dict__["forward"]
    kept = dict(calls)
    ops = list(measured)
    wrong = [(position, name) for position, name in kept.items() if position >= len(ops) or ops[position] != name]
    if wrong:
        raise ValueError(
            f"`keep_op_calls`: the measured call does not run {wrong[0][1]} as its op call {wrong[0][0]}: give the"
            " overloads of the measured call's op calls in order (its candidate's `ops` in the plan)."
        )
    if kept != wrapper.kept_calls:
        # Other outputs kept: the region saves other tensors, so the paths it learned are stale; its next call learns
        # again rather than take an unknown path.
        wrapper.forget_paths()
    wrapper.kept_calls = kept
    wrapper.measured_calls = tuple(ops) if kept else ()
    wrapper.said_mismatch = False


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`~lightning_ckpt_determinism.apply_activation_checkpointing` on ``module`` and its submodules.

    Args:
        module: The root module.

    Returns:
        The names of the modules that were checkpointed.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> from lightning_ckpt_determinism import checkpointed_modules, remove_activation_checkpointing
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
