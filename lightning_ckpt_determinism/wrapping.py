"""Select submodules and run them under non-reentrant activation checkpointing, in place.

Wrapping sets an instance-level ``forward`` on each selected module, so the module object, its parameters, its
buffers and every ``state_dict`` key stay exactly as they were. Recomputation composes up to five contexts:
host-RNG replay, buffer protection, the selective-op policy, the guard that keeps data-dependent outputs (routing)
from the forward and, only while a check runs, the check's observer. Each recompute context can be entered any
number of times (a gradient penalty or ``retain_graph=True`` recomputes a region once per backward), and each entry
replays the same state. A region that needs only the selective-op policy gets torch's own pair of dispatch modes.
The guard (:mod:`~lightning_ckpt_determinism._data_dependent`) is on at a region's first checkpointed forward and
stays on only where that forward ran a data-dependent op: a region without routing pays nothing.

Under ``torch.compile`` a checkpointed region is traced into the compiled graph (torch's ``tag_activation_checkpoint``
higher-order op), and its recomputation happens inside the compiled backward, where the compiler replays torch's RNG
(NumPy and ``random`` calls are traced onto it) and updates buffers once by itself. The traced path reads only
state dynamo can guard on (an attribute of :data:`_SWITCH`, never a ContextVar), never passes ``noop_context_fn``
(dynamo fails on it), and passes a ``context_fn`` only when a region has ``save_ops``, eager-only options or
``keep_data_dependent``: :func:`_region_contexts`, which gives the compiler torch's selective-checkpointing pair (its
policy marks the kept data-dependent outputs ``MUST_SAVE``) and gives an eager call (a region dynamo could not
trace, which torch's checkpoint then runs eagerly) every eager context.
"""

import contextlib
import fnmatch
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt_determinism._data_dependent import CompiledPolicy, KeptOutputs, mark_region_inputs
from lightning_ckpt_determinism.config import CheckpointingConfig, resolve_class_path, resolve_ops
from lightning_ckpt_determinism.errors import CheckpointingConfigError, LightningCkptDeterminismWarning
from lightning_ckpt_determinism.rng import HostRNGState, capture_host_rng, restore_host_rng

__all__ = [
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpointed_modules",
    "checkpointing_disabled",
    "remove_activation_checkpointing",
    "select_modules",
]

_ContextFactory = Callable[[], AbstractContextManager[Any]]


class _RegionObserver(Protocol):
    """What the check engine plugs into each checkpointed region while a check runs.

    ``contexts`` is called at each checkpointed call with the tensors torch saves as the region's inputs and the
    call's log of data-dependent ops (filled during the forward: which ran, and whether each was kept), and returns
    two factories: one context for the forward, and one for each recomputation (there can be several, e.g. under a
    gradient penalty).
    """

    def contexts(
        self, region: str, module: nn.Module, inputs: tuple[Any, ...], kept: KeptOutputs
    ) -> tuple[_ContextFactory, _ContextFactory]: ...


class _Switch:
    """What the check changes in every checkpointed region: read by each checkpointed call.

    A plain object rather than ContextVars, because dynamo cannot trace a ContextVar read (it breaks the graph, and
    then fails on the checkpoint call). The traced path reads only ``disabled``, a bool dynamo guards on: switching
    checkpointing off compiles one more graph, once, whatever the nesting depth. ``observer`` is read only by eager
    calls, so compiled graphs never guard on it. The state is per process, not per thread.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.disabled = False
        self.observer: _RegionObserver | None = None


_SWITCH = _Switch()


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
def _run_plainly(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the given checkpointed modules with their plain forward inside this block; the others stay checkpointed."""
    wrappers = [module.__dict__["forward"] for module in modules if _is_wrapped(module)]
    for wrapper in wrappers:
        wrapper.plain_depth += 1
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.plain_depth -= 1


@contextlib.contextmanager
def _observing(observer: _RegionObserver) -> Iterator[None]:
    """Plug ``observer`` into every checkpointed region that runs eagerly inside this block."""
    previous = _SWITCH.observer
    _SWITCH.observer = observer
    try:
        yield
    finally:
        _SWITCH.observer = previous


# One object per distinct config while regions hold it, so that identical blocks share compiled code whether they
# were given one config object or equal ones.
_shared_configs: "weakref.WeakValueDictionary[CheckpointingConfig, CheckpointingConfig]" = weakref.WeakValueDictionary()


class _CheckpointedForward:
    """The instance-level ``forward`` of a checkpointed module."""

    def __init__(self, module: nn.Module, region: str, config: CheckpointingConfig) -> None:
        self.module = module
        self.region = region
        # Equal configs become one object: compiled graphs guard on its identity (see `_compiled_context_fn`).
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

    def __getstate__(self) -> dict[str, Any]:
        # Op overloads do not pickle (their pybind function records cannot), so a wrapped model with `save_ops`
        # could not be pickled or `torch.save`d; they are resolved again from the config on load.
        state = self.__dict__.copy()
        del state["_save_ops"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.config = _shared_configs.setdefault(self.config, self.config)
        self._save_ops = frozenset(resolve_ops(self.config.save_ops))

    def plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _SWITCH.disabled or self.plain_depth or not torch.is_grad_enabled():
            return self.plain_forward(*args, **kwargs)
        keys = tuple(kwargs)
        num_positional = len(args)
        # Dynamo reads `is_compiling()` as a constant. A traced call whose region dynamo cannot trace (it
        # graph-breaks inside) has torch run the region eagerly, with the traced call's `context_fn`, which holds
        # nothing of this region: `run` then enters the region's eager contexts itself.
        traced = torch.compiler.is_compiling()
        graph_broken: tuple[_Reenterable, _Reenterable] | None = None

        def run(*flat: Any) -> Any:
            nonlocal graph_broken
            if torch.compiler.is_compiling():
                if self.config.keep_data_dependent:
                    flat = mark_region_inputs(flat)
                return self._forward_from(flat, num_positional, keys)
            if not traced:
                return self._forward_from(flat, num_positional, keys)
            # The first call is the forward, each later one a recomputation.
            if graph_broken is None:
                graph_broken = self._make_contexts(_SWITCH.observer, self._protects_buffers(), flat)
                context = graph_broken[0]
            else:
                context = graph_broken[1]
            with context:
                return self._forward_from(flat, num_positional, keys)

        # Keyword tensors travel as positional inputs so torch sees their devices when it stashes RNG state.
        inputs = (*args, *kwargs.values())
        options: dict[str, Any] = {}
        # A traced call never reaches the eager choice, which reads the observer.
        context_fn = self._compiled_context_fn() if traced else self._context_fn(inputs)
        if context_fn is not None:
            # Only when there is one: torch's default is taken by leaving the argument out.
            options["context_fn"] = context_fn
        return checkpoint(
            run,
            *inputs,
            use_reentrant=False,
            preserve_rng_state=self.config.preserve_rng_state,
            determinism_check=self.config.determinism_check,
            **options,
        )

    def _forward_from(self, flat: tuple[Any, ...], num_positional: int, keys: tuple[str, ...]) -> Any:
        """The plain forward of the region's flattened inputs; an eager forward first gives the data-dependent
        guard its size limit."""
        if self._forward_kept is not None and not torch.compiler.is_compiling():
            self._forward_kept.note_inputs(flat)
            self._forward_kept = None
        return self.plain_forward(*flat[:num_positional], **dict(zip(keys, flat[num_positional:], strict=True)))

    def _protects_buffers(self) -> bool:
        # A region without buffers has nothing to protect: skipping the context saves its cost on every call.
        return self.config.protect_buffers and next(self.module.buffers(), None) is not None

    def _compiled_context_fn(
        self,
    ) -> Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] | None:
        """The ``context_fn`` of a call dynamo traces, or ``None`` when the region needs none.

        Dynamo guards on every argument of the partial by identity, so it binds only what identical regions share
        (their config, and whether they hold buffers): blocks compiled one by one share one compiled graph, as with
        hand-written checkpointing. What it returns is decided when called: see :func:`_region_contexts`.
        """
        protect_buffers = self._protects_buffers()
        if self.config.keep_data_dependent or self.config.preserve_host_rng or protect_buffers or self._save_ops:
            # The policy runs only while the compiler traces the region: it costs nothing per step, so every region
            # gets it, and it finds the data-dependent ops itself.
            return partial(_region_contexts, self.config, protect_buffers)
        return None

    def _context_fn(
        self, inputs: tuple[Any, ...]
    ) -> Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] | None:
        observer = _SWITCH.observer
        protect_buffers = self._protects_buffers()
        if self.config.preserve_host_rng or protect_buffers or observer is not None or self._guarded():
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
        self, observer: _RegionObserver | None, protect_buffers: bool, inputs: tuple[Any, ...]
    ) -> tuple["_Reenterable", "_Reenterable"]:
        forward: list[_ContextFactory] = []
        recompute: list[_ContextFactory] = []
        if self.config.preserve_host_rng:
            replay = _HostRNGReplay()
            forward.append(replay.capture)
            recompute.append(replay.replay)
        if protect_buffers:
            recompute.append(partial(_protected_buffers, self.module))
        if self._save_ops:
            sac_forward, sac_recompute = create_selective_checkpoint_contexts(self._save_ops_policy)
            forward.append(partial(_same_context, sac_forward))
            recompute.append(partial(_same_context, sac_recompute))
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
            observe_forward, observe_recompute = observer.contexts(self.region, self.module, inputs, kept)
            forward.append(observe_forward)
            recompute.append(observe_recompute)
        return _Reenterable(forward), _Reenterable(recompute)


# Which skipped options each config has been noted for: one info line per config, however many regions compile.
_noted_compiled_options: "weakref.WeakKeyDictionary[CheckpointingConfig, set[tuple[str, ...]]]" = (
    weakref.WeakKeyDictionary()
)


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def _region_contexts(
    config: CheckpointingConfig, protect_buffers: bool
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The contexts of a region checkpointed under ``torch.compile`` that needs any, decided when torch calls for them.

    The compiler calls this while it compiles the region (``torch.compiler.is_compiling()`` holds then): it gets
    torch's selective-checkpointing pair, the only form it accepts, and the eager-only options are skipped with one
    info line. A region dynamo could not trace is checkpointed eagerly by torch, which calls this at the forward:
    it gets no context here, since the region's own ``run`` enters every eager context itself (this function knows
    nothing of the region). Kept out of dynamo so that the choice is made by the call, not frozen into a graph.
    """
    if not torch.compiler.is_compiling():
        return contextlib.nullcontext(), contextlib.nullcontext()
    skipped = tuple(
        option
        for option, applies in (("preserve_host_rng", config.preserve_host_rng), ("protect_buffers", protect_buffers))
        if applies
    )
    noted = _noted_compiled_options.setdefault(config, set())
    if skipped and skipped not in noted:
        noted.add(skipped)
        rank_zero_info(
            f"lightning_ckpt_determinism: {', '.join(f'`{option}`' for option in skipped)} not applied to compiled"
            f" checkpointed regions ({_selection(config)}): torch.compile recomputes them inside its backward graph,"
            " replaying torch's RNG (NumPy and `random` calls are traced onto it) and updating buffers once by"
            " itself. Regions that graph-break run eagerly and keep every option."
        )
    return create_selective_checkpoint_contexts(
        CompiledPolicy(save_ops=frozenset(resolve_ops(config.save_ops)), keep=config.keep_data_dependent)
    )


def _selection(config: CheckpointingConfig) -> str:
    """What a config selects, as a note names it: ``classes ['Block']``, ``names ['model.blocks.*']``."""
    parts = [f"{field} {getattr(config, field)}" for field in ("classes", "names") if getattr(config, field)]
    return " and ".join(parts)


class _Reenterable:
    """A context that can be entered any number of times, one entry after another.

    torch enters a region's recompute context each time the region is recomputed: twice under a gradient penalty
    (``autograd.grad(..., create_graph=True)`` and then a backward through it) or with ``retain_graph=True``. Each
    entry enters fresh contexts from the factories, in order, so every recomputation starts from the same state.
    """

    def __init__(self, factories: list[_ContextFactory]) -> None:
        self._factories = factories
        self._entered: list[ExitStack] = []

    def __enter__(self) -> None:
        with ExitStack() as stack:
            for factory in self._factories:
                stack.enter_context(factory())
            self._entered.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._entered.pop().__exit__(*exc_info))


def _same_context(context: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
    """A factory for a context that is itself re-enterable, such as a dispatch mode."""
    return context


class _HostRNGReplay:
    """Capture Python's and NumPy's RNG at the forward; replay it during each recomputation, then put the live state
    back."""

    def __init__(self) -> None:
        self._state: HostRNGState | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self._state = capture_host_rng()
        yield

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: recomputation ran before the forward it replays.")
        live = capture_host_rng()
        restore_host_rng(self._state)
        try:
            yield
        finally:
            restore_host_rng(live)


def _buffer_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Each buffer of ``module`` by its name, with the module that holds it and its key there."""
    slots = {}
    for prefix, owner in module.named_modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None:
                slots[f"{prefix}.{key}" if prefix else key] = (owner, key, buffer)
    return slots


@contextlib.contextmanager
def _protected_buffers(module: nn.Module) -> Iterator[None]:
    """Let recomputation update copies of the region's buffers, never the buffers themselves."""
    originals = list(_buffer_slots(module).values())
    try:
        with torch.no_grad():
            for owner, name, buffer in originals:
                owner._buffers[name] = buffer.clone()
        yield
    finally:
        for owner, name, buffer in originals:
            owner._buffers[name] = buffer


def _is_wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _region_name(name: str) -> str:
    """A module's name as users write it: without the ``_orig_mod`` that a ``torch.compile`` wrapper adds."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` by region name, without the compile wrappers: each shares its name with the module
    it compiles, which is the one to select and report."""
    for name, sub in module.named_modules():
        if not isinstance(sub, OptimizedModule):
            yield _region_name(name), sub


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
    return {name: sub for name, sub in _named_modules(module) if _is_wrapped(sub)}


def select_modules(module: nn.Module, config: CheckpointingConfig) -> dict[str, nn.Module]:
    """The submodules of ``module`` that ``config`` selects, by name, in module order, without wrapping anything.

    Modules already checkpointed count as selected, so selecting is idempotent; a match nested in (or holding)
    a checkpointed module is skipped rather than checkpointed twice. Names leave out the ``_orig_mod`` of
    ``torch.compile`` wrappers (``names: ["model.blocks.*"]`` selects the blocks of a compiled ``model``), and a
    wrapper itself is never selected: the module it compiles is, so its checkpoint is traced into the compiled graph.

    Args:
        module: The root module; names are relative to it.
        config: What to select.

    Raises:
        CheckpointingConfigError: If nothing matches (the message lists the module classes and a sample of module
            names), or if ``every_n`` exceeds the number of matched modules.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
        >>> list(select_modules(model, CheckpointingConfig(classes=["Linear"], every_n=2)))
        ['1', '3']
    """
    bare_names = {path for path in config.classes if "." not in path}
    classes = tuple(resolve_class_path(path) for path in config.classes if "." in path)
    wrapped_names = [name for name, sub in _named_modules(module) if _is_wrapped(sub)]

    def matches(name: str, sub: nn.Module) -> bool:
        if _is_wrapped(sub):
            return True
        if any(wrapped.startswith(name + ".") for wrapped in wrapped_names):
            return False
        if isinstance(sub, classes) or any(base.__name__ in bare_names for base in type(sub).__mro__):
            return True
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in config.names)

    matched: list[tuple[str, nn.Module]] = []
    for name, sub in _named_modules(module):
        if not name or any(name.startswith(outer + ".") for outer, _ in matched):
            continue
        if matches(name, sub):
            matched.append((name, sub))
    if not matched:
        raise CheckpointingConfigError(_nothing_matched_message(module, config))
    _warn_unused_entries(module, config, bare_names, classes)
    if len(matched) < config.every_n:
        # Otherwise nothing would be checkpointed and training would run silently without it.
        raise CheckpointingConfigError(
            f"`every_n`={config.every_n} selects none of the {len(matched)} matched modules of"
            f" {type(module).__name__} ({[name for name, _ in matched]}). Use an `every_n` of at most {len(matched)}."
        )
    return {name: sub for index, (name, sub) in enumerate(matched) if (index + 1) % config.every_n == 0}


def apply_activation_checkpointing(module: nn.Module, config: CheckpointingConfig) -> list[str]:
    """Checkpoint the submodules of ``module`` that ``config`` selects, in place, always non-reentrant.

    Nothing is replaced: parameter names, buffer names and ``state_dict`` keys do not change, so checkpoints load
    with ``strict=True`` with or without checkpointing. Forward keyword arguments and any outputs (tuples, dicts,
    non-tensors) pass through. Applying the same config twice wraps nothing twice. Under ``torch.no_grad()`` and
    inside :func:`checkpointing_disabled` a wrapped module runs its plain forward.

    Args:
        module: The root module; ``config.names`` are relative to it.
        config: What to checkpoint and how.

    Returns:
        The names of the checkpointed modules, in module order.

    Raises:
        CheckpointingConfigError: If ``config`` matches no module or ``every_n`` skips every match (nothing is
            wrapped then).

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
        >>> apply_activation_checkpointing(model, CheckpointingConfig(classes=["torch.nn.Linear"]))
        ['0', '2']
        >>> list(model.state_dict())
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    selected = select_modules(module, config)
    for name, sub in selected.items():
        checkpoint_module(sub, name, config)
    return list(selected)


class _RecompileLimitFilter(logging.Filter):
    """Warns when dynamo reports that a checkpointed region hit its recompile limit: its later calls run eagerly.

    Dynamo says so only through its ``torch._dynamo.convert_frame`` logger, never through ``warnings``; this filter
    lets every record through and holds no state (Python's warning registry shows the warning once).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        ours = "hit config." in message and (__file__ in message or _CheckpointedForward.__name__ in message)
        if ours and _rank_zero():
            warnings.warn(
                "lightning_ckpt_determinism: torch.compile hit its recompile limit on a checkpointed region, so its"
                " later calls run eagerly, uncompiled (dynamo's report follows in its log). Identical regions share"
                " one compiled graph when they are checkpointed with equal `CheckpointingConfig`s and called alike;"
                " otherwise raise `torch._dynamo.config.recompile_limit`.",
                LightningCkptDeterminismWarning,
                stacklevel=2,
            )
        return True


def _rank_zero() -> bool:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_rank() == 0


def _watch_recompile_limit() -> None:
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(existing, _RecompileLimitFilter) for existing in logger.filters):
        logger.addFilter(_RecompileLimitFilter())


def checkpoint_module(module: nn.Module, region: str, config: CheckpointingConfig) -> None:
    """Checkpoint ``module`` itself (not a selection of its submodules); nothing happens if it already is.

    ``config``'s selection fields are ignored; its other fields say how to checkpoint.

    Args:
        module: The module to checkpoint.
        region: The name reports use for it, usually its name in the model.
        config: How to checkpoint it.

    Example::

        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> checkpoint_module(layer, "layer", CheckpointingConfig(classes=["Linear"]))
        >>> list(checkpointed_modules(layer))
        ['']
    """
    if not _is_wrapped(module):
        module.forward = _CheckpointedForward(module, region, config)  # type: ignore[method-assign]
        _watch_recompile_limit()


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`apply_activation_checkpointing` on ``module`` and all its submodules.

    Args:
        module: The root module.

    Returns:
        The names of the modules that were checkpointed.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Linear"]))
        >>> remove_activation_checkpointing(model)
        ['0']
        >>> checkpointed_modules(model)
        {}
    """
    removed = []
    for name, sub in _named_modules(module):
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            if wrapper.previous_forward is None:
                del sub.forward
            else:
                sub.forward = wrapper.previous_forward  # type: ignore[method-assign]
            removed.append(name)
    return removed


def _nothing_matched_message(module: nn.Module, config: CheckpointingConfig) -> str:
    class_names = sorted({type(sub).__name__ for _, sub in _named_modules(module)})
    module_names = [name for name, _ in _named_modules(module) if name]
    sample = module_names[:12] + (["..."] if len(module_names) > 12 else [])
    return (
        f"`CheckpointingConfig` matches no module of {type(module).__name__}: classes={config.classes},"
        f" names={config.names}. The model's module classes are {class_names}; its module names include"
        f" {sample}. Names are relative to the module the config is applied to (the LightningModule under a"
        " strategy)."
    )


def _warn_unused_entries(
    module: nn.Module, config: CheckpointingConfig, bare_names: set[str], classes: tuple[type, ...]
) -> None:
    named = [(name, sub) for name, sub in _named_modules(module) if name]
    seen_class_names = {base.__name__ for _, sub in named for base in type(sub).__mro__}
    unused = [name for name in sorted(bare_names) if name not in seen_class_names]
    unused += [cls.__qualname__ for cls in classes if not any(isinstance(sub, cls) for _, sub in named)]
    unused += [pattern for pattern in config.names if not any(fnmatch.fnmatchcase(n, pattern) for n, _ in named)]
    if unused:
        warnings.warn(
            f"lightning_ckpt_determinism: `CheckpointingConfig` entries {unused} match no module of"
            f" {type(module).__name__}; check their spelling.",
            LightningCkptDeterminismWarning,
            stacklevel=3,
        )
