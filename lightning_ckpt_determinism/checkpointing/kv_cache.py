"""Key-value caches (Hugging Face transformers) kept out of checkpointed regions while grad is enabled.

A transformers attention layer appends the step's keys and values to its cache in forward. Recomputation runs the
forward again and appends them a second time: eager attention then fails in backward on mismatched sizes, and sdpa
attention silently attends over the doubled cache. transformers' own gradient checkpointing avoids it by turning the
cache off in training; so does this package:

- applying checkpointing to a region inside a transformers ``PreTrainedModel`` whose ``config.use_cache`` is true
  sets it to ``False``, with one info line, until the last such region of that model is removed again;
- a region that is a transformers layer (its class, or a base of it, comes from ``transformers``), called with grad
  enabled (in training, or in eval mode for log-probabilities with gradients), gets ``use_cache=False`` and no cache
  object (``cache``, ``past_key_values``, ``past_key_value``, ``layer_past``), as transformers'
  ``GradientCheckpointingLayer`` does, with one warning (a layer transformers marks ``_can_checkpoint_with_cache``,
  which only reads its cache, keeps it and gets ``use_cache=False`` alone, as there). It does so whether they come as
  keywords or as positional arguments (transformers 5's ``GPT2Model`` passes its cache to ``GPT2Block`` by position,
  and an explicit ``use_cache=True`` overrides the config): the positions are read from the layer's ``forward``
  signature once, when the region is made. Other modules keep their arguments, whatever their names.

transformers is never imported: its models are recognised by the name and module of a base class.
"""

import inspect
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = [
    "CacheParameters",
    "CacheSwitch",
    "is_transformers_layer",
    "is_transformers_model",
    "restored_switch",
    "switch_off_kv_caches",
]

_log = logging.getLogger(__name__)

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The names transformers' layers give their cache argument (``cache`` in 5.x, the others in 4.x)."""


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` with a ``config``, found without importing it.

    Example::

        >>> is_transformers_model(nn.Linear(2, 2))
        False
    """
    transformers_base = any(
        base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers.")
        for base in type(module).__mro__
    )
    return transformers_base and hasattr(module, "config")


def is_transformers_layer(module: nn.Module) -> bool:
    """Whether ``module``'s class, or one of its bases, is defined in transformers: a layer whose cache arguments the
    package drops in training, found without importing transformers.

    Example::

        >>> is_transformers_layer(nn.Linear(2, 2))
        False
    """
    return any(base.__module__.startswith("transformers.") for base in type(module).__mro__)


class CacheSwitch:
    """The ``use_cache`` of one transformers config, off while the checkpointed regions that hold it remain.

    Args:
        model: The class name of the (outermost) model that owns the config, for messages.
        config: The model's config; its ``use_cache`` is set to ``False`` now.

    Example::

        >>> from types import SimpleNamespace
        >>> config = SimpleNamespace(use_cache=True)
        >>> switch = CacheSwitch("model", config)
        >>> switch.hold(); config.use_cache
        False
        >>> switch.release(); config.use_cache
        True
    """

    def __init__(self, model: str, config: Any) -> None:
        self.model = model
        self.config = config
        self.holders = 0
        config.use_cache = False

    def hold(self) -> None:
        """Count one more region inside the model."""
        self.holders += 1

    def __getstate__(self) -> dict[str, Any]:
        # A copy (`copy.deepcopy`, `torch.save`) is held by the copied regions alone, each counting itself again as it
        # is restored: the original's count includes the regions of other models built from its config.
        return {**self.__dict__, "holders": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also a switch pickled with its count (by an earlier version): the restored regions count themselves again.
        self.__dict__.update({**state, "holders": 0})

    def release(self) -> None:
        """Count one region less; the last one turns the cache back on."""
        self.holders -= 1
        if self.holders == 0:
            self.config.use_cache = True
            if _held.get(id(self.config)) is self:
                del _held[id(self.config)]


# The switch of each config that checkpointed regions hold, by the config's identity: models built from one config
# object share its switch, so that the cache comes back on only when the last region of any of them is removed. Held
# weakly: the regions' wrappers own the switches, and a switch lives (and keeps its config's identity) while they do.
_held: "weakref.WeakValueDictionary[int, CacheSwitch]" = weakref.WeakValueDictionary()


def restored_switch(switch: CacheSwitch) -> CacheSwitch:
    """The switch a region restored from a copy or a pickle holds: the live switch of its config where one is held (a
    copy that shares the original's config), else ``switch`` itself, which models built later from its config share.

    Args:
        switch: The switch as the region was restored with it (see :meth:`CacheSwitch.__getstate__`).

    Example::

        >>> import copy
        >>> from types import SimpleNamespace
        >>> switch = CacheSwitch("model", SimpleNamespace(use_cache=True))
        >>> restored_switch(copy.deepcopy(switch)) is not switch  # the copy has a config of its own
        True
    """
    held = _live_switch(switch.config)
    if held is not None:
        return held
    _held.setdefault(id(switch.config), switch)
    return switch


def _live_switch(config: Any) -> CacheSwitch | None:
    """The switch that checkpointed regions hold for ``config``, if any."""
    held = _held.get(id(config))
    return held if held is not None and held.config is config and held.holders > 0 else None


def switch_off_kv_caches(root: nn.Module, regions: Iterable[nn.Module]) -> list[CacheSwitch]:
    """Turn off ``config.use_cache`` of each transformers model of ``root`` that holds one of ``regions``.

    Each region's wrapper holds the switches of the models around it and releases them when it is removed. Models
    that share a config (``LlamaForCausalLM`` and its ``LlamaModel``, or two models built from one config object),
    checkpointed together or one after the other, share one switch. Regions are matched by identity, so names
    changed by a wrapper (FSDP) do not matter.

    Args:
        root: A module that contains the regions.
        regions: The checkpointed regions (already wrapped).

    Returns:
        The switches made (the caches just turned off), after one info line for them.

    Example::

        >>> switch_off_kv_caches(nn.Sequential(nn.Linear(2, 2)), [])
        []
    """
    models = [sub for sub in root.modules() if is_transformers_model(sub)]
    contents = [(model, {id(sub) for sub in model.modules()}) for model in models]
    switches: dict[int, CacheSwitch] = {}
    for region in regions:
        wrapper = region.__dict__["forward"]
        for model, inside in contents:
            config: Any = model.config
            if id(region) not in inside:
                continue
            switch = switches.get(id(config))
            if switch is None and (held := _live_switch(config)) is not None:
                switch = held
                if getattr(config, "use_cache", False) is True:  # turned back on since the switch was made
                    config.use_cache = False
                    switches[id(config)] = switch
            if switch is None:
                if getattr(config, "use_cache", False) is not True:
                    continue
                switch = switches[id(config)] = _held[id(config)] = CacheSwitch(type(model).__name__, config)
            if switch not in wrapper.cache_switches:
                switch.hold()
                wrapper.cache_switches.append(switch)
    if switches:
        names = ", ".join(f"`{switch.model}`" for switch in switches.values())
        _log.info(
            "lightning_ckpt_determinism: set `config.use_cache = False` on %s while its layers are checkpointed:"
            " recomputation would fill the key-value cache a second time. Removing checkpointing restores it.",
            names,
        )
    return list(switches.values())


def _asks_for_cache(value: Any) -> bool:
    # By identity: `==` on a tensor argument would compare elements.
    return value is not None and value is not False


_DROPPED = ("use_cache", *CACHE_ARGUMENTS)


@dataclass(frozen=True)
class CacheParameters:
    """Where a transformers layer's ``forward`` takes ``use_cache`` and its cache, read once from its signature.

    Args:
        region_class: The layer's class name, for the warning.
        positions: The position (among the positional arguments, ``self`` not counted) and name of each of
            ``use_cache`` and the cache arguments that can be passed by position.
        reads_cache_only: The layer only reads its cache (transformers' ``_can_checkpoint_with_cache``: a decoder
            that attends over a cache the encoder filled in the same forward): it keeps the cache, as transformers'
            own gradient checkpointing keeps it, and loses only ``use_cache``.

    Example::

        >>> def forward(hidden_states, cache=None, mask=None, *, use_cache=False): ...
        >>> CacheParameters.of("Block", forward).positions
        ((1, 'cache'),)
    """

    region_class: str
    positions: tuple[tuple[int, str], ...]
    reads_cache_only: bool = False

    @classmethod
    def of(cls, region_class: str, forward: Callable[..., Any], *, reads_cache_only: bool = False) -> "CacheParameters":
        """The cache parameters of ``forward``; a signature that cannot be read (a builtin, an odd callable) leaves
        only keywords to look at.

        Args:
            region_class: The layer's class name, for the warning.
            forward: The layer's ``forward`` as a region calls it: a bound method, or a function without ``self``.
                Wrappers made with ``functools.wraps`` (transformers' ``deprecate_kwarg``) are followed.
            reads_cache_only: The layer only reads its cache (see the class).
        """
        dropped = _dropped(reads_cache_only)
        try:
            parameters = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):
            return cls(region_class, (), reads_cache_only)
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [parameter.name for parameter in parameters if parameter.kind in by_position]
        positions = tuple((index, name) for index, name in enumerate(positional) if name in dropped)
        return cls(region_class, positions, reads_cache_only)

    def without_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` without a key-value cache: ``use_cache`` false and each cache argument ``None``,
        by keyword or by position (warned once).

        Args:
            args: The positional arguments of a region call with grad enabled.
            kwargs: Its keyword arguments.

        Returns:
            The arguments to call the layer with: the same objects when nothing asked for a cache.

        Example::

            >>> CacheParameters("Block", ((1, "cache"),)).without_cache(("x", None), {"mask": 1})
            (('x', None), {'mask': 1})
        """
        by_keyword = [name for name in _dropped(self.reads_cache_only) if _asks_for_cache(kwargs.get(name))]
        by_position = [
            (index, name) for index, name in self.positions if index < len(args) and _asks_for_cache(args[index])
        ]
        if not by_keyword and not by_position:
            return args, kwargs
        dropped = {*by_keyword, *(name for _, name in by_position)}
        warnings.warn(
            f"lightning_ckpt_determinism: checkpointed `{self.region_class}` regions were called with"
            f" {', '.join(f'`{name}`' for name in _DROPPED if name in dropped)} with grad enabled; they run"
            f" {_WITHOUT[self.reads_cache_only]} (as transformers' own gradient checkpointing does), since"
            " recomputation would fill it a second time. Pass `use_cache=False` when grad is enabled to silence this.",
            LightningCkptDeterminismWarning,
            stacklevel=2,
        )
        if by_position:
            listed = list(args)
            for index, name in by_position:
                listed[index] = _no_cache(name)
            args = tuple(listed)
        if by_keyword:
            kwargs = {**kwargs, **{name: _no_cache(name) for name in by_keyword}}
        return args, kwargs


# What a layer runs without: a cache it fills, or only the filling of one it reads (`_can_checkpoint_with_cache`).
_WITHOUT = {False: "without a key-value cache", True: "with `use_cache=False`, reading the cache they are given"}


def _dropped(reads_cache_only: bool) -> tuple[str, ...]:
    """The arguments a layer runs without: ``use_cache`` and its cache, or ``use_cache`` alone for one that only reads
    its cache."""
    return ("use_cache",) if reads_cache_only else _DROPPED


def _no_cache(name: str) -> Any:
    return False if name == "use_cache" else None
