"""Which submodules a config selects (classes, name globs, ``every_n``), the diagnostics of a miss, and applying it."""

import difflib
import fnmatch
import re
import warnings
from collections.abc import Mapping

from torch import nn

from lightning_ckpt_determinism.checkpointing.auto import auto_layers
from lightning_ckpt_determinism.checkpointing.kv_cache import switch_off_kv_caches
from lightning_ckpt_determinism.checkpointing.modules import named_modules
from lightning_ckpt_determinism.checkpointing.wrapper import checkpoint_module, checkpointing_config, is_checkpointed
from lightning_ckpt_determinism.config import (
    AUTO_CLASSES,
    CheckpointingConfig,
    class_entries,
    entry_shown,
    resolve_class_path,
)
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    CheckpointingTypeError,
    LightningCkptDeterminismWarning,
)

__all__ = ["apply_activation_checkpointing", "checkpoint_selected", "select_modules"]


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
            names), if a ``names`` entry matches only containers without a forward (``ModuleList``), or if
            ``every_n`` exceeds the number of matched modules.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
        >>> list(select_modules(model, CheckpointingConfig(classes=["Linear"], every_n=2)))
        ['1', '3']
    """
    return _select(module, config)[0]


def _select(module: nn.Module, config: CheckpointingConfig) -> tuple[dict[str, nn.Module], set[str]]:
    """:func:`select_modules`' selection, and the names of every module ``config`` names by its own entries (not only
    as checkpointed already), selected or not."""
    paths = class_entries(config)  # the config stores classes as paths
    chosen = set(auto_layers(module).names) if config.classes == AUTO_CLASSES else set()
    bare_names = {path for path in paths if "." not in path}
    dotted = {path: resolve_class_path(path) for path in paths if "." in path}
    classes = tuple(dotted.values())
    wrapped_names = [name for name, sub in named_modules(module) if is_checkpointed(sub)]

    _refuse_containers(module, config)

    def named(name: str, sub: nn.Module) -> bool:
        if name in chosen or isinstance(sub, classes) or any(base.__name__ in bare_names for base in type(sub).__mro__):
            return True
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in config.names)

    def matches(name: str, sub: nn.Module) -> bool:
        if is_checkpointed(sub):
            return True
        if not _callable(sub) or any(wrapped.startswith(name + ".") for wrapped in wrapped_names):
            return False
        return named(name, sub)

    matched: list[tuple[str, nn.Module]] = []
    for name, sub in named_modules(module):
        if not name or any(name.startswith(outer + ".") for outer, _ in matched):
            continue
        if matches(name, sub):
            matched.append((name, sub))
    if not matched:
        raise CheckpointingConfigError(_nothing_matched_message(module, config))
    _warn_unused_entries(module, config, bare_names, dotted)
    if len(matched) < config.every_n:
        # Otherwise nothing would be checkpointed and training would run silently without it.
        raise CheckpointingConfigError(
            f"`every_n`={config.every_n} selects none of the {len(matched)} matched modules of"
            f" {type(module).__name__} ({[name for name, _ in matched]}). Use an `every_n` of at most {len(matched)}."
        )
    selected = {name: sub for index, (name, sub) in enumerate(matched) if (index + 1) % config.every_n == 0}
    return selected, {name for name, sub in named_modules(module) if name and _callable(sub) and named(name, sub)}


def _callable(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own: a container (``ModuleList``, ``ModuleDict``) is never called."""
    return type(module).forward is not nn.Module.forward


def _refuse_containers(module: nn.Module, config: CheckpointingConfig) -> None:
    """Refuse a ``names`` entry that matches only containers, which would checkpoint nothing."""
    for pattern in config.names:
        found = [(name, sub) for name, sub in named_modules(module) if name and fnmatch.fnmatchcase(name, pattern)]
        if found and not any(_callable(sub) for _, sub in found):
            name, sub = found[0]
            raise CheckpointingConfigError(
                f"`names` entry {pattern!r} matches `{name}`, a {type(sub).__name__}, which has no forward of its own"
                f" and is never called: checkpointing it would checkpoint nothing. Select the modules it holds, as"
                f" {name + '.*'!r}."
            )


def apply_activation_checkpointing(module: nn.Module, config: CheckpointingConfig) -> list[str]:
    """Checkpoint the submodules of ``module`` that ``config`` selects, in place, always non-reentrant.

    Nothing is replaced: parameter names, buffer names and ``state_dict`` keys do not change, so checkpoints load
    with ``strict=True`` with or without checkpointing. Forward keyword arguments and any outputs (tuples, dicts,
    non-tensors) pass through. Applying the same config twice wraps nothing twice. Under ``torch.no_grad()`` and
    inside :func:`~lightning_ckpt_determinism.checkpointing_disabled` a wrapped module runs its plain forward.

    A region inside a Hugging Face transformers model runs without its key-value cache while training: the model's
    ``config.use_cache`` is set to ``False`` (one info line) until
    :func:`~lightning_ckpt_determinism.remove_activation_checkpointing` removes the last such region, and a cache
    passed to a region in training is dropped (see :mod:`~lightning_ckpt_determinism.checkpointing.kv_cache`).
    A region with another activation checkpointing inside or around it (transformers'
    ``gradient_checkpointing_enable()``, torch's ``CheckpointWrapper``) is warned at its first forward.

    Args:
        module: The root module; ``config.names`` are relative to it.
        config: What to checkpoint and how.

    Returns:
        The names of the checkpointed modules, in module order.

    Raises:
        CheckpointingConfigError: If ``config`` matches no module, ``every_n`` skips every match, or a module it
            selects is checkpointed already with another config, or it would wrap nothing new because the modules it
            names sit inside or around such modules (nothing is wrapped then: call
            :func:`~lightning_ckpt_determinism.remove_activation_checkpointing` first).
        CheckpointingTypeError: If ``config`` is not a ``CheckpointingConfig``.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
        >>> apply_activation_checkpointing(model, CheckpointingConfig(classes=["torch.nn.Linear"]))
        ['0', '2']
        >>> list(model.state_dict())
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    if not isinstance(config, CheckpointingConfig):
        raise CheckpointingTypeError(
            f"`config` must be a `CheckpointingConfig`, got {type(config).__name__}: build one with"
            " `CheckpointingConfig(classes=[...])` (`CheckpointingConfig(**mapping)` from a mapping)."
        )
    selected, named = _select(module, config)
    # A module checkpointed before counts as selected; one this config names itself would keep the other config. So
    # would one inside or around a module it names (selection skips that module), where nothing else is new to wrap.
    other = [
        name for name, sub in selected.items() if name in named and checkpointing_config(sub) not in (None, config)
    ]
    if not other and all(checkpointing_config(sub) not in (None, config) for sub in selected.values()):
        other = [
            name
            for name, sub in named_modules(module)
            if checkpointing_config(sub) not in (None, config)
            and any(name.startswith(f"{own}.") or own.startswith(f"{name}.") for own in named)
        ]
    if other:
        listed = ", ".join(f"`{name}`" for name in other[:4]) + (" ..." if len(other) > 4 else "")
        raise CheckpointingConfigError(
            f"{listed} {'is' if len(other) == 1 else 'are'} checkpointed already with another `CheckpointingConfig`,"
            " which applying this one would not change: call `remove_activation_checkpointing(model)` first, then"
            " apply this one."
        )
    checkpoint_selected(module, selected, config)
    return list(selected)


def checkpoint_selected(root: nn.Module, selected: Mapping[str, nn.Module], config: CheckpointingConfig) -> None:
    """Checkpoint each module of ``selected`` under its name, then turn off the transformers caches around them.

    Args:
        root: The module they were selected in, where transformers models are looked for.
        selected: The modules by region name, as :func:`select_modules` gives them.
        config: How to checkpoint them.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> config = CheckpointingConfig(classes=["Linear"])
        >>> checkpoint_selected(model, select_modules(model, config), config)
        >>> is_checkpointed(model[0])
        True
    """
    for name, sub in selected.items():
        if not is_checkpointed(sub):  # one checkpointed before keeps its config (callers refuse or accept it)
            checkpoint_module(sub, name, config)
    switch_off_kv_caches(root, selected.values())


def _nothing_matched_message(module: nn.Module, config: CheckpointingConfig) -> str:
    class_names = sorted({type(sub).__name__ for _, sub in named_modules(module)})
    module_names = [name for name, _ in named_modules(module) if name]
    sample = module_names[:12] + (["..."] if len(module_names) > 12 else [])
    meant = (
        _root_named(module, config)
        + _did_you_mean(class_entries(config), class_names)
        + _names_meant(module_names, config.names)
    )
    if config.classes == AUTO_CLASSES and not config.names:
        meant += (
            " `classes=auto` (what a strategy given by name, such as 'ddp_checkpointing', uses) finds transformer"
            " layers only: name the blocks to checkpoint with `classes=[...]` (one of the classes below) or"
            " `names=[...]` (globs of the names below)."
        )
    return (
        f"`CheckpointingConfig` matches no module of {type(module).__name__}:"
        f" classes={_classes_shown(module, config)},"
        f" names={config.names}.{meant} The model's module classes are {class_names}; its module names include"
        f" {sample}. Names are relative to the module the config is applied to (the LightningModule under a"
        f" strategy)."
    )


def _root_named(module: nn.Module, config: CheckpointingConfig) -> str:
    """A sentence for a class entry that names the module the config is applied to, which is never a region."""
    own = {base.__name__ for base in type(module).__mro__} | {f"{type(module).__module__}.{type(module).__qualname__}"}
    if not any(entry in own for entry in class_entries(config)):
        return ""
    return (
        f" {type(module).__name__} is the module the config is applied to, never a region itself: name the blocks"
        " inside it."
    )


def _names_meant(module_names: list[str], patterns: list[str]) -> str:
    """`` Did you mean 'model.blocks.*' for 'blocks.*'?`` for each pattern that matches as a module name's tail
    (under a top-level child), without its leading names (``model.blocks.*`` where the config is applied to the model
    itself), with a misspelt name respelt (``blokcs.*``) or with Python's indexing written as names are (``blocks[0]``
    for ``blocks.0``)."""
    children = list(dict.fromkeys(name.split(".")[0] for name in module_names))
    words = sorted({word for name in module_names for word in name.split(".")})
    meant = []
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(name, pattern) for name in module_names):
            continue
        dotted = re.sub(r"\[(\d+)\]", r".\1", pattern)
        tried = [dotted, *(f"{child}.{dotted}" for child in children)]
        if not _REGEX_SYNTAX.search(pattern):  # a regular expression is told so below, not respelt
            tails = [dotted.split(".", depth)[-1] for depth in range(1, dotted.count(".") + 1)]
            tried += [_respelt(dotted, words), *(tail for tail in tails if any(map(_is_a_name, tail.split("."))))]
        found = next((p for p in tried if any(fnmatch.fnmatchcase(name, p) for name in module_names)), None)
        if found is not None:
            meant.append(f" Did you mean {found!r} for {pattern!r}?")
        elif _REGEX_SYNTAX.search(pattern):
            glob = _as_glob(pattern)
            fits = any(fnmatch.fnmatchcase(name, glob) for name in module_names)
            meant.append(
                f" Names are globs (`*`, `?`, `[0-9]`), not regular expressions: did you mean {glob!r} for {pattern!r}?"
                if fits
                else f" Names are globs (`*`, `?`, `[0-9]`), not regular expressions ({pattern!r})."
            )
        else:
            meant.append(_out_of_range(module_names, dotted, pattern))
    return "".join(meant)


def _out_of_range(module_names: list[str], dotted: str, pattern: str) -> str:
    """`` 'blocks' holds 0 to 11: 'blocks.12' is past its last.`` where ``dotted`` indexes a container past its
    children; else nothing."""
    head, _, index = dotted.rpartition(".")
    if not index.isdigit() or head not in module_names:
        return ""
    children = (name.rpartition(".") for name in module_names)
    held = sorted(int(child) for parent, _, child in children if parent == head and child.isdigit())
    if not held:
        return ""
    return f" {head!r} holds {held[0]} to {held[-1]}: {pattern!r} is past its last."


def _respelt(pattern: str, words: list[str]) -> str:
    """``pattern`` with each name in it (not an index, not a glob) that no module name holds replaced by the closest
    one that does."""
    return ".".join(
        next(iter(difflib.get_close_matches(part, words, n=1)), part)
        if _is_a_name(part) and part not in words
        else part
        for part in pattern.split(".")
    )


def _is_a_name(part: str) -> bool:
    """Whether ``part`` of a dotted pattern is a literal attribute name (``blocks``), not an index or a glob."""
    return part.isidentifier()


# What only a regular expression writes: a class escape, an escaped dot, a repeat, an anchor, a group or alternation.
_REGEX_SYNTAX = re.compile(r"\\[dDwWsS.]|[+^$|()]")


def _as_glob(pattern: str) -> str:
    """The glob a regular expression of module names most likely means (``model\\.blocks\\.\\d+`` to
    ``model.blocks.*``)."""
    glob = re.sub(r"\\[dw][+*]|\.\+", "*", pattern.strip("^$"))
    glob = re.sub(r"\\d", "[0-9]", glob)
    return glob.replace("\\.", ".")


def _did_you_mean(entries: list[str], class_names: list[str]) -> str:
    """`` Did you mean 'ConvBlock' for 'ConvBlok'?`` for each bare class name close to one of the model's."""
    close = [
        (entry, found[0])
        for entry in entries
        if "." not in entry and entry not in class_names
        for found in [difflib.get_close_matches(entry, class_names, n=1)]
        if found
    ]
    return "".join(f" Did you mean {right!r} for {wrong!r}?" for wrong, right in close)


def _classes_shown(module: nn.Module, config: CheckpointingConfig) -> str:
    if config.classes == AUTO_CLASSES:
        return f"auto (found {auto_layers(module).reason})"
    return str([entry_shown(entry) for entry in config.classes])


def _warn_unused_entries(
    module: nn.Module, config: CheckpointingConfig, bare_names: set[str], dotted: dict[str, type]
) -> None:
    named = [(name, sub) for name, sub in named_modules(module) if name]
    seen_class_names = {base.__name__ for _, sub in named for base in type(sub).__mro__}
    unused = [name for name in sorted(bare_names) if name not in seen_class_names]
    unused += [entry_shown(path) for path, cls in dotted.items() if not any(isinstance(sub, cls) for _, sub in named)]
    patterns = [pattern for pattern in config.names if not any(fnmatch.fnmatchcase(n, pattern) for n, _ in named)]
    unused += patterns
    if unused:
        meant = _did_you_mean(unused, sorted(seen_class_names)) + _names_meant([name for name, _ in named], patterns)
        warnings.warn(
            f"lightning_ckpt_determinism: `CheckpointingConfig` entries {unused} match no module of"
            f" {type(module).__name__}; check their spelling.{meant}",
            LightningCkptDeterminismWarning,
            stacklevel=3,
        )
