"""The typed checkpointing configuration, filled from Python or LightningCLI YAML, and the checks of every argument.

The ``check_*`` helpers validate one argument each, with the package's message shape; the monitor uses them too. A
mistake reads the same from Python and from YAML: the types that say in LightningCLI's ``--help`` what a field
takes (``PositiveInt``, ``NonNegativeFloat``, ``NotEmptyStr``) are registered with jsonargparse to hand every value
over to the constructor (a number given as a string on the command line converted), and the constructor's check
gives the message, which ``CheckpointingCLI`` prefixes with the field's key. mypy sees them as the plain types.
"""

import contextlib
import difflib
import importlib
import math
import numbers
import pickle
import pkgutil
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

import torch
from jsonargparse.typing import register_type
from torch import nn

from lightning_ckpt_determinism._torch_compat import (
    OpOverload,
    OpOverloadPacket,
    in_place_overload,
    random_only_through_dropout_p,
    returns_what_it_wrote,
    writes_its_arguments,
)
from lightning_ckpt_determinism.checkpointing.routing import is_random_op
from lightning_ckpt_determinism.errors import CheckpointingConfigError, LightningCkptDeterminismWarning

__all__ = [
    "AUTO_CLASSES",
    "BUDGET_COSTS",
    "BUDGET_GRANULARITIES",
    "RECOMPUTE_SWITCHES",
    "CheckpointingConfig",
    "NonNegativeFloat",
    "NotEmptyStr",
    "PositiveInt",
    "check_bool",
    "check_choice",
    "check_metric_prefix",
    "check_non_negative_float",
    "check_positive_int",
    "choice_message",
    "class_entries",
    "class_name",
    "class_path_meant",
    "parse_memory_budget",
    "resolve_class_path",
    "resolve_ops",
]

AUTO_CLASSES = "auto"
"""``CheckpointingConfig(classes="auto")``: the model's transformer layers, chosen at setup."""


def _handed_over(base: type, convert: Callable[[str], Any] | None) -> Callable[[Any], Any]:
    """What jsonargparse hands the constructor for a value not of ``base``: ``convert(value)`` for a string that
    spells a ``base`` (the command line gives strings), else the value itself, for the constructor to refuse."""

    def hand_over(value: Any) -> Any:
        if convert is not None and isinstance(value, str):
            with suppress(ValueError):
                return convert(value)
        return value

    return hand_over


def _field_type(name: str, base: type, convert: Callable[[str], Any] | None, doc: str) -> type:
    """A subclass of ``base`` named ``name`` for ``--help``, registered with jsonargparse to check nothing itself."""
    type_ = type(name, (base,), {"__doc__": doc, "__module__": __name__})
    register_type(
        type_,
        serializer=lambda value: value,
        deserializer=_handed_over(base, convert),
        type_check=lambda value, _: isinstance(value, base) and not isinstance(value, bool),
    )
    return type_


if TYPE_CHECKING:
    NonNegativeFloat = float
    NotEmptyStr = str
    PositiveInt = int
else:
    PositiveInt = _field_type("PositiveInt", int, int, "An integer >= 1, checked by the constructor that takes it.")
    NonNegativeFloat = _field_type(
        "NonNegativeFloat", float, float, "A number >= 0, checked by the constructor that takes it."
    )
    NotEmptyStr = _field_type("NotEmptyStr", str, None, "A non-empty string, checked by the constructor that takes it.")


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
    # `numbers.Integral` takes NumPy's integers too (a sweep's `np.int64(2)`); a bool is refused, though an int.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = ["None"] * optional + [repr(choice) for choice in choices] + ["an integer >= 1"]
        said = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise CheckpointingConfigError(f"`{name}` must be {said}, got {value!r}.")
    return int(value)


def check_non_empty_str(name: str, value: object) -> str:
    """``value`` as a plain ``str`` if it is a non-empty string.

    Raises:
        CheckpointingConfigError: Otherwise, naming ``name``.

    Example::

        >>> check_non_empty_str("log_prefix", "recompute")
        'recompute'
    """
    if not isinstance(value, str) or not value:
        raise CheckpointingConfigError(f"`{name}` must be a non-empty string, got {value!r}.")
    return str(value)


def check_metric_prefix(name: str, value: object) -> str:
    """``value`` as a plain ``str`` if it is a non-empty string that neither starts nor ends with ``/`` (metric names
    join it to theirs with one).

    Raises:
        CheckpointingConfigError: Otherwise, naming ``name``.

    Example::

        >>> check_metric_prefix("log_prefix", "train/recompute")
        'train/recompute'
    """
    prefix = check_non_empty_str(name, value)
    if prefix.startswith("/") or prefix.endswith("/"):
        raise CheckpointingConfigError(
            f"`{name}` must not start or end with '/', got {prefix!r}: metrics are named `{name}/grad_divergence`;"
            f" write {prefix.strip('/')!r}."
        )
    return prefix


def check_non_negative_float(name: str, value: object) -> float:
    """``value`` as a plain ``float`` if it is a finite number >= 0.

    Raises:
        CheckpointingConfigError: Otherwise (NaN and infinity included), naming ``name``.

    Example::

        >>> check_non_negative_float("tolerance", 0)
        0.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) >= 0.0:
        raise CheckpointingConfigError(f"`{name}` must be a non-negative float, got {value!r}.")
    if math.isinf(float(value)):
        raise CheckpointingConfigError(
            f"`{name}` must be a finite non-negative float, got {value!r}: an infinite `{name}` counts every"
            " difference as equal, so nothing could ever be found."
        )
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
        raise CheckpointingConfigError(choice_message(name, value, choices))
    return str(value)


def choice_message(name: str, value: object, choices: Sequence[object]) -> str:
    """The message for ``value`` given to ``name``, which takes one of ``choices``; ``CheckpointingCLI`` gives it for
    a ``Literal`` that LightningCLI refuses, with the field's key as ``name``.

    Example::

        >>> choice_message("sentinel", "always", ("sampled", "exact", "off"))
        "`sentinel` can be sampled, exact, off, got 'always'."
    """
    meant = [choice for choice in ("none", "off") if value is None and choice in choices]
    quoted = f" (a string: write {meant[0]!r})" if meant else ""
    return f"`{name}` can be {', '.join(str(choice) for choice in choices)}, got {value!r}{quoted}."


_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[A-Za-z]+)?\s*$")


def parse_memory_budget(value: object) -> int | float | str | None:
    """``memory_budget`` in the form the planner reads: an ``int`` of bytes, a ``float`` fraction in (0, 1] of what
    the matched modules keep without checkpointing, ``"auto"``, or ``None``.

    Strings with a unit are bytes (``"512MiB"``, ``"2GB"``, ``"1.5GiB"``; ``KB``, ``MB``, ``GB``, ``TB`` are powers of
    1000, ``KiB`` ... ``TiB`` of 1024, ``B`` is bytes), ``"50%"`` is a fraction, and a string without a unit reads as
    the number it spells (the command line hands ``--...memory_budget=0.5`` over as a string).

    Args:
        value: What the config was given.

    Raises:
        CheckpointingConfigError: For 0, negatives, fractions above 1, unknown units, bools and anything that is
            not a size, naming ``memory_budget``.

    Example::

        >>> parse_memory_budget("1.5GiB"), parse_memory_budget("50%"), parse_memory_budget(0.25)
        (1610612736, 0.5, 0.25)
    """
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if value in _NONE_SPELT:
        return None
    if isinstance(value, str):
        return _parse_size_string(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointingConfigError(f"`memory_budget` must be a size, got {value!r}; {_BUDGET_FORMS}")
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise CheckpointingConfigError(f"`memory_budget` must be more than 0 bytes, got {value!r}.")
        return int(value)
    if not 0.0 < float(value) <= 1.0:
        raise CheckpointingConfigError(
            f"`memory_budget` as a fraction must be in (0, 1], got {value!r}; give bytes as an int or with a unit."
        )
    return float(value)


BUDGET_GRANULARITIES = ("module", "op")
"""What ``CheckpointingConfig.budget_granularity`` takes: the units a ``memory_budget`` chooses between."""

BUDGET_COSTS = ("roofline", "calibrated", "flops")
"""What ``CheckpointingConfig.budget_cost`` takes: the cost models a ``memory_budget`` plans its recomputation in."""

_BUDGET_FORMS = "give bytes (1073741824, '512MiB', '2GB'), a fraction in (0, 1] (0.5, '50%'), 'auto' or None."


def _parse_size_string(value: str) -> int | float:
    found = _SIZE.match(value)
    if found is None and value.strip().lower() in ("none", "off", "no", "false"):
        # `determinism_check: none` is a string; no budget is YAML's null.
        raise CheckpointingConfigError(
            f"`memory_budget` {value!r} is not a size: for no budget write `null` (`None` in Python), or leave it out."
        )
    if found is None:
        raise CheckpointingConfigError(f"`memory_budget` {value!r} is not a size; {_BUDGET_FORMS}")
    number, unit = found.groups()
    if unit is None:
        return parse_memory_budget(float(number) if "." in number else int(number))  # type: ignore[return-value]
    if unit == "%":
        if not 0.0 < float(number) <= 100.0:
            raise CheckpointingConfigError(f"`memory_budget` as a percentage must be in (0, 100], got {value!r}.")
        return float(number) / 100.0
    if unit not in _SIZE_UNITS:
        raise CheckpointingConfigError(
            f"`memory_budget` {value!r} has an unknown unit {unit!r}; use one of {', '.join(_SIZE_UNITS)} or %."
        )
    size = int(float(number) * _SIZE_UNITS[unit])
    if size <= 0 < float(number):
        raise CheckpointingConfigError(
            f"`memory_budget` {value!r} is less than a byte: give at least 1 byte, or a fraction without a unit"
            " (0.5, '50%')."
        )
    if size <= 0:
        raise CheckpointingConfigError(f"`memory_budget` must be more than 0 bytes, got {value!r}.")
    return size


_NONE_SPELT = ("None", "null")
"""``None`` as the command line may hand it over: jsonargparse passes ``--...memory_budget=null`` on as the string
``'None'`` where it overrides a field of a strategy's nested config."""


def check_memory_budget(value: object, every_n: int) -> int | float | str | None:
    """``memory_budget`` checked and as plain types: a number spelt as a string without a unit becomes that number,
    a string with a unit stays as written (so a saved config reads as it was given).

    Args:
        value: What the config was given.
        every_n: The config's ``every_n``, which a budget cannot be combined with.

    Raises:
        CheckpointingConfigError: If :func:`parse_memory_budget` refuses ``value``, or a budget comes with
            ``every_n > 1``.

    Example::

        >>> check_memory_budget("0.5", every_n=1), check_memory_budget("512MiB", every_n=1)
        (0.5, '512MiB')
    """
    parsed = parse_memory_budget(value)
    if parsed is not None and every_n > 1:
        raise CheckpointingConfigError(
            f"`memory_budget` chooses which matched modules to checkpoint and cannot be combined with"
            f" `every_n`={every_n}; set `every_n` to 1 or remove `memory_budget`."
        )
    if isinstance(value, str) and (parsed is None or (value != "auto" and _unit_of(value) is None)):
        return parsed
    return str(value) if isinstance(value, str) else parsed


def _unit_of(size: str) -> str | None:
    found = _SIZE.match(size)
    return found.group(2) if found is not None else None


@dataclass(frozen=True)
class CheckpointingConfig:
    """Which submodules to checkpoint and how.

    A module is selected when it matches ``classes`` or ``names``. Only the outermost of nested matches is
    checkpointed, then ``every_n`` thins the selection in module order. The config is frozen (build a changed one with
    ``dataclasses.replace``): regions read it at every call, so a change after wrapping would apply half-way.

    Args:
        classes: Module classes to checkpoint, by bare class name (``"Block"``, matched against the class and its
            bases), by dotted import path (``"torch.nn.TransformerEncoderLayer"``, matched with ``isinstance``) or,
            in Python, as the class itself (``[GPT2Block]``), matched with ``isinstance`` and stored as its dotted
            path so that the config saves and pickles. A class that cannot be imported by its path (one defined
            inside a function) is matched in this process but cannot be pickled, which ``strategy="ddp_spawn"``
            needs: it is warned once. ``"auto"`` (not a list: YAML ``classes: auto``) chooses a model's transformer
            layers: transformers' ``GradientCheckpointingLayer`` subclasses where the model has them (what
            ``gradient_checkpointing_enable()`` checkpoints), else the modules of its largest ``nn.ModuleList`` of one
            class (:func:`~lightning_ckpt_determinism.checkpointing.auto.auto_layers`); the setup line names the
            choice.
        names: ``fnmatch`` globs over module names relative to the module the config is applied to (the
            LightningModule under a strategy), e.g. ``"model.blocks.*"`` or ``"encoder.layers.3"``.
        every_n: Checkpoint every n-th matched module in module order (the n-th, 2n-th, ...). ``1`` checkpoints
            all of them; ``2`` every second one, trading half the memory saving for half the recomputation.
        save_ops: Op-level selective checkpointing: ops whose outputs are kept instead of recomputed, as
            ``"aten.mm"`` (every overload) or ``"aten.mm.default"`` (one overload). Saving matmuls keeps the
            expensive results and recomputes only the cheap pointwise ops, at the cost of their memory. An op whose
            output a later op writes in place cannot be kept (torch refuses it in backward: "Tensor cached during
            selective activation checkpoint has been mutated"): an ``addmm`` before an in-place ReLU, or CPU
            dropout's ``empty_like``, ``bernoulli_`` and ``div_``; the memory budget never keeps such an output. A
            composite op (``aten.matmul``, ``aten.linear``) is refused, naming the ops autograd runs for it
            (``aten.mm``, ``aten.addmm``): checkpointing never sees it.
        preserve_rng_state: Replay torch's CPU and accelerator RNG during recomputation (torch's own mechanism).
            Turning it off saves a little time and makes dropout masks differ between forward and recomputation.
        preserve_host_rng: Also capture Python's ``random`` and NumPy's global RNG, and the NumPy and ``random``
            generators the region's modules hold as attributes, at the original forward and replay them during
            recomputation, leaving the live streams exactly where they were. Needed by custom layers that draw from
            NumPy or ``random``; costs one state copy per stream per checkpointed call.
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
        memory_budget: The most activation memory the matched modules may keep for backward in one training step;
            a memory budget chooses which of them to checkpoint, with the least recomputation that fits. An int is
            bytes; a string with a unit is bytes (``"512MiB"``, ``"2GB"``, ``"1.5GiB"``, ``"300KiB"``); a float in
            (0, 1] or a string such as ``"50%"`` is a fraction of what the matched modules keep without
            checkpointing. ``"auto"`` (CUDA only) fits the free memory. The strategies measure every match,
            checkpointed, in the first training step and apply the plan from the second one on;
            ``plan_activation_checkpointing`` does the same in plain PyTorch. ``None`` checkpoints every match,
            thinned by ``every_n``, which a budget cannot be combined with.
        budget_granularity: What a ``memory_budget`` chooses between: ``"module"`` (whole candidates, plain or
            checkpointed) or ``"op"`` (for each candidate, plain or checkpointed keeping a chosen set of its op
            outputs, chosen per op call with the least recompute cost in a roofline model; eager regions only, a
            compiled region is checkpointed whole). Needs a ``memory_budget``.
        budget_cost: The recompute cost a ``memory_budget`` minimises, at either granularity: ``"roofline"`` (each op
            call costs ``max(FLOPs / FLOP rate, bytes moved / bandwidth)`` at fixed rates, 100 TFLOP/s and 2 TB/s, so
            that elementwise ops, norms and softmax count; plans are the same from run to run and machine to
            machine), ``"calibrated"`` (the same at the two rates measured once on the device by a short calibration,
            a matrix product and a large copy; timings are noise, so a plan may differ from run to run; under a
            strategy the ranks' rates are reduced to their minimum, so that every rank plans alike) or ``"flops"``
            (the FLOP count alone, as module granularity counted before: elementwise ops cost 0). Needs a
            ``memory_budget``.

    Raises:
        CheckpointingConfigError: If nothing can be selected, a list field is given a string or holds anything but
            strings (``classes`` also takes classes), a switch is not a bool, ``every_n < 1``, a class path or op
            cannot be found, ``determinism_check`` is not one torch knows, or ``memory_budget`` is not a size (or
            comes with ``every_n > 1``), or ``budget_granularity`` is neither ``"module"`` nor ``"op"`` (or is
            ``"op"`` without a ``memory_budget``), or ``budget_cost`` is not one of its choices (or is not the default
            without a ``memory_budget``).

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> config = CheckpointingConfig(classes=["Block"], every_n=2, save_ops=["aten.mm"])
        >>> config.every_n
        2
    """

    classes: list[str | type] | Literal["auto"] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    every_n: PositiveInt = 1
    save_ops: list[str] = field(default_factory=list)
    preserve_rng_state: bool = True
    preserve_host_rng: bool = False
    protect_buffers: bool = True
    determinism_check: Literal["default", "none"] = "default"
    keep_data_dependent: bool = True
    memory_budget: int | str | float | None = None
    budget_granularity: Literal["module", "op"] = "module"
    budget_cost: Literal["roofline", "calibrated", "flops"] = "roofline"

    def __post_init__(self) -> None:
        for name in ("classes", "names", "save_ops"):
            value = getattr(self, name)
            if value is None:
                # A YAML key left empty (`save_ops:`) reads as null.
                raise CheckpointingConfigError(
                    f"`{name}` must be a list, got None; write `[]` for none, or leave `{name}` out."
                )
            if isinstance(value, Mapping):
                # Iterated, a mapping gives its keys: the values (`{Block: 2}`) would be dropped without a word.
                raise CheckpointingConfigError(
                    f"`{name}` must be a list, got a mapping {dict(value)!r}, whose values nothing reads; list the"
                    f" names alone: {list(value)!r}."
                )
            if isinstance(value, str) and not (name == "classes" and value == AUTO_CLASSES):
                if name == "classes" and value.lower() != value and value.lower() == AUTO_CLASSES:
                    raise CheckpointingConfigError(f"`classes` must be 'auto' or a list, got {value!r}; write 'auto'.")
                if name == "classes" and difflib.get_close_matches(value, [AUTO_CLASSES], n=1, cutoff=0.75):
                    raise CheckpointingConfigError(
                        f"`classes` must be 'auto' or a list, got {value!r}: did you mean 'auto'? A class name goes"
                        f" in a list: [{value!r}]."
                    )
                # `list("Block")` would silently select classes named "B", "l", ...
                if name == "classes":
                    raise CheckpointingConfigError(
                        f"`classes` must be a list of strings or 'auto', got {value!r}; use [{value!r}], or 'auto'"
                        " for a transformer's layers."
                    )
                raise CheckpointingConfigError(f"`{name}` must be a list of strings, got {value!r}; use [{value!r}].")
        if isinstance(self.classes, (list, tuple)) and AUTO_CLASSES in self.classes:
            raise CheckpointingConfigError(
                f"`classes` holds {AUTO_CLASSES!r} in a list ({list(self.classes)!r}): 'auto' is a value of its own,"
                " which chooses the layers itself; write `classes: auto` (`classes='auto'`), or list class names only."
            )
        if self.classes != AUTO_CLASSES:
            object.__setattr__(self, "classes", _class_entries(self.classes))
        for name in ("names", "save_ops"):
            value = getattr(self, name)
            wrong = [entry for entry in value if not isinstance(entry, str)]
            if wrong:
                # An op object or a number would fail later, far from the config, with a TypeError or AttributeError.
                write = "module names as globs ('model.blocks.*')" if name == "names" else "ops as strings ('aten.mm')"
                raise CheckpointingConfigError(
                    f"`{name}` must be a list of strings, got the entry {wrong[0]!r} ({type(wrong[0]).__name__});"
                    f" write {write}."
                )
        for name in ("classes", "names"):
            value = getattr(self, name)
            if value != AUTO_CLASSES and any(not entry.strip() for entry in value):
                # An empty entry matches nothing, and would be reported later as a class or name not found.
                raise CheckpointingConfigError(f"`{name}` holds an empty entry ({list(value)!r}): remove it.")
        for name in RECOMPUTE_SWITCHES:
            check_bool(name, getattr(self, name))
        for name in ("names", "save_ops"):
            object.__setattr__(self, name, list(getattr(self, name)))
        if not self.classes and not self.names:
            raise CheckpointingConfigError(
                "`CheckpointingConfig` selects nothing: set `classes` (e.g. ['Block']) or `names`"
                " (e.g. ['model.blocks.*'])."
            )
        # A plain int saves to YAML and pickles anywhere, whatever subclass of int was given.
        object.__setattr__(self, "every_n", check_positive_int("every_n", self.every_n))
        check_choice("determinism_check", self.determinism_check, ("default", "none"))
        for path in class_entries(self):
            if "." in path and not issubclass(resolve_class_path(path), nn.Module):
                raise CheckpointingConfigError(
                    f"`classes` entry {path!r} is not a module class (`torch.nn.Module`), so it would match nothing:"
                    " name the layer or block class to checkpoint."
                )
        resolve_ops(self.save_ops)
        object.__setattr__(self, "memory_budget", check_memory_budget(self.memory_budget, self.every_n))
        check_choice("budget_granularity", self.budget_granularity, BUDGET_GRANULARITIES)
        if self.budget_granularity != "module" and self.memory_budget is None:
            raise CheckpointingConfigError(
                f"`budget_granularity`={self.budget_granularity!r} chooses what to keep under a memory budget; set"
                " `memory_budget` (e.g. '50%') or leave `budget_granularity` at 'module'."
            )
        check_choice("budget_cost", self.budget_cost, BUDGET_COSTS)
        if self.budget_cost != "roofline" and self.memory_budget is None:
            raise CheckpointingConfigError(
                f"`budget_cost`={self.budget_cost!r} is the recompute cost a memory budget minimises; set"
                " `memory_budget` (e.g. '50%') or leave `budget_cost` at 'roofline'."
            )

    def __hash__(self) -> int:
        # By value, as `==` compares: equal configs checkpoint alike (and share their compiled graphs' notes).
        return hash(tuple(tuple(value) if isinstance(value, list) else value for value in astuple(self)))


RECOMPUTE_SWITCHES = tuple(entry.name for entry in fields(CheckpointingConfig) if entry.type in (bool, "bool"))
"""The switches of :class:`CheckpointingConfig`, its ``bool`` fields, each turning a recompute context on or off:
checked alike here, and spelt alike by the hints that name them (:mod:`~lightning_ckpt_determinism.verify.cause`).

Example::

    >>> RECOMPUTE_SWITCHES
    ('preserve_rng_state', 'preserve_host_rng', 'protect_buffers', 'keep_data_dependent')
"""


def resolve_class_path(path: str) -> type:
    """Import a class from its dotted path.

    Args:
        path: A dotted path such as ``"torch.nn.TransformerEncoderLayer"``; a nested class is
            ``"module.Outer.Inner"``. An entry ``classes`` stored for a class that cannot be imported by its path
            gives that class.

    Returns:
        The class.

    Raises:
        CheckpointingConfigError: If the module cannot be imported or holds no class of that name.

    Example::

        >>> resolve_class_path("torch.nn.Linear")
        <class 'torch.nn.modules.linear.Linear'>
    """
    if isinstance(path, _HeldClass):
        return path.cls
    parts = path.split(".")
    failed: ImportError | None = None
    # The longest prefix that imports is the module; the rest is the class's qualified name in it.
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError as err:
            failed = failed or err
            continue
        for depth, part in enumerate(parts[cut:], start=cut):
            try:
                found = getattr(found, part)
            except AttributeError as err:
                raise _not_importable(path, err, _path_meant(found, parts, depth)) from err
        if not isinstance(found, type):
            raise CheckpointingConfigError(f"`classes` entry {path!r} is not a class, got {type(found).__name__}.")
        return found
    raise _not_importable(path, failed) from failed


def _not_importable(path: str, err: Exception | None, meant: str | None = None) -> CheckpointingConfigError:
    if meant is not None:
        instead = f" Did you mean {meant!r}? Its bare class name, {meant.rpartition('.')[2]!r}, matches it too."
    else:
        instead = f" Use a bare class name such as {path.rpartition('.')[2]!r} or a dotted path to an importable class."
    return CheckpointingConfigError(
        f"`classes` entry {path!r} cannot be imported ({err or 'not a dotted path'}).{instead}"
    )


def class_path_meant(module: str, attribute: str) -> str | None:
    """The dotted path meant where ``module`` has no attribute ``attribute`` (a misspelt class path): the closest of
    its public names and, for a package, of its modules; ``None`` if none is close or ``module`` does not import.

    Args:
        module: The module, as a dotted name.
        attribute: The name it does not have.

    Example::

        >>> class_path_meant("torch.nn", "Linaer")
        'torch.nn.Linear'
    """
    try:
        holder = importlib.import_module(module)
    except ImportError:
        return None
    parts = module.split(".")
    return _path_meant(holder, [*parts, attribute], len(parts))


def _path_meant(holder: Any, parts: list[str], depth: int) -> str | None:
    """The dotted path meant where ``holder`` has no attribute ``parts[depth]``: the closest of its public names and,
    for a package, of its modules, with the rest of the path kept."""
    names = [name for name in dir(holder) if not name.startswith("_")]
    names += [module.name for module in pkgutil.iter_modules(getattr(holder, "__path__", None) or [])]
    # Closer than difflib's default: `transformers.LlamaDecoderLayer` (not exported there) must not be "meant" as
    # `transformers.LxmertXLayer`; the bare name is then the advice.
    close = difflib.get_close_matches(parts[depth], names, n=1, cutoff=0.75)
    return ".".join([*parts[:depth], close[0], *parts[depth + 1 :]]) if close else None


def class_name(entry: str | type) -> str:
    """The class name an entry of ``classes`` names, as messages show it.

    Args:
        entry: A bare name, a dotted path or a class.

    Example::

        >>> class_name("torch.nn.TransformerEncoderLayer"), class_name(torch.nn.Linear)
        ('TransformerEncoderLayer', 'Linear')
    """
    return entry.__name__ if isinstance(entry, type) else entry.rpartition(".")[2]


def entry_shown(entry: str | type) -> str:
    """An entry of ``classes`` as messages show it: by its class name where it is the class's own path (a class given
    as an object is stored so), else as written (``"torch.nn.Conv2d"``, whose class lives in ``torch.nn.modules``).

    Args:
        entry: An entry as the config stores it (a class, by its name).

    Example::

        >>> entry_shown("torch.nn.Conv2d"), entry_shown("torch.nn.modules.conv.Conv2d"), entry_shown("Block")
        ('torch.nn.Conv2d', 'Conv2d', 'Block')
    """
    if isinstance(entry, (type, _HeldClass)) or "." not in entry:
        return class_name(entry)
    try:
        cls = resolve_class_path(entry)
    except CheckpointingConfigError:
        return entry
    return cls.__name__ if f"{cls.__module__}.{cls.__qualname__}" == entry else entry


class _HeldClass(str):
    """The dotted path of a class that cannot be imported by it (defined inside a function, or made at run time),
    holding the class so that matching works in this process. It refuses to be pickled: no other process could find
    the class by its path."""

    cls: type

    def __new__(cls, path: str, held: type) -> "_HeldClass":
        entry = super().__new__(cls, path)
        entry.cls = held
        return entry

    # Two classes a function makes on two calls share a path: an entry equals only one that holds the same class.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, _HeldClass) and other.cls is not self.cls:
            return False
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__

    def __copy__(self) -> "_HeldClass":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "_HeldClass":
        return self

    def __reduce__(self) -> Any:
        raise pickle.PicklingError(
            f"lightning_ckpt_determinism: the `classes` entry {self.cls.__name__} ({self!s}) cannot be pickled:"
            " the class cannot be imported by its path in another process. Define it at module level, or give"
            f" its name {self.cls.__name__!r} as a string."
        )


def class_entries(config: CheckpointingConfig) -> list[str]:
    """The names and paths of ``config.classes``; none for ``classes: auto``.

    Args:
        config: The config.

    Example::

        >>> class_entries(CheckpointingConfig(classes="auto")), class_entries(CheckpointingConfig(classes=["Block"]))
        ([], ['Block'])
    """
    # The entries as stored (a class given in Python stays held by its path's entry).
    return [] if config.classes == AUTO_CLASSES else [entry for entry in config.classes if isinstance(entry, str)]


def _class_entries(value: Any) -> list[str]:
    """``classes`` as stored: names and paths as given, each class as its dotted path."""
    if isinstance(value, type):
        raise CheckpointingConfigError(
            f"`classes` must be a list, got the class {value.__name__}; use [{value.__name__}]."
        )
    entries: list[str] = []
    for entry in value:
        if isinstance(entry, type):
            entries.append(_class_entry(entry))
        elif isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, torch.nn.Module):
            name = type(entry).__name__
            raise CheckpointingConfigError(
                f"`classes` must be a list of class names, dotted paths or classes, got a {name} module; give its"
                f" class, {name} (or '{name}'), or select modules by name with `names`."
            )
        else:
            raise CheckpointingConfigError(
                f"`classes` must be a list of class names, dotted paths or classes, got the entry {entry!r}"
                f" ({type(entry).__name__}); write classes as 'Block', 'my_package.model.Block' or the class itself."
            )
    return entries


def _class_entry(cls: type) -> str:
    """``cls``'s dotted path; one that holds ``cls`` where the path does not import back to it (warned once)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    with contextlib.suppress(CheckpointingConfigError):
        if resolve_class_path(path) is cls:
            return path
    warnings.warn(
        f"lightning_ckpt_determinism: `classes` entry {cls.__name__} ({path}) cannot be imported by its path: it is"
        ' matched in this process, but a config holding it cannot be pickled, so `strategy="ddp_spawn"` (which'
        " pickles the strategy for each process) fails with it. Define the class at module level to train that"
        " way.",
        LightningCkptDeterminismWarning,
        stacklevel=5,
    )
    return _HeldClass(path, cls)


def resolve_ops(names: list[str]) -> list[OpOverload]:
    """Turn op names into the op overloads that selective checkpointing matches.

    Args:
        names: Op names such as ``"aten.mm"`` (every overload) or ``"aten.addmm.default"`` (one overload).

    Returns:
        The op overloads, in order, without duplicates, less those that write their arguments and return them (an
        ``out=`` form): a forward that calls one has it recomputed, since torch cannot keep what an op wrote into.

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
    if name != name.strip():
        raise CheckpointingConfigError(f"`save_ops` entry {name!r} holds spaces: write {name.strip()!r}.")
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
        if namespace == "torch" and hasattr(torch.ops.aten, op_name):
            # `torch.mm` is the Python function; selective checkpointing sees the ATen op it dispatches to.
            raise CheckpointingConfigError(
                f"`save_ops` entry {name!r} names a torch function; checkpointing sees the ops below it: write"
                f" 'aten.{'.'.join(parts[1:])}'."
            ) from err
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is not an op torch knows. Check the spelling against `torch.ops.{namespace}`"
            " (e.g. 'aten.mm', 'aten.addmm', 'aten._scaled_dot_product_flash_attention')."
        ) from err
    if not isinstance(packet, OpOverloadPacket):
        raise CheckpointingConfigError(f"`save_ops` entry {name!r} is not an op, got {type(packet).__name__}.")
    overloads = packet.overloads() if len(parts) == 2 else [parts[2]]
    if parts[2:] and parts[2] not in packet.overloads():
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} names an unknown overload; {namespace}.{op_name} has {packet.overloads()}."
        )
    ops = [getattr(packet, overload) for overload in overloads]
    # What a forward calls with `out=` (or another form that writes its arguments and returns them) is recomputed:
    # selective checkpointing cannot keep a tensor the op wrote into, and autograd never runs such a form anyway.
    returning = [op for op in ops if not returns_what_it_wrote(op)]
    known = [_decomposed_before_dispatch(op) for op in returning]
    if any(known) and all(composite is not False for composite in known):
        raise CheckpointingConfigError(_composite_message(name, f"{namespace}.{op_name}"))
    # An attention kernel is tagged random for its `dropout_p`, 0 in most models (and torch's own save lists keep it).
    if any(is_random_op(op) and not random_only_through_dropout_p(op) for op in ops):
        # Kept, it is not run again in recomputation, so every random op after it draws other numbers there.
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is a random op: a kept one is not run again in recomputation, which shifts"
            " what every later random op there draws; remove it (`preserve_rng_state` replays random ops exactly)."
        )
    # In place: no overload writes nothing, and those that write a positional tensor return only what they wrote, or
    # nothing (`relu_`, `_foreach_mul_`). An op with a functional overload (`sort`, beside its list and `out=` forms)
    # or one that writes state but returns new tensors (a fused fake-quantize updating its observer) is kept.
    in_place = [verdict for verdict in map(in_place_overload, ops) if verdict is not None]
    if all(map(writes_its_arguments, ops)) and in_place and all(in_place):
        out_of_place = _out_of_place(namespace, op_name)
        functional = (
            f"the out-of-place op ('{namespace}.{out_of_place}')"
            if out_of_place is not None
            else "the op that computes what it writes"
        )
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is an in-place op: its output is its input written over, which torch's"
            f" selective checkpointing refuses to keep; write {functional} or the op before it."
        )
    if returning:
        return returning
    if parts[2:] and parts[2].endswith("out"):
        raise CheckpointingConfigError(
            f"`save_ops` entry {name!r} is an `out=` overload, which autograd never runs, so nothing would be kept;"
            f" write '{namespace}.{op_name}' (every overload) or '{namespace}.{op_name}.default'."
        )
    raise CheckpointingConfigError(
        f"`save_ops` entry {name!r} returns only what it writes into its arguments (an `out=` or in-place form),"
        " which selective checkpointing cannot keep, so nothing would be kept; name the op that computes the value."
    )


def _out_of_place(namespace: str, op_name: str) -> str | None:
    """The out-of-place op of an in-place one by torch's naming (``relu_`` for ``relu``), where torch has it; ``None``
    for a dunder (``__iand__``) or an op without one."""
    if not op_name.endswith("_") or op_name.startswith("__"):
        return None
    name = op_name[:-1]
    try:
        found = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    return name if isinstance(found, OpOverloadPacket) else None


def _decomposed_before_dispatch(op: OpOverload) -> bool | None:
    """Whether autograd runs ``op`` as the ops it is written in (a ``CompositeImplicitAutograd`` kernel): then the
    selective-checkpointing policy, which sees the ops below autograd, never sees ``op`` itself. ``None`` for an
    overload the dispatcher does not know (``aten.einsum.sublist``)."""
    try:
        return bool(op.has_kernel_for_dispatch_key(torch.DispatchKey.CompositeImplicitAutograd))
    except RuntimeError:
        return None


_COMPOSITE_RUNS = {
    "aten.matmul": "'aten.mm' or, batched, 'aten.bmm'",
    "aten.linear": "'aten.addmm' or, without a bias, 'aten.mm'",
    "aten.einsum": "'aten.bmm'",
    "aten.scaled_dot_product_attention": "'aten._scaled_dot_product_flash_attention',"
    " 'aten._scaled_dot_product_efficient_attention' or 'aten._scaled_dot_product_cudnn_attention' on CUDA,"
    " 'aten.bmm' in its math path",
    "aten.layer_norm": "'aten.native_layer_norm'",
    "aten.group_norm": "'aten.native_group_norm'",
    "aten.batch_norm": "'aten.native_batch_norm'",
    "aten.softmax": "'aten._softmax'",
    "aten.conv1d": "'aten.convolution'",
    "aten.conv2d": "'aten.convolution'",
    "aten.conv3d": "'aten.convolution'",
}


def _composite_message(name: str, packet: str) -> str:
    runs = _COMPOSITE_RUNS.get(packet)
    listed = "name the ops it runs, which a `TorchDispatchMode` or the profiler lists"
    instead = f"name what it runs: {runs}" if runs else listed
    return (
        f"`save_ops` entry {name!r} is a composite op: autograd runs it as the ops it is written in, so"
        f" checkpointing never sees it and would keep nothing for it; {instead}."
    )
