"""The typed checkpointing configuration, filled from Python or LightningCLI YAML, and the checks of every argument.

The restricted types LightningCLI checks while it parses a config (``PositiveInt`` ...) are jsonargparse's; mypy
sees them as the plain types. Values of them are subclasses of ``int``, ``float`` and ``str``, which the package turns
back into the plain types on construction so that they pickle, save to YAML and compare as users expect. The
``check_*`` helpers validate one argument each, with the package's message shape; the monitor uses them too.
"""

import importlib
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_ckpt_determinism._torch_compat import OpOverload, OpOverloadPacket
from lightning_ckpt_determinism.errors import CheckpointingConfigError

if TYPE_CHECKING:
    NonNegativeFloat = float
    NotEmptyStr = str
    PositiveInt = int
else:
    from jsonargparse.typing import NonNegativeFloat, NotEmptyStr, PositiveInt

__all__ = [
    "CheckpointingConfig",
    "NonNegativeFloat",
    "NotEmptyStr",
    "PositiveInt",
    "check_bool",
    "check_choice",
    "check_non_negative_float",
    "check_positive_int",
    "resolve_class_path",
    "resolve_ops",
]


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool.

    Raises:
        CheckpointingConfigError: Otherwise, naming ``name``.

    Example::

        >>> check_bool("calibrate_noise", True)
        True
    """
    if not isinstance(value, bool):
        raise CheckpointingConfigError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_positive_int(name: str, value: object, *, optional: bool = False, choices: Sequence[str] = ()) -> Any:
    """``value`` as a plain ``int`` if it is an integer >= 1, or ``value`` itself if it is ``None`` (when
    ``optional``) or one of ``choices``; bools are refused.

    Raises:
        CheckpointingConfigError: Otherwise, naming ``name`` and what it may be.

    Example::

        >>> check_positive_int("every_n", 2)
        2
        >>> check_positive_int("reference_regions", "auto", optional=True, choices=("auto",))
        'auto'
    """
    if (optional and value is None) or (isinstance(value, str) and value in choices):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = ["None"] * optional + [repr(choice) for choice in choices] + ["an integer >= 1"]
        said = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise CheckpointingConfigError(f"`{name}` must be {said}, got {value!r}.")
    return int(value)


def check_non_negative_float(name: str, value: object) -> float:
    """``value`` as a plain ``float`` if it is a number >= 0.

    Raises:
        CheckpointingConfigError: Otherwise (NaN included), naming ``name``.

    Example::

        >>> check_non_negative_float("tolerance", 0)
        0.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise CheckpointingConfigError(f"`{name}` must be a non-negative float, got {value!r}.")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    Raises:
        CheckpointingConfigError: Otherwise, naming ``name`` and the choices.

    Example::

        >>> check_choice("on_divergence", "warn", ("warn", "raise", "ignore"))
        'warn'
    """
    if value not in choices:
        raise CheckpointingConfigError(f"`{name}` can be {', '.join(choices)}, got {value!r}.")
    return str(value)


@dataclass(frozen=True)
class CheckpointingConfig:
    """Which submodules to checkpoint and how.

    A module is selected when it matches ``classes`` or ``names``. Only the outermost of nested matches is
    checkpointed, then ``every_n`` thins the selection in module order. The config is frozen (build a changed one with
    ``dataclasses.replace``): regions read it at every call, so a change after wrapping would apply half-way.

    Args:
        classes: Module classes to checkpoint, by bare class name (``"Block"``, matched against the class and its
            bases) or by dotted import path (``"torch.nn.TransformerEncoderLayer"``, matched with ``isinstance``).
        names: ``fnmatch`` globs over module names relative to the module the config is applied to (the
            LightningModule under a strategy), e.g. ``"model.blocks.*"`` or ``"encoder.layers.3"``.
        every_n: Checkpoint every n-th matched module in module order (the n-th, 2n-th, ...). ``1`` checkpoints
            all of them; ``2`` every second one, trading half the memory saving for half the recomputation.
        save_ops: Op-level selective checkpointing: ops whose outputs are kept instead of recomputed, as
            ``"aten.mm"`` (every overload) or ``"aten.mm.default"`` (one overload). Saving matmuls keeps the
            expensive results and recomputes only the cheap pointwise ops, at the cost of their memory.
        preserve_rng_state: Replay torch's CPU and accelerator RNG during recomputation (torch's own mechanism).
            Turning it off saves a little time and makes dropout masks differ between forward and recomputation.
        preserve_host_rng: Also capture Python's ``random`` and NumPy's global RNG at the original forward and
            replay them during recomputation, leaving the live streams exactly where they were. Needed by custom
            layers that draw from NumPy or ``random``; costs one state copy per checkpointed call.
        protect_buffers: Recomputation never mutates module buffers: BatchNorm running statistics and
            ``num_batches_tracked`` are updated once per step, as without checkpointing. Costs a copy of the
            region's buffers while it is recomputed (nothing for regions without buffers). Recomputation reads the
            buffers as they are then: a buffer the forward both updates and reads (a step count) is seen updated,
            which the check reports as ``python_state``; BatchNorm in training mode does not read its statistics.
        determinism_check: torch's check of recomputed tensors (``"default"`` compares their shapes, dtypes and
            devices and raises torch's ``CheckpointError`` on a difference; ``"none"`` skips it). The monitor's
            sentinel compares values in both cases; with ``"none"`` a difference of metadata is counted as a mismatch
            rather than raised.
        keep_data_dependent: Keep the outputs of ops that decide shapes or routing (``topk``, ``sort``,
            ``nonzero``, ``bincount``, ``.item()`` ...: torch's ``dynamic_output_shape`` and
            ``data_dependent_output`` tags plus a fixed list) from the forward and serve them to recomputation, so
            that router logits that come out a few ulps different in recomputation cannot flip a top-k choice and
            change which tokens go to which expert. Integer and boolean outputs are always kept; floating ones
            (``topk``'s values) when they hold at most as many elements as the region's largest input, else the op
            is recomputed and the audit lists it as not kept. Installed only in regions where such an op runs in
            their first checkpointed forward (which is already guarded), or later in a forward a check observes;
            others pay nothing. ``False`` recomputes them, to let the check show how sensitive the routing is.

    Raises:
        CheckpointingConfigError: If nothing can be selected, a list field is given a string or holds anything but
            strings, a switch is not a bool, ``every_n < 1``, a class path or op cannot be found, or
            ``determinism_check`` is not one torch knows.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> config = CheckpointingConfig(classes=["Block"], every_n=2, save_ops=["aten.mm"])
        >>> config.every_n
        2
    """

    classes: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    every_n: PositiveInt = 1
    save_ops: list[str] = field(default_factory=list)
    preserve_rng_state: bool = True
    preserve_host_rng: bool = False
    protect_buffers: bool = True
    determinism_check: Literal["default", "none"] = "default"
    keep_data_dependent: bool = True

    def __post_init__(self) -> None:
        for name in ("classes", "names", "save_ops"):
            value = getattr(self, name)
            if isinstance(value, str):
                # `list("Block")` would silently select classes named "B", "l", ...
                raise CheckpointingConfigError(f"`{name}` must be a list of strings, got {value!r}; use [{value!r}].")
            wrong = [entry for entry in value if not isinstance(entry, str)]
            if wrong:
                # A class or an op object would fail later, far from the config, with a TypeError or AttributeError.
                raise CheckpointingConfigError(
                    f"`{name}` must be a list of strings, got the entry {wrong[0]!r} ({type(wrong[0]).__name__});"
                    " write classes as names or dotted paths and ops as 'aten.mm'."
                )
        for name in ("preserve_rng_state", "preserve_host_rng", "protect_buffers", "keep_data_dependent"):
            check_bool(name, getattr(self, name))
        for name in ("classes", "names", "save_ops"):
            object.__setattr__(self, name, list(getattr(self, name)))
        if not self.classes and not self.names:
            raise CheckpointingConfigError(
                "`CheckpointingConfig` selects nothing: set `classes` (e.g. ['Block']) or `names`"
                " (e.g. ['model.blocks.*'])."
            )
        # LightningCLI hands jsonargparse's `PositiveInt`; a plain int saves to YAML and pickles anywhere.
        object.__setattr__(self, "every_n", check_positive_int("every_n", self.every_n))
        allowed_checks = ["default", "none"]
        if self.determinism_check not in allowed_checks:
            raise CheckpointingConfigError(
                f"`determinism_check` can be one of {allowed_checks}, got {self.determinism_check!r}."
            )
        for path in self.classes:
            if "." in path:
                resolve_class_path(path)
        resolve_ops(self.save_ops)

    def __hash__(self) -> int:
        # By value, as `==` compares: equal configs checkpoint alike (and share their compiled graphs' notes).
        return hash(tuple(tuple(value) if isinstance(value, list) else value for value in astuple(self)))


def resolve_class_path(path: str) -> type:
    """Import a class from its dotted path.

    Args:
        path: A dotted path such as ``"torch.nn.TransformerEncoderLayer"``.

    Returns:
        The class.

    Raises:
        CheckpointingConfigError: If the module cannot be imported or holds no class of that name.

    Example::

        >>> resolve_class_path("torch.nn.Linear")
        <class 'torch.nn.modules.linear.Linear'>
    """
    module_path, _, class_name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as err:
        raise CheckpointingConfigError(
            f"`classes` entry {path!r} cannot be imported ({err}). Use a bare class name such as"
            f" {class_name!r} or a dotted path to an importable class."
        ) from err
    if not isinstance(found, type):
        raise CheckpointingConfigError(f"`classes` entry {path!r} is not a class, got {type(found).__name__}.")
    return found


def resolve_ops(names: list[str]) -> list[OpOverload]:
    """Turn op names into the op overloads that selective checkpointing matches.

    Args:
        names: Op names such as ``"aten.mm"`` (every overload) or ``"aten.addmm.default"`` (one overload).

    Returns:
        The op overloads, in order, without duplicates.

    Raises:
        CheckpointingConfigError: If a name does not name an op torch knows.

    Example::

        >>> resolve_ops(["aten.mm.default"])
        [<OpOverload(op='aten.mm', overload='default')>]
    """
    resolved: list[OpOverload] = []
    for name in names:
        for op in _resolve_op(name):
            if op not in resolved:
                resolved.append(op)
    return resolved


def _resolve_op(name: str) -> list[OpOverload]:
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is not an op name: use 'namespace.op' or 'namespace.op.overload',"
            " e.g. 'aten.mm' or 'aten.mm.default'."
        )
    namespace, op_name = parts[0], parts[1]
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError) as err:
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is not an op torch knows. Check the spelling against `torch.ops.{namespace}`"
            " (e.g. 'aten.mm', 'aten.addmm', 'aten._scaled_dot_product_flash_attention')."
        ) from err
    if not isinstance(packet, OpOverloadPacket):
        raise CheckpointingConfigError(f"`save_ops` entry {name!r} is not an op, got {type(packet).__name__}.")
    if len(parts) == 2:
        return [getattr(packet, overload) for overload in packet.overloads()]
    try:
        return [getattr(packet, parts[2])]
    except AttributeError as err:
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} names an unknown overload; {namespace}.{op_name} has {packet.overloads()}."
        ) from err
