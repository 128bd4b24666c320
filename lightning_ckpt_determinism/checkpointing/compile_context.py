"""What a checkpointed region hands ``torch.compile``, and the warning when dynamo stops compiling a region.

Under ``torch.compile`` a checkpointed region is traced into the compiled graph (torch's ``tag_activation_checkpoint``
higher-order op), and its recomputation happens inside the compiled backward, where the compiler replays torch's RNG
(NumPy and ``random`` calls are traced onto it) and updates buffers once by itself. Dynamo takes a ``context_fn`` only
as a plain function or a ``functools.partial``, and guards on every argument of the partial by identity: so the
partial binds only what identical regions share (their config, and whether they hold buffers), and blocks compiled
one by one share one compiled graph, as hand-written checkpointing does.
"""

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from lightning_ckpt_determinism._torch_compat import RECOMPILE_LOGGER, hit_recompile_limit
from lightning_ckpt_determinism.checkpointing.routing import CompiledPolicy
from lightning_ckpt_determinism.config import AUTO_CLASSES, CheckpointingConfig, class_name, resolve_ops
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = ["ContextPairFn", "RecompileLimitFilter", "eager_only_options", "region_contexts"]

ContextPairFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
"""A ``context_fn``: makes a region call's forward and recompute contexts."""

_log = logging.getLogger(__name__)

# Which skipped options each config has been noted for: one info line per config, however many regions compile.
_noted: "weakref.WeakKeyDictionary[CheckpointingConfig, set[tuple[str, ...]]]" = weakref.WeakKeyDictionary()


@torch.compiler.disable  # type: ignore[untyped-decorator]
def region_contexts(
    config: CheckpointingConfig, protect_buffers: bool
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The ``context_fn`` of a checkpointed region dynamo traces, bound to its config with ``functools.partial``.

    The compiler calls it while it compiles the region (``torch.compiler.is_compiling()`` holds then): it gets
    torch's selective-checkpointing pair, the only form it accepts, whose policy saves ``save_ops`` and the kept
    data-dependent outputs, and the eager-only options are skipped with one info line. A region dynamo could not
    trace is checkpointed eagerly by torch, which calls this at the forward: it gets no context here, since the
    region's own function enters every eager context itself (this one knows nothing of the region). Kept out of
    dynamo so that the choice is made by the call, not frozen into a graph.

    Args:
        config: The region's config.
        protect_buffers: Whether the region protects buffers (it holds some and the config asks for it).

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> contexts = region_contexts(CheckpointingConfig(classes=["Block"]), False)  # called eagerly: nothing
        >>> [type(context).__name__ for context in contexts]
        ['nullcontext', 'nullcontext']
    """
    if not torch.compiler.is_compiling():
        return contextlib.nullcontext(), contextlib.nullcontext()
    skipped = eager_only_options(config, protect_buffers)
    noted = _noted.setdefault(config, set())
    if skipped and skipped not in noted:
        noted.add(skipped)
        _log.info(
            "lightning_ckpt_determinism: %s not applied to compiled checkpointed regions (%s): torch.compile"
            " recomputes them inside its backward graph, replaying torch's RNG (NumPy and `random` calls are traced"
            " onto it) and updating buffers once by itself. Regions that graph-break run eagerly and keep every"
            " option.",
            ", ".join(f"`{option}`" for option in skipped),
            _selection(config),
        )
    return create_selective_checkpoint_contexts(
        CompiledPolicy(save_ops=frozenset(resolve_ops(config.save_ops)), keep=config.keep_data_dependent)
    )


def eager_only_options(config: CheckpointingConfig, protect_buffers: bool) -> tuple[str, ...]:
    """The options of ``config`` a compiled region goes without: the compiler replays torch's RNG and updates buffers
    once (see :attr:`~lightning_ckpt_determinism.checkpointing.region_plan.RegionPlan.eager_only`).

    Args:
        config: The region's config.
        protect_buffers: Whether the region protects buffers.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> eager_only_options(CheckpointingConfig(classes=["Block"], preserve_host_rng=True), False)
        ('preserve_host_rng',)
    """
    options = (("preserve_host_rng", config.preserve_host_rng), ("protect_buffers", protect_buffers))
    return tuple(option for option, applies in options if applies)


def _selection(config: CheckpointingConfig) -> str:
    """What a config selects, as a note names it: ``classes ['Block']``, ``names ['model.blocks.*']``."""
    entries = config.classes if config.classes == AUTO_CLASSES else [class_name(entry) for entry in config.classes]
    parts = [f"classes {entries}"] if config.classes else []
    parts += [f"names {config.names}"] if config.names else []
    return " and ".join(parts)


class RecompileLimitFilter(logging.Filter):
    """Warns when dynamo reports that a checkpointed region hit its recompile limit: its later calls run eagerly.

    Dynamo says so only through its ``torch._dynamo.convert_frame`` logger, never through ``warnings``, and before
    the region's own code runs, so no context of the package can hold the filter: it sits on that logger while a
    checkpointed region exists. :meth:`serve` adds it with the first region and takes it off when the last region
    it serves is collected (unwrapped and released). It lets every record through, and Python's warning registry
    shows the warning once.

    Args:
        source: The file of the region wrapper's code, which dynamo names as the frame that hit the limit.
        wrapper: The wrapper's class name, which dynamo names in the guard that failed.
    """

    def __init__(self, source: str, wrapper: str) -> None:
        super().__init__()
        self._marks = (source, wrapper)
        self._regions: list[weakref.ref[object]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        ours = hit_recompile_limit(message) and any(mark in message for mark in self._marks)
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

    @classmethod
    def serve(cls, region: object, source: str, wrapper: str) -> None:
        """Have the filter on dynamo's logger (one for every region) as long as ``region`` lives.

        Args:
            region: The region's wrapper.
            source: See the class.
            wrapper: See the class.
        """
        logger = logging.getLogger(RECOMPILE_LOGGER)
        found = next((each for each in logger.filters if isinstance(each, RecompileLimitFilter)), None)
        if found is None:
            found = cls(source, wrapper)
            logger.addFilter(found)
        found._regions.append(weakref.ref(region))
        weakref.finalize(region, found._released)

    def _released(self) -> None:
        # Called as a region is collected, when weak references to it already read None.
        self._regions = [region for region in self._regions if region() is not None]
        if not self._regions:
            logging.getLogger(RECOMPILE_LOGGER).removeFilter(self)


def _rank_zero() -> bool:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_rank() == 0
