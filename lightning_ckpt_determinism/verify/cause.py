"""The causes a check gives, as one type: :class:`Cause`, each with its fix hint in every syntax people use.

A hint names settings; people set them in Python (``CheckpointingConfig(preserve_host_rng=True)``), in a
LightningCLI YAML (``trainer.strategy.init_args.checkpointing``) or through the audit, which reads such a YAML and
has flags of its own. Each hint is written once, with its settings as :class:`Setting` s that know each spelling.
Reports hold their hints in Python form; what shows them to a YAML-driven run (``CheckpointingCLI``'s monitor, the
audit) passes its text through :func:`respelt`, which spells every setting as that syntax writes it.
"""

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from lightning_ckpt_determinism.config import RECOMPUTE_SWITCHES

__all__ = ["PROTECTED_BUFFERS_HINT", "Cause", "Syntax", "respelt"]

Syntax = Literal["python", "yaml", "audit"]
"""Where a hint is shown: Python code, a LightningCLI YAML, or the audit (a YAML and the audit's own flags)."""


@dataclass(frozen=True)
class Setting:
    """One setting a hint names, spelt for each :data:`Syntax`.

    Args:
        python: As Python code writes it.
        yaml: As a LightningCLI YAML writes it.
        audit: As the audit takes it; the YAML's spelling when ``None`` (the audit reads the training YAML).

    Example::

        >>> Setting(python="`x=True`", yaml="`x: true`").spelt("audit")
        '`x: true`'
    """

    python: str
    yaml: str
    audit: str | None = None

    def spelt(self, syntax: Syntax) -> str:
        """This setting as ``syntax`` writes it.

        Args:
            syntax: Where the hint is shown.
        """
        if syntax == "python":
            return self.python
        return self.audit if syntax == "audit" and self.audit is not None else self.yaml


@dataclass(frozen=True)
class Hints:
    """A cause's fix hint, in each :data:`Syntax` it is shown in.

    Args:
        python: For Python code: what every report, warning and the audit print today.
        yaml: For a LightningCLI YAML.
        audit: For the audit.

    Example::

        >>> Cause.HOST_RNG.hints.yaml.split(": set ")[1].split(",")[0]
        '`preserve_host_rng: true` under `trainer.strategy.init_args.checkpointing`'
    """

    python: str
    yaml: str
    audit: str

    def spelt(self, syntax: Syntax) -> str:
        """The hint as ``syntax`` writes its settings.

        Args:
            syntax: Where the hint is shown.
        """
        return {"python": self.python, "yaml": self.yaml, "audit": self.audit}[syntax]


def _checkpointing(field: str) -> Setting:
    """A boolean field of :class:`~lightning_ckpt_determinism.config.CheckpointingConfig`, turned on."""
    return Setting(
        python=f"`{field}=True` in the `CheckpointingConfig`",
        yaml=f"`{field}: true` under `trainer.strategy.init_args.checkpointing`",
    )


_CALIBRATE_NOISE = Setting(
    python="`calibrate_noise=True`",
    yaml="`calibrate_noise: true` in the `RecomputationMonitor`'s `init_args`",
    audit="`--calibrate-noise`",
)
# Lightning's `Trainer(deterministic=True)` calls `torch.use_deterministic_algorithms(True)`.
_DETERMINISTIC = Setting(
    python="call `torch.use_deterministic_algorithms(True)`", yaml="set `deterministic: true` under `trainer`"
)


def _switch(field: str, value: bool) -> Setting:
    """A boolean field named with its value alone, as a list of likely causes names it."""
    return Setting(python=f"`{field}={value}`", yaml=f"`{field}: {str(value).lower()}`")


# Every setting a hint or a message names, longest Python spelling first: a switch's short spelling is part of its
# long one, which goes first.
_SETTINGS = tuple(
    sorted(
        [
            *(_checkpointing(field) for field in RECOMPUTE_SWITCHES),
            *(_switch(field, value) for field in RECOMPUTE_SWITCHES for value in (True, False)),
            _CALIBRATE_NOISE,
            _DETERMINISTIC,
        ],
        key=lambda setting: -len(setting.python),
    )
)


def respelt(text: str, syntax: Syntax) -> str:
    """``text`` (a hint, or a message or summary holding hints) with every setting it names in Python form spelt as
    ``syntax`` writes it.

    Args:
        text: Text whose settings are in Python form, as reports hold them.
        syntax: Where it is shown.

    Example::

        >>> respelt(Cause.HOST_RNG.hint, "yaml") == Cause.HOST_RNG.hints.yaml
        True
        >>> respelt("Region `blocks.1` differs: check with `calibrate_noise=True`.", "audit")
        'Region `blocks.1` differs: check with `--calibrate-noise`.'
    """
    if syntax == "python":
        return text
    for setting in _SETTINGS:
        text = text.replace(setting.python, setting.spelt(syntax))
    return text


def _hints(text: str, *settings: Setting) -> Hints:
    """``text`` with its ``{}`` placeholders filled by ``settings``, in each syntax."""
    return Hints(
        python=text.format(*(setting.spelt("python") for setting in settings)),
        yaml=text.format(*(setting.spelt("yaml") for setting in settings)),
        audit=text.format(*(setting.spelt("audit") for setting in settings)),
    )


class Cause(str, enum.Enum):
    """Why recomputation did not reproduce the forward: ``RegionReport.cause`` and ``RecomputationReport.cause``.

    Each member is its name as a string (``Cause.HOST_RNG == "host_rng"``), printed, formatted, compared and written
    to JSON as that string, and carries its fix hint in each :data:`Syntax` (:attr:`hints`); :attr:`hint` is the
    Python one, which reports give.

    Example::

        >>> Cause("host_rng") is Cause.HOST_RNG, f"cause {Cause.HOST_RNG}", [Cause.HOST_RNG]
        (True, 'cause host_rng', ['host_rng'])
        >>> "`preserve_host_rng=True`" in Cause.HOST_RNG.hint
        True
    """

    RNG_NOT_PRESERVED = "rng_not_preserved"
    HOST_RNG = "host_rng"
    BUFFER_MUTATION = "buffer_mutation"
    SHAPE_CHANGE = "shape_change"
    PYTHON_STATE = "python_state"
    PARAMETER_WRITE = "parameter_write"
    OUTSIDE_STATE = "outside_state"
    ATTRIBUTE_MUTATION = "attribute_mutation"
    NONDETERMINISTIC_KERNEL = "nondeterministic_kernel"
    RECOMPUTE_ERROR = "recompute_error"
    COMPILER_RECOMPUTE = "compiler_recompute"
    METRIC_UPDATE = "metric_update"

    # Shown as the plain string the reports always held, in text as in the lists and tuples people print.
    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def hints(self) -> Hints:
        """The fix hint in each syntax."""
        return _HINTS[self]

    @property
    def hint(self) -> str:
        """The fix hint for Python code, as reports, warnings and the audit give it."""
        return _HINTS[self].python

    @property
    def when(self) -> str:
        """When the cause is given, as the documentation's page of causes says it."""
        return _WHEN[self]

    @property
    def blames(self) -> Literal["region", "step"]:
        """What the cause blames: ``"step"`` for a cause of the whole step that no one region's recomputation
        explains (``RecomputationReport.cause``: state outside the regions, the compiler's own recomputation),
        ``"region"`` for the others, which a region's report carries.

        Example::

            >>> Cause.OUTSIDE_STATE.blames, Cause.HOST_RNG.blames
            ('step', 'region')
        """
        return "step" if self in _STEP_CAUSES else "region"

    @property
    def state_change(self) -> str | None:
        """What recomputation did to the region's state, for the causes that change state rather than values;
        ``None`` for the others."""
        return _STATE_CHANGES.get(self)


_HINTS: Mapping[Cause, Hints] = MappingProxyType(
    {
        Cause.RNG_NOT_PRESERVED: _hints(
            "A random op draws other numbers in recomputation: set {} (the default), which replays torch's default"
            " generators and those the region's modules hold as attributes, and draw from those: no other generator"
            " is replayed.",
            _checkpointing("preserve_rng_state"),
        ),
        Cause.HOST_RNG: _hints(
            "The forward reads Python's `random` or NumPy's RNG (global, or a generator its modules hold): set {},"
            " or draw from torch's RNG instead.",
            _checkpointing("preserve_host_rng"),
        ),
        Cause.BUFFER_MUTATION: _hints(
            "Recomputation updates the region's buffers a second time (the running statistics of BatchNorm or"
            " InstanceNorm, counters): set {}.",
            _checkpointing("protect_buffers"),
        ),
        Cause.SHAPE_CHANGE: _hints(
            "A shape in the region depends on something that changed between forward and recomputation: make it a"
            " function of the region's inputs only, or leave this module out of checkpointing."
        ),
        Cause.PYTHON_STATE: _hints(
            "The forward reads Python state that changed before recomputation (a list or dict it appends to, a"
            " tensor attribute it changes in place, another object's field, a global, a counter in a hook's closure;"
            " the region's own scalar attributes, such as counters and flags, are replayed): compute it outside the"
            " checkpointed module and pass it in, change it only outside forward, or register a tensor it changes"
            " as a buffer, which {} replays.",
            _checkpointing("protect_buffers"),
        ),
        Cause.PARAMETER_WRITE: _hints(
            "The region writes a parameter in place in forward (a decay or clamp under `no_grad`, an `nn.Embedding`"
            " with `max_norm` renormalising rows beyond it), or code writes one between the forward and the backward"
            " that recomputes it (an optimizer step before a backward through an earlier forward, as a GAN stepping"
            " its discriminator before the generator's backward through it): recomputation reads other values than"
            " the forward did, or writes them a second time, so gradients or weights drift from training without"
            " checkpointing (which raises on the second kind: a variable modified by an inplace operation). Write it"
            " outside the checkpointed module (in `training_step` or an optimizer hook), step an optimizer only after"
            " every backward through the forwards before it, or leave that module out of checkpointing."
        ),
        Cause.OUTSIDE_STATE: _hints(
            "The step computed another loss in the check's rerun than live, before anything was recomputed: state"
            " outside the checkpointed regions differs between them (a global, an object the check does not capture"
            " such as an iterator the step draws from, data drawn afresh), or a kernel differs from run to run."
            " Recomputation is not the cause. State the step advances itself, each rerun advanced again, so training"
            " from here differs from training without the check: keep such state in buffers, or in generators,"
            " numbers, tensors and arrays held as module attributes or in their lists and dicts, which the check"
            " restores, or check with {} for kernels that are not reproducible.",
            _CALIBRATE_NOISE,
        ),
        Cause.ATTRIBUTE_MUTATION: _hints(
            "Recomputation changes Python attributes of the region a second time (a list appended to, a dict"
            " updated): the package replays the region's scalar attributes (numbers, strings, flags), not containers"
            " or other objects. Change them outside forward (in `training_step` or a hook), or hold them as scalars."
        ),
        Cause.NONDETERMINISTIC_KERNEL: _hints(
            "A kernel returned other values for the same inputs: {}, or check with {} so that differences within"
            " the noise floor are tolerated. An op that draws from a generator held outside the region's modules"
            " (a custom op given a global `torch.Generator`) reads the same: no such generator is replayed, so let"
            " the op draw from torch's default generator or from one a module of the region holds.",
            _DETERMINISTIC,
            _CALIBRATE_NOISE,
        ),
        Cause.RECOMPUTE_ERROR: _hints(
            "Recomputing the region raised an error its forward did not (see `error`): make the region's code"
            " depend only on its inputs, or leave this module out of checkpointing."
        ),
        # torch's and inductor's own settings, which only Python code sets.
        Cause.COMPILER_RECOMPUTE: _hints(
            "The compiled step diverges and the same step run eagerly does not: the compiler's own recomputation"
            " differs from its forward. Known triggers: `torch._functorch.config.activation_memory_budget` below 1"
            " (random ops redrawn, pytorch#190717), inductor's `fallback_random` with `reorder_for_peak_memory`"
            " (dropout masks reordered), and reductions compiled differently for the recomputation. Fixes: set the"
            " budget to 1.0, mark the random ops `CheckpointPolicy.MUST_SAVE` in a selective-checkpointing policy,"
            " or, against the budget's redraws, `torch._inductor.config.fallback_random = True` without"
            " `reorder_for_peak_memory`."
        ),
        Cause.METRIC_UPDATE: _hints(
            "Recomputation updates a torchmetrics metric inside the region a second time (its sums and counts"
            " double): update metrics outside the checkpointed modules (in `training_step`, from the module's"
            " outputs), or leave that module out of checkpointing."
        ),
    }
)

# When each cause is given, as the documentation's page of causes says it.
_WHEN: Mapping[Cause, str] = MappingProxyType(
    {
        Cause.RNG_NOT_PRESERVED: (
            "a random op (dropout, `rand*`, `bernoulli` ...) asked for the same draw (rate, spread, size) drew other"
            " numbers in recomputation (one asked for another draw is Python state); or the step left"
            " torch's RNG in another state than the same step without checkpointing, with exact gradients (a region"
            " drew from it again, its results kept from the forward: masking by `argsort`, as ViTMAE's, or a"
            " LayerDrop decision), so that whatever draws from it next draws other numbers."
        ),
        Cause.HOST_RNG: (
            "the forward read Python's `random` or NumPy's RNG (global, or a generator the region's modules hold),"
            " confirmed by replaying them for that region;"
            " or the step left them in another state than the same step without checkpointing, with exact gradients"
            " (a region drew from them again, the same values after a seed of its own, as BigBird's attention does),"
            " so that whatever draws from them next draws other numbers."
        ),
        Cause.BUFFER_MUTATION: (
            "recomputation updated the region's buffers a second time, or an op it recomputed read a buffer the "
            "forward had updated (the running statistics of BatchNorm, and of InstanceNorm with "
            "`track_running_stats`, which copies them first), or it updated again the buffers of a module outside the "
            "region that its forward runs (a tied embedding's `spectral_norm`); the hint names the buffers, and the "
            "gradients may well be exact."
        ),
        Cause.SHAPE_CHANGE: (
            "a recomputed tensor has another shape or dtype than its forward's (torch's metadata error)."
        ),
        Cause.PYTHON_STATE: (
            "Python state read in forward that recomputation does not replay (a list or dict, another object's "
            "field, a global, a cache) decided other values or ops, or torch found another number of saved "
            "tensors."
        ),
        Cause.PARAMETER_WRITE: (
            "a parameter of the region changed its values in place in recomputation, or between the forward and "
            "its recomputation, so that a recomputed op read other values (a decay under `no_grad` in forward, "
            "`embedding_renorm_` over rows beyond `max_norm`). Attribution names the parameters; the sentinel counts "
            "each recomputation that changed one. A write that leaves every value as it was (a second renorm of "
            "rows already within `max_norm`) is none."
        ),
        Cause.OUTSIDE_STATE: (
            "in `RecomputationReport.cause`: the gradients diverged and the step's forward already computed "
            "another loss in the reference pass than in the checkpointed one, before anything was recomputed. No "
            "region is blamed; with `calibrate_noise`, only when the reference passes agree with each other. Where the "
            "step recomputed an eager region before its loss (a gradient penalty's backward in the forward), only "
            "when attribution found every region exact: otherwise the regions' own causes stand. Under manual "
            "optimization the hint first names the likeliest reason: a `loss_fn` returning another loss than the "
            "step's first `manual_backward` was given."
        ),
        Cause.ATTRIBUTE_MUTATION: (
            "a plain Python attribute of a module inside a region (a list, a dict) ended the checkpointed step "
            "otherwise than the step without checkpointing: recomputation repeated a forward's side effect. The "
            "hint names the attributes; `exclude_attributes` leaves out those that legitimately differ."
        ),
        Cause.NONDETERMINISTIC_KERNEL: ("an op returned other values for exactly the inputs it had in the forward."),
        Cause.RECOMPUTE_ERROR: ("recomputing the region raised; `RegionReport.error` holds the error's first line."),
        Cause.COMPILER_RECOMPUTE: (
            "on a compiled model, in `RecomputationReport.cause`: the compiled step diverges and the same step "
            "run eagerly does not. The regions whose compiled backward graph draws a random op afresh get it too."
        ),
        Cause.METRIC_UPDATE: (
            "the states of a torchmetrics `Metric` inside a region (a submodule, or held in a plain list or dict) "
            "changed in its recomputation: an update in forward, made again. The hint names the metrics (one in a "
            "container as the code reaches it: `metrics['acc']`); the gradients may well be exact, and the check puts "
            "the metrics back after its own passes."
        ),
    }
)

# The causes of a whole step (see `Cause.blames`).
_STEP_CAUSES = frozenset({Cause.OUTSIDE_STATE, Cause.COMPILER_RECOMPUTE})

_STATE_CHANGES: Mapping[Cause, str] = MappingProxyType(
    {
        Cause.BUFFER_MUTATION: "updated its buffers a second time, or read them otherwise, in recomputation",
        Cause.ATTRIBUTE_MUTATION: "changed Python attributes a second time in recomputation",
        Cause.PARAMETER_WRITE: "wrote a parameter in place in forward or recomputation",
        Cause.METRIC_UPDATE: "updated a torchmetrics metric a second time in recomputation",
    }
)

PROTECTED_BUFFERS_HINT = _hints(
    "Recomputation updates the region's buffers a second time, yet {} is set and puts them back around this"
    " package's own recomputation: something else runs part of the region again in backward, most often a"
    " `checkpoint` call inside it (warned of at the region's first forward). Remove that call, or leave this module"
    " out of checkpointing.",
    _checkpointing("protect_buffers"),
).python
"""The ``buffer_mutation`` hint of a region that protects its buffers (Python form; :func:`respelt` spells it for
the other syntaxes)."""
