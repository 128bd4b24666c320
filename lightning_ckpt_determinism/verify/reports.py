"""What a check reports: :class:`RecomputationReport`, one :class:`RegionReport` per region, and the causes.

Each cause and its text is a :class:`~lightning_ckpt_determinism.verify.cause.Cause`, and :data:`CAUSE_HINTS` maps
each to its hint; reports, warnings, the audit and the docs take them from there. Reports are frozen: a check builds
each once.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from lightning_ckpt_determinism.verify.cause import PROTECTED_BUFFERS_HINT, Cause

__all__ = [
    "CAUSE_HINTS",
    "COMPILED_NOISE_NOTE",
    "HOST_RNG_STREAM_HINT",
    "INPUT_CHANGED_HINT",
    "INPUT_MODIFIED_HINT",
    "READ_OTHERWISE_HINT",
    "ROUTING_DROPPED_HINT",
    "ROUTING_HINT",
    "ROUTING_TOO_LARGE_HINT",
    "SAVED_DIFFERS_HINT",
    "SUBSTITUTED_PARAMETERS_HINT",
    "TORCH_RNG_STREAM_HINT",
    "UNREPLAYED_GENERATOR_HINT",
    "UNSEEN_WRITE_HINT",
    "RecomputationReport",
    "RegionReport",
    "attribute_hint",
    "buffer_hint",
    "describe_error",
    "first_line",
    "missing_reference_gradients",
    "no_gradients",
    "read_otherwise_hint",
    "uncomparable_layouts",
]

CAUSE_HINTS: Mapping[str, str] = MappingProxyType({cause: cause.hint for cause in Cause})
"""The catalogue of causes: each :class:`~lightning_ckpt_determinism.verify.cause.Cause` and the hint reports give
for it (its Python form), in the order of the enum.

Example::

    >>> sorted(CAUSE_HINTS)[:2]
    ['buffer_mutation', 'host_rng']
    >>> CAUSE_HINTS["host_rng"] == Cause.HOST_RNG.hint
    True
"""

ROUTING_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's; set"
    " `keep_data_dependent=True` in the `CheckpointingConfig` to keep such outputs from the forward."
)
ROUTING_TOO_LARGE_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's, and"
    " `keep_data_dependent` recomputes it because its floating outputs are larger than the region's largest input;"
    " make them smaller (route on fewer values) or compute them outside the checkpointed module."
)
ROUTING_DROPPED_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's."
    " `keep_data_dependent` is on, but this region's first checkpointed forward ran no data-dependent op, so its"
    " guard was not installed; this check saw it route and installed it for the following steps. A region that"
    " routes only after a warm-up should route from its first step to be guarded from the start."
)
INPUT_MODIFIED_HINT = (
    "An input the region received was modified in place after the forward saved it for recomputation, by an"
    " in-place op in the region (such as `nn.ReLU(inplace=True)` on its input) or by code after it: torch found its"
    " version counter changed when it came to recompute the region. Use the out-of-place op (`inplace=False`), or"
    " modify a copy (`x = x.clone()` first)."
)

INPUT_CHANGED_HINT = (
    "The region's recomputation started from other input values than its forward received, without torch's version"
    " counter moving: saved-tensor hooks around the region that give back other values than they were given (a"
    " lossy compression such as a cast to bfloat16, whose rounding reaches every op after it), or a write through"
    " `.data`. Give back what the hooks were given, enter them only around modules that are not checkpointed, or"
    " write a copy."
)
"""The hint of a ``python_state`` whose first differing op read one of the region's own inputs, changed."""

UNREPLAYED_GENERATOR_HINT = (
    "A random op draws other numbers in recomputation from a generator the region does not replay: with"
    " `preserve_rng_state` on, as here, it replays torch's default generators and those its modules hold as"
    " attributes, not one held elsewhere (in a hook's closure, a global, another object). Hold that generator as an"
    " attribute of a module of the region, or draw from torch's default generator. Until then each rerun of a check"
    " draws from it too, so a fit with `RecomputationMonitor` trains on other numbers than one without it."
)
"""The hint of a ``rng_not_preserved`` in a region that replays torch's generators."""

SAVED_DIFFERS_HINT = (
    "Differs: {saved}, made by no op the recomputation ran (made outside the region's ops: `torch.from_numpy`, a"
    " module attribute, a weight `functional_call` passed in): torch saved it as an input of the op where it stopped"
    " the recomputation, so no recomputed op shows the difference."
)

SUBSTITUTED_PARAMETERS_HINT = (
    "The region's forward ran with other tensors in place of its parameters than its recomputation found there"
    " (`torch.func.functional_call` with weights of its own, as a MAML inner loop does): recomputation reads the"
    " module's own parameters, so the gradients are wrong, as under torch's own `checkpoint`. Run that call without"
    " checkpointing (inside `checkpointing_disabled()`), or pass such weights to the region as inputs."
)

COMPILED_NOISE_NOTE = (
    " The compiled step differs from itself run to run (its kernels, such as inductor's accumulations, are not"
    " bitwise reproducible), while the same step run eagerly is exact: check compiled models with a `tolerance`, or"
    " with `calibrate_noise=True`."
)


def buffer_hint(buffers: list[str], *, protected: bool = False, outside: bool = False) -> str:
    """The hint of a ``buffer_mutation``: the cause's and the buffers that changed.

    Args:
        buffers: The buffers that changed, as the model names them.
        protected: Whether the region already puts its buffers back around its recomputation (``protect_buffers``):
            then the hint does not ask for it, and names what else writes them.
        outside: Whether they are buffers of no region, which a region's recomputation updated again (a module
            outside it that its forward runs): then the hint says to move that module or its update.

    Example::

        >>> buffer_hint(["norm.running_mean"]).endswith("Changed: norm.running_mean.")
        True
        >>> "yet `protect_buffers=True`" in buffer_hint(["norm.running_mean"], protected=True)
        True
        >>> "does not hold" in buffer_hint(["emb.parametrizations.weight.0._u"], outside=True)
        True
    """
    hint = OUTSIDE_BUFFERS_HINT if outside else PROTECTED_BUFFERS_HINT if protected else Cause.BUFFER_MUTATION.hint
    return f"{hint} Changed: {', '.join(buffers)}."


HOST_RNG_STREAM_HINT = (
    f"{Cause.HOST_RNG.hint} Recomputation drew from it again (the values may be the same, after a seed of its"
    " own), so the step left it in another state than the same step without checkpointing: whatever draws from it"
    " next (data masking, augmentation) draws other numbers."
)
"""The hint of a ``host_rng`` found by the state the host's random streams ended the step in, the gradients exact."""

TORCH_RNG_STREAM_HINT = (
    f"{Cause.RNG_NOT_PRESERVED.hint} Recomputation drew from torch's RNG again (its results unused, or kept from the"
    " forward: routing, masking by `argsort`), so the step left it in another state than the same step without"
    " checkpointing: whatever draws from it next (the next step's dropout and masking) draws other numbers."
)
"""The hint of a ``rng_not_preserved`` found by the state torch's RNG ended the step in, the gradients exact."""

READ_OTHERWISE_HINT = (
    "Recomputation read other values of these buffers than the forward did: the forward changed them for the first"
    " time after the region's first call, or code outside the region wrote them between the forward and the"
    " recomputation, and they are too large (over 1 MiB) for the region to copy before it knows they change. The"
    " region replays them from its next call on, so it happens once per buffer; for that call to be exact too, let"
    " the region's first forward change them (a warm-up forward before training)."
)


UNSEEN_WRITE_HINT = (
    "The region's recomputation read or wrote a buffer the region did not know its forward changes, though it puts"
    " its buffers back around recomputation: the forward writes it in a way the region cannot see, through `.data`"
    " (which moves no version counter), from a call after its first, or something writes it so between calls. Write"
    " it in place without `.data` (`with torch.no_grad(): self.ema.mul_(decay)`): the region then sees the write and"
    " replays the buffer."
)


OUTSIDE_BUFFERS_HINT = (
    "The region's forward runs a module it does not hold (a tied or shared one, a parametrization of another"
    " module's weight) that updates its buffers as it runs: recomputation updated them a second time, and read other"
    " values than the forward did. Make that module part of the region, or update its buffers outside the region's"
    " forward."
)


def read_otherwise_hint(buffers: list[str]) -> str:
    """The hint of a ``buffer_mutation`` whose region recomputed with other values of large buffers than its forward
    read (see :func:`~lightning_ckpt_determinism.checkpointing.wrapper.buffers_read_otherwise`).

    Args:
        buffers: The buffers, as the model names them.

    Example::

        >>> read_otherwise_hint(["blocks.0.table"]).endswith("Read otherwise: blocks.0.table.")
        True
    """
    return f"{READ_OTHERWISE_HINT} Read otherwise: {', '.join(buffers)}."


def attribute_hint(attributes: list[str]) -> str:
    """The hint of an ``attribute_mutation``: the cause's and the attributes that changed.

    Example::

        >>> attribute_hint(["blocks.0.history"]).endswith("Changed: blocks.0.history.")
        True
    """
    return f"{Cause.ATTRIBUTE_MUTATION.hint} Changed: {', '.join(attributes)}."


def no_gradients(where: str = "in either pass") -> str:
    """The finding of a check with no gradient to compare.

    Example::

        >>> no_gradients()
        'the check could not compare gradients: no parameter received a gradient in either pass'
    """
    return f"the check could not compare gradients: no parameter received a gradient {where}"


def missing_reference_gradients(names: list[str], live: str) -> str:
    """The finding of a check whose reference gave no gradient for ``names`` where ``live`` did.

    Example::

        >>> missing_reference_gradients(["w"], "the live step").endswith("for ['w'] where the live step did")
        True
    """
    shown = f"{names[:3]}{' ...' if len(names) > 3 else ''}" if names else "parameters of another rank"
    return f"the check could not compare gradients: the reference pass gave no gradient for {shown} where {live} did"


def uncomparable_layouts(found: list[str]) -> str:
    """The finding of a check that holds gradients in a layout it cannot compare (nested, MKL-DNN), each in ``found``
    as ``"name (layout)"``.

    Example::

        >>> uncomparable_layouts(["w (torch.jagged)"])[:77]
        "the check could not compare gradients: ['w (torch.jagged)'] hold gradients in"
    """
    shown = f"{found[:3]}{' ...' if len(found) > 3 else ''}" if found else "parameters of another rank"
    return (
        f"the check could not compare gradients: {shown} hold gradients in a layout it cannot compare; it compares"
        " strided and sparse (COO, CSR, CSC, BSR, BSC) gradients only, so it gives no verdict while these have"
        " another layout: give them a strided or sparse gradient, or check a model without them"
    )


def first_line(error: BaseException) -> str:
    """``"Type: first line of the message"``.

    Example::

        >>> first_line(ValueError("bad\\nvalue"))
        'ValueError: bad'
    """
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def describe_error(error: Exception) -> str:
    """``"Type: message"`` of an error a pass raised.

    Example::

        >>> describe_error(RuntimeError("shape changed"))
        'RuntimeError: shape changed'
    """
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class RegionReport:
    """What one checkpointed region's recomputation did, compared with its original forward.

    Attributes:
        name: The region's module name, relative to the module the check ran on.
        ops_compared: How many recomputed ops were matched with the forward's and compared (values, or shapes for
            views and uninitialised memory), over every call of the region in the step.
        max_abs_diff: Largest absolute difference of any recomputed tensor from the forward's (``inf`` when a
            shape or the sequence of ops changed, or a saved tensor no compared op produced differed).
        first_divergent_op: The first op that differed, as ``(aten name, position among the region's ops from
            0)``; ``None`` when none did.
        diverged: Whether the difference counts against the verdict: when ``cause`` is set and the gradients
            diverged beyond the tolerance and the noise floor, or whatever the gradients for a cause that changed the
            region's state (``buffer_mutation``, ``parameter_write``, ``metric_update``, ``attribute_mutation``). A
            recomputation that ran other ops but gave the gradients of the pass without it (a cache rebuilt in the
            forward and found built in the recomputation) has its cause and ``diverged`` false.
        cause: A :class:`~lightning_ckpt_determinism.verify.cause.Cause` when recomputation did not reproduce the
            forward; ``None`` when it reproduced every compared value and buffer exactly.
        hint: What to change, for people: :data:`CAUSE_HINTS` of ``cause`` followed by what was found (the
            buffers changed), or, for an input modified in place after the forward, a hint of its own; ``None``
            when ``cause`` is.
        buffer_mutations: The names of the buffers of the region that recomputation changed.
        attribute_mutations: The names of the plain Python attributes of the region's modules that ended the
            checkpointed pass otherwise than the reference pass (recomputation changed them a second time).
        error: With ``cause`` ``"recompute_error"`` (or an error that decided another cause), the first line of the
            exception raised while the region was recomputed, as ``"Type: message"``; ``None`` otherwise.
        recomputations: How many times the region was recomputed in the pass, over all its calls. More
            recomputations than calls come from a gradient penalty or ``retain_graph=True``; only the first
            recomputation of each call is compared.
        data_dependent_ops: The data-dependent ops the region's forward ran (aten name), each with whether
            ``keep_data_dependent`` (or ``save_ops``) kept its outputs from the forward at every call; ``False``
            when they were recomputed (the option is off, or their floating outputs exceed the size rule).
        calls: How many times the region ran checkpointed (eagerly, with gradients enabled) in the checked pass (an
            RNN's cell: once a timestep); calls under ``no_grad`` run plainly and are not counted.
        first_divergent_call: Which of those calls ``first_divergent_op`` (or the failure that decided ``cause``)
            came from, from 0 in the order the forward made them; ``None`` when no call differed.

    Example::

        >>> region = RegionReport(name="model.blocks.1", ops_compared=7)
        >>> region.diverged, region.cause
        (False, None)
    """

    name: str
    ops_compared: int = 0
    max_abs_diff: float = 0.0
    first_divergent_op: tuple[str, int] | None = None
    diverged: bool = False
    cause: Cause | None = None
    hint: str | None = None
    buffer_mutations: list[str] = field(default_factory=list)
    attribute_mutations: list[str] = field(default_factory=list)
    error: str | None = None
    recomputations: int = 0
    data_dependent_ops: dict[str, bool] = field(default_factory=dict)
    calls: int = 0
    first_divergent_call: int | None = None


@dataclass(frozen=True)
class RecomputationReport:
    """What one recomputation check found.

    Attributes:
        grad_divergence: Relative L2 divergence of the gradients: the norm of the difference over all parameters
            divided by the norm of the reference gradients; ``0.0`` when identical, ``inf`` when the
            checkpointed pass failed or produced a non-finite value the reference did not.
        max_abs_diff: Largest absolute difference of any gradient element.
        diverged: Whether ``grad_divergence`` exceeds both the tolerance and the noise floor, or the checkpointed
            pass raised, or state that changes no gradient (buffers, attributes) ended the checked pass otherwise
            than the reference pass, or a region's recomputation changed its state (``regions``, a cause such as
            ``metric_update``, which the check puts back): a plain twin would not have it (``cause`` says which
            where nothing else explains the step, and with attribution ``regions`` say where). Both engines decide
            it alike.
        tolerance: The tolerance the verdict used.
        per_parameter: Largest absolute gradient difference for each parameter, by parameter name.
        worst_parameters: The parameters with the largest differences, worst first (at most five, only those
            that differ).
        error: The exception raised during the checkpointed pass (e.g. torch's ``CheckpointError`` when a
            recomputed tensor's shape differs), as ``"Type: message"``; ``None`` when it ran.
        checked_regions: Names of the checkpointed modules the check exercised: those its checkpointed pass
            recomputed (every region of a compiled model, whose recomputation runs inside its graphs).
        reference_loss: The loss of the reference pass.
        checkpointed_loss: The loss of the checkpointed pass (``nan`` when it raised before computing one).
        noise_floor: With ``calibrate_noise``, twice the ``grad_divergence`` between two reference passes: what
            non-deterministic kernels alone produce, with a margin; ``0.0`` otherwise.
        regions: With ``attribution``, one :class:`RegionReport` per checkpointed region in module order: where
            recomputation differed from the forward, at which op, and why; empty otherwise.
        buffer_mutations: The names of the buffers recomputation changed (relative to the checked module),
            whether or not that changed a gradient: those that ended the checked (live or checkpointed) pass
            otherwise than the reference pass, and with ``attribution`` those a region's recomputation changed from
            its forward's values (see ``regions``).
        attribute_mutations: The names of the plain Python attributes of the modules inside checkpointed regions
            (relative to the checked module) that ended the checkpointed step otherwise than the reference pass: a
            forward's side effect that recomputation repeats (a list appended to), which the package does not replay.
            Attribute names given as ``exclude_attributes`` are left out.
        compiled: Whether the module is compiled. Both passes then ran compiled, and ``regions`` come from the same
            step rerun eagerly (eager semantics): a region's ``diverged`` counts only when the compiled gradients
            diverged too, since compile replays RNG and updates buffers by itself.
        cause: When the compiled step diverged and the same step run eagerly did not (found with ``attribution``):
            ``"compiler_recompute"`` when the divergence repeats from the same state (the compiler's recomputation
            differs, where no eager comparison can see it; the regions whose compiled backward graphs redraw a random
            op instead of replaying the forward's draw get this cause in ``regions`` too), or
            ``"nondeterministic_kernel"`` when the compiled passes differ from themselves run to run. From either
            check: ``"buffer_mutation"`` when the gradients agree but buffers differ from the reference's and no
            region report places them (without attribution; ``buffer_mutations`` names them), else
            ``"attribute_mutation"`` when attributes do;
            ``"outside_state"`` when the gradients diverged and the reference pass's loss differs from the
            checkpointed one, which recomputation cannot explain (the forward ran before anything was recomputed; a
            step that recomputed an eager region before its loss, as a gradient penalty does, gets it only where
            attribution found every region exact); no region is then counted as diverged. ``None`` otherwise.
        hint: :data:`CAUSE_HINTS` of ``cause`` (with a note on compiled kernels for ``"nondeterministic_kernel"``,
            the buffers changed for ``"buffer_mutation"``); ``None`` when ``cause`` is.
        not_restored: The parameters the step or the check's passes wrote in place that the check had no copy of
            (they were not among ``written_parameters``), so it could neither start each pass from them nor put
            them back: training continues from their changed values, and the check gives no ``"outside_state"``
            for a forward they made differ. Empty when the check put everything back.

    Example::

        >>> report = RecomputationReport(grad_divergence=0.0, max_abs_diff=0.0, diverged=False, tolerance=0.0)
        >>> report.diverged
        False
    """

    grad_divergence: float
    max_abs_diff: float
    diverged: bool
    tolerance: float
    per_parameter: dict[str, float] = field(default_factory=dict)
    worst_parameters: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None
    checked_regions: list[str] = field(default_factory=list)
    reference_loss: float = math.nan
    checkpointed_loss: float = math.nan
    noise_floor: float = 0.0
    regions: list[RegionReport] = field(default_factory=list)
    buffer_mutations: list[str] = field(default_factory=list)
    attribute_mutations: list[str] = field(default_factory=list)
    compiled: bool = False
    cause: Cause | None = None
    hint: str | None = None
    not_restored: list[str] = field(default_factory=list)
