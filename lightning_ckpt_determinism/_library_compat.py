"""Every reading of another library's internals or message text, other than torch's, in one place: Lightning's,
torchmetrics', jsonargparse's and transformers', each with the versions it is known in.

An upgrade of one of them touches this file only (torch's are in :mod:`~lightning_ckpt_determinism._torch_compat`).
Each entry has a test pinned to the installed version (``tests/test_library_compat.py``).
"""

import ast
import re
from collections.abc import Callable
from itertools import takewhile
from typing import Any

from torch import nn

__all__ = [
    "METRIC_BOOKKEEPING",
    "ModelSetupHook",
    "bool_expected",
    "class_refusing",
    "compiled_by_lightning",
    "is_unknown_strategy_error",
    "lightning_logs_this_batch",
    "list_expected",
    "literal_rejection",
    "metric_state_names",
    "package_message_in",
    "reads_cache_only",
    "rejected_value",
]

METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache", "_is_synced", "_cache")
"""The private attributes of a torchmetrics ``Metric`` that an update changes besides its states (torchmetrics 1.x)."""

# jsonargparse nests the errors of each part of a config under the part's key, one level deeper each time.
_PARSER_KEY = re.compile(r'( *)Parser key "([^"]+)":(.*)')
# The package's messages start with the argument they are about, in backticks; jsonargparse's never do.
_PACKAGE_MESSAGE = re.compile(r"^ *- (`.+)$", re.MULTILINE)
# jsonargparse's reason for a class that has no such argument (4.x), with the class path it tried.
_REFUSED_OPTION = re.compile(r"Problem with given class_path '([^']+)':\s*Option '([^']+)' is not accepted")
# jsonargparse's reason for a single value where a list is expected (4.x).
_LIST_EXPECTED = re.compile(r"Expected a <class 'list'>(?:, got|\. Got value:) (.*)")
# jsonargparse's reason for a value a `Callable` argument refuses (4.x): a path to nothing, or a function whose
# return annotation is not the one the argument's type names.
_CALLABLE_REFUSED = re.compile(r"expects a function or a callable class: (.*)")
# jsonargparse's reason for a value a `bool` argument refuses (4.x).
_BOOL_EXPECTED = re.compile(r"Expected a <class 'bool'>\. Got value: (.*)")
# jsonargparse's reason for a value a `Literal` refuses.
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)")


class ModelSetupHook:
    """Lightning's protected ``Strategy._setup_model(model)`` (Lightning 2.0 to 2.6: where ``setup`` hands the model
    to the strategy's wrapper, DDP's or FSDP's), reached as the package's own hook ``_around_setup_model``.

    Put it among the bases before the Lightning strategy; a subclass overrides ``_around_setup_model(model, setup)``,
    where ``setup`` is the strategy's own ``_setup_model``, and returns what the strategy should hold. Strategies that
    never call ``_setup_model`` (``ModelParallelStrategy``) never call the hook.

    Example::

        >>> class Base:
        ...     def _setup_model(self, model):
        ...         return ("wrapped", model)
        >>> class Hooked(ModelSetupHook, Base):
        ...     def _around_setup_model(self, model, setup):
        ...         return setup(f"prepared {model}")
        >>> Hooked()._setup_model("model")
        ('wrapped', 'prepared model')
    """

    def _around_setup_model(self, model: nn.Module, setup: Callable[[nn.Module], nn.Module]) -> nn.Module:
        return setup(model)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self._around_setup_model(model, super()._setup_model)  # type: ignore[misc]


def compiled_by_lightning(pl_module: Any) -> bool:
    """Whether Lightning compiles ``pl_module``'s steps: a ``trainer.fit(torch.compile(module))`` hands the Trainer
    the module itself and compiles its ``forward`` and step methods as functions, noting the compile options in the
    module's ``_compiler_ctx`` (Lightning 2.0 to 2.6), where no compiled submodule shows it.

    Example::

        >>> from types import SimpleNamespace
        >>> compiled_by_lightning(SimpleNamespace(_compiler_ctx=None)), compiled_by_lightning(object())
        (False, False)
    """
    return getattr(pl_module, "_compiler_ctx", None) is not None


def reads_cache_only(module: nn.Module) -> bool:
    """Whether transformers marks ``module``'s layer class as only reading its key-value cache, which its own gradient
    checkpointing then keeps (``GradientCheckpointingLayer._can_checkpoint_with_cache``, transformers 5.x: a decoder
    attending over what an encoder put in the cache in the same forward).

    Example::

        >>> reads_cache_only(nn.Linear(2, 2))
        False
    """
    return getattr(type(module), "_can_checkpoint_with_cache", False) is True


def lightning_logs_this_batch(trainer: Any) -> bool:
    """Whether the training batch ending now is one Lightning writes to its loggers at its interval: its logger
    connector's ``should_update_logs`` without its ``trainer.should_stop`` term. It counts batches that stepped
    (``fit_loop.epoch_loop._batches_that_stepped``, one more while the batch ends, Lightning 2.0 to 2.6), once per
    batch whatever the number of optimizers (``global_step`` counts each optimizer's step). Lightning also logs the
    batch after which ``should_stop`` is set; that flag is one rank's own (a stop a module decides from its loss), and
    a read of the sentinel on the ranks that set it alone would wait for the others: left out, every rank reads at the
    same batches, and the fit's end reads the rest. Read in ``on_train_batch_end``.

    Example::

        >>> from types import SimpleNamespace
        >>> loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=49))
        >>> trainer = SimpleNamespace(fit_loop=loop, log_every_n_steps=50, should_stop=True)
        >>> lightning_logs_this_batch(trainer), lightning_logs_this_batch(SimpleNamespace(**{**vars(trainer),
        ...     "fit_loop": SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=50))}))
        (True, False)
    """
    every = trainer.log_every_n_steps
    return bool(every) and (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


def metric_state_names(metric: Any) -> list[str]:
    """The names of a torchmetrics ``Metric``'s states, those ``add_state`` registered (``Metric._defaults``,
    torchmetrics >= 0.5).

    Args:
        metric: A ``torchmetrics.Metric``.

    Example::

        >>> import torch
        >>> from torchmetrics import Metric
        >>> class Total(Metric):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        ...     def update(self, value):
        ...         self.total += value
        ...     def compute(self):
        ...         return self.total
        >>> metric_state_names(Total())
        ['total']
    """
    return list(metric._defaults)


def package_message_in(text: str) -> str | None:
    """This package's own message inside a jsonargparse error text (jsonargparse lists a validator's message on a
    ``  - `` line; the package's messages start with a backticked argument name), or ``None``.

    Args:
        text: The error's text.

    Example::

        >>> package_message_in('Parser key "every_n":\\n  - `every_n` must be an integer >= 1, got 0.')
        '`every_n` must be an integer >= 1, got 0.'
    """
    found = _PACKAGE_MESSAGE.search(text)
    return found[1] if found else None


def literal_rejection(reason: str) -> tuple[list[Any], str] | None:
    """The choices and the value (as jsonargparse prints it) of jsonargparse's reason for a value that a ``Literal``
    refuses (4.x: ``Expected a typing.Literal['a', 'b']. Got value: c``), or ``None`` for another reason.

    Args:
        reason: Why jsonargparse refused a value, as :func:`rejected_value` gives it after the key.

    Example::

        >>> literal_rejection("Expected a typing.Literal['warn', 'raise']. Got value: stop")
        (['warn', 'raise'], 'stop')
    """
    found = _LITERAL.fullmatch(reason)
    if found is None:
        return None
    try:
        choices = ast.literal_eval(f"[{found[1]}]")
    except (SyntaxError, ValueError):
        return None
    return choices, found[2]


def class_refusing(text: str) -> tuple[str, str] | None:
    """The class path and the option of jsonargparse's error for a class given an argument it does not take
    (4.x: ``Problem with given class_path 'x.Y': Option 'z' is not accepted``), or ``None`` for another error.

    Args:
        text: The message of jsonargparse's ``ArgumentError``.

    Example::

        >>> class_refusing("Problem with given class_path 'a.B':\\n  Option 'checkpointing.classes' is not accepted")
        ('a.B', 'checkpointing.classes')
    """
    found = _REFUSED_OPTION.search(text)
    return None if found is None else (found[1], found[2])


def bool_expected(reason: str) -> str | None:
    """The value jsonargparse's ``reason`` says a ``bool`` argument refused, as it prints it; ``None`` for another
    reason.

    Example::

        >>> bool_expected("Expected a <class 'bool'>. Got value: 2")
        '2'
    """
    found = _BOOL_EXPECTED.fullmatch(reason)
    return None if found is None else found[1]


def list_expected(reason: str) -> str | None:
    """The value of jsonargparse's reason for a single value given where a list is expected (4.x: ``Expected a
    <class 'list'>, got Block``), or ``None`` for another reason.

    Args:
        reason: Why jsonargparse refused a value, as :func:`rejected_value` gives it after the key.

    Example::

        >>> list_expected("Expected a <class 'list'>, got ConvBlock")
        'ConvBlock'
    """
    found = _LIST_EXPECTED.fullmatch(reason)
    return None if found is None else found[1]


def is_unknown_strategy_error(err: BaseException) -> bool:
    """Whether ``err`` is Lightning's error for a strategy name it does not know (``strategy: dpp``; its message says
    "invalid strategy name", Lightning 2.x).

    Args:
        err: What building the Trainer raised.

    Example::

        >>> is_unknown_strategy_error(ValueError("You selected an invalid strategy name: `strategy='dpp'`."))
        True
    """
    return "invalid strategy name" in str(err)


def rejected_value(text: str) -> str:
    """The innermost value that jsonargparse's nested error message rejects, as ```full.key`: why``.

    Parses jsonargparse's text (4.x: ``Parser key "...":`` lines nested by indentation, ``Does not validate against
    any of the Union subtypes`` with its ``- `` alternatives and ``Given value:`` lines; checked on 4.40 to 4.42).

    Args:
        text: The message of jsonargparse's ``ArgumentError``.

    Example::

        >>> rejected_value('Parser key "trainer":\\n  Parser key "max_steps":\\n    Expected an int, got "x"')
        '`trainer.max_steps`: Expected an int, got "x"'
    """
    lines = text.splitlines()
    chain: list[tuple[int, str]] = []  # (indent, key) of the keys around the current line
    keys: list[str] = []
    at = 0
    for index, line in enumerate(lines):
        if match := _PARSER_KEY.fullmatch(line):
            chain = [outer for outer in chain if outer[0] < len(match[1])] + [(len(match[1]), match[2])]
            if len(chain) > len(keys):
                keys, at = [key for _, key in chain], index
    if not keys:
        return lines[0]
    indent = " " * (len(lines[at]) - len(lines[at].lstrip()) + 2)
    block = [
        line for line in takewhile(lambda line: line.startswith(indent) or not line.strip(), lines[at + 1 :]) if line
    ]
    reason = lines[at].split('":', 1)[1].strip() or next(iter(block), "").strip()
    refused = next((match[1] for line in block if (match := _CALLABLE_REFUSED.search(line))), None)
    if refused is not None:
        return f"`{'.'.join(keys)}`: {refused}"
    options = [number for number, line in enumerate(block) if line.startswith(indent + "  - ")]
    if reason.startswith("Does not validate against any of the Union subtypes") and options:
        # Of the alternatives, the class whose arguments were given is the one meant, else the first (None is last).
        first = next((number for number in options if block[number].endswith(":")), options[0])
        option = block[first].strip()[2:]
        if option.endswith(":") and first + 1 < len(block):  # "Problem with given class_path '...':" above why
            reason = block[first + 1].strip()
        else:
            given = [line.strip() for line in block if line.startswith(indent + "Given value:")]
            expected = re.sub(r"Not a valid subclass of (\S+)", r"expected a mapping of \1 arguments", option)
            reason = f"{expected}, got {given[-1].removeprefix('Given value: ')}" if given else expected
    return f"`{'.'.join(keys)}`: {reason}"
