"""The plan of one checkpointed region: which recompute contexts it needs, decided once from its config and module.

The region wrapper (:mod:`~lightning_ckpt_determinism.checkpointing.wrapper`) builds one :class:`RegionPlan` when it
wraps a module, and every call reads it: the eager path for the contexts it composes, the path ``torch.compile``
traces for the ``context_fn`` it hands the compiler
(:func:`~lightning_ckpt_determinism.checkpointing.compile_context.region_contexts`, which skips the options named by
:attr:`RegionPlan.eager_only`). What a region's calls show (the
:class:`~lightning_ckpt_determinism.checkpointing.profile.RegionProfile` of calls like the one under way, and whether
its first forward ran a data-dependent op) is learned afterwards; the plan's methods take it as an argument.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from lightning_ckpt_determinism.checkpointing.compile_context import ContextPairFn, eager_only_options, region_contexts
from lightning_ckpt_determinism.checkpointing.contexts import BufferSlot
from lightning_ckpt_determinism.checkpointing.modules import buffer_keys
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from lightning_ckpt_determinism.config import CheckpointingConfig, resolve_ops

__all__ = ["RegionPlan"]


@dataclass(frozen=True)
class RegionPlan:
    """Which contexts one checkpointed region needs, decided once from its config and its module.

    Attributes:
        config: The region's config; its switches (``host_rng``, ``generators``, ``keep_data_dependent``) are read
            from it.
        protect_buffers: Recompute from the buffer values the forward started from (``protect_buffers``, and the
            region holds buffers: a region without any skips the context and its cost).
        save_ops: The ops whose outputs are saved rather than recomputed (``save_ops``, resolved).
        buffer_slots: The region's buffers, worked out once: those registered as ``None`` too (a buffer sized at
            the first forward), which a forward may create.

    Example::

        >>> import torch
        >>> plan = RegionPlan.of(torch.nn.BatchNorm1d(2), CheckpointingConfig(classes=["BatchNorm1d"]))
        >>> plan.protect_buffers, plan.eager_only
        (True, ('protect_buffers',))
        >>> RegionPlan.of(torch.nn.Linear(2, 2), CheckpointingConfig(classes=["Linear"])).protect_buffers
        False
    """

    config: CheckpointingConfig
    protect_buffers: bool
    save_ops: frozenset[Any]
    buffer_slots: tuple[BufferSlot, ...]

    @classmethod
    def of(cls, module: nn.Module, config: CheckpointingConfig) -> "RegionPlan":
        """The plan of ``module`` checkpointed with ``config``.

        Args:
            module: The region.
            config: How to checkpoint it.
        """
        slots = tuple(buffer_keys(module))
        protect_buffers = config.protect_buffers and bool(slots)
        save_ops = frozenset(resolve_ops(config.save_ops))
        return cls(config=config, protect_buffers=protect_buffers, save_ops=save_ops, buffer_slots=slots)

    @property
    def host_rng(self) -> bool:
        """Replay Python's and NumPy's RNG at each recomputation (``preserve_host_rng``)."""
        return self.config.preserve_host_rng

    @property
    def generators(self) -> bool:
        """Replay the ``torch.Generator`` objects the region's modules hold (``preserve_rng_state``)."""
        return self.config.preserve_rng_state

    @property
    def keep_data_dependent(self) -> bool:
        """Keep the outputs of data-dependent ops from the forward (``keep_data_dependent``), until the region's first
        forward shows it runs none."""
        return self.config.keep_data_dependent

    def __getstate__(self) -> dict[str, Any]:
        # Op overloads do not pickle (their pybind function records cannot), so a wrapped model with `save_ops`
        # could not be pickled or `torch.save`d: they are resolved again from the config on load.
        state = dict(self.__dict__)
        del state["save_ops"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "save_ops", frozenset(resolve_ops(self.config.save_ops)))

    def compiled_context(self, holds_buffers: bool) -> ContextPairFn | None:
        """The ``context_fn`` a traced call hands ``torch.compile``, or ``None`` when it needs none.

        Made at each traced call, as hand-written checkpointing makes it: it binds only what identical regions share
        (their config object and whether they protect buffers), so that blocks compiled one by one share one graph.
        The policy runs only while the compiler traces the region: it costs nothing per step, so every region with an
        option gets it, and it finds the data-dependent ops itself.

        Args:
            holds_buffers: Whether the region holds buffers, as the traced call reads it from the module (so that
                dynamo guards on the module's structure: regions of other classes compile apart, and one that
                graph-breaks never lends its partial graph to others).
        """
        protect_buffers = self.config.protect_buffers and holds_buffers
        if self.keep_data_dependent or self.host_rng or protect_buffers or self.save_ops:
            return partial(region_contexts, self.config, protect_buffers)
        return None

    @property
    def eager_only(self) -> tuple[str, ...]:
        """The options a compiled region goes without: the compiler replays torch's RNG and updates buffers once."""
        return eager_only_options(self.config, self.protect_buffers)

    def replays_state(self, profile: RegionProfile | None) -> bool:
        """Whether a forward's buffers or generators must be captured for its recomputation (see
        :class:`~lightning_ckpt_determinism.checkpointing.contexts.ForwardState`).

        Args:
            profile: What the region learned about calls like the one under way; ``None`` for a learning call.
        """
        if profile is None or self.protect_buffers:
            return True
        return self.generators and bool(profile.generators)

    def guards(self, data_dependent: bool | None) -> bool:
        """Whether an eager call keeps data-dependent outputs: until the first forward showed the region has none.

        Args:
            data_dependent: Whether the region's first forward ran a data-dependent op (``None``: none has ended).
        """
        return self.keep_data_dependent and data_dependent is not False

    def composes_contexts(self, profile: RegionProfile | None, data_dependent: bool | None, observed: bool) -> bool:
        """Whether an eager call composes the package's contexts (else it gets torch's selective-checkpointing pair
        when it has ``save_ops``, and no context otherwise).

        Args:
            profile: What the region learned about calls like the one under way; ``None`` for a learning call.
            data_dependent: Whether that forward ran a data-dependent op.
            observed: Whether an observer of the ops (attribution's) is registered on the region; the saved-tensor
                observer is entered by the call itself and composes nothing.
        """
        return self.host_rng or observed or self.guards(data_dependent) or self.replays_state(profile)
