"""How the package names and walks a model's modules: region names as configs write them, their buffers, plain
Python attributes and random generators by name; and where a tensor's values live (a DTensor's shard, a wrapper
subclass's inner tensors, a storage)."""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_ckpt_determinism._torch_compat import (
    OptimizedModule,
    buffer_version_counter,
    own_buffers,
    version_counter,
    waited,
)

__all__ = [
    "SCALARS",
    "buffer_keys",
    "buffer_slots",
    "buffer_written",
    "generator_slots",
    "holds_fsdp_units",
    "holds_values",
    "is_framework_attribute",
    "is_fsdp1_unit",
    "is_wrapper_subclass",
    "local_tensor",
    "named_modules",
    "parameter_version",
    "plain_parts",
    "region_name",
    "state_copy",
    "storage_pointer",
    "write_values",
]

MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""What ``nn.Module.__init__`` sets (``_parameters``, hook dicts, ``training`` ...): never a module's own state."""

SCALARS = (bool, int, float, complex, str, bytes, type(None))
"""The types of the plain Python attributes recomputation replays: immutable values a forward may rebind."""

_DTensor: Any = None
_FSDP1: Any = None
_FSDP2: Any = None
if torch.distributed.is_available():  # a build without torch.distributed has none
    from torch.distributed.fsdp import FSDPModule as _FSDP2
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP1
    from torch.distributed.tensor import DTensor as _DTensor

# The part FSDP1 adds to the names of the modules and parameters inside each of its units (torch's
# `FSDP_WRAPPED_MODULE`) and the one a `torch.compile` wrapper adds: neither is in the names users write.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_orig_mod"})

# What `torch.distributed.fsdp.fully_shard` sets on a module: its registry of composable-API states and flags.
_FRAMEWORK_PREFIXES = ("__composable_api_state_key", "_fsdp_", "_is_fsdp_")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallelism), or the tensor itself.

    Comparing shards keeps every comparison local: in torch 2.13 ``torch.equal`` on DTensors runs a collective. The
    shard is read, never differentiated: it is taken without recording an autograd node.

    Example::

        >>> local_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    if _DTensor is not None and isinstance(tensor, _DTensor):
        # `to_local` is an autograd function: read under grad mode, it would add a node to the graph being recorded
        # (a region's path counts them).
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def plain_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The tensors with storage of their own that hold ``tensor``'s values: the tensor itself, this rank's shard of a
    DTensor, a functional collective's result once waited for, or the inner tensors of a wrapper subclass
    (``__tensor_flatten__``, torch's protocol for subclasses such as quantized weights: in its order, flattened again
    where one is a subclass itself); ``None`` for a subclass whose values are nowhere to be read (no storage and no
    ``__tensor_flatten__``, or one that raises).

    A wrapper subclass has no storage of its own: an op run on it with Python dispatch off (as the package's own
    reads are) would read no memory, so the package reads its inner tensors instead.

    Args:
        tensor: The tensor.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> [part.tolist() for part in plain_parts(TwoTensor(torch.zeros(2), torch.ones(2)))]
        [[0.0, 0.0], [1.0, 1.0]]
    """
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
        return (tensor,)
    # A collective's result not waited for yet (tensor parallelism's all-reduce) holds its values only once waited for.
    tensor = waited(local_tensor(tensor))
    if type(tensor) is torch.Tensor:
        return (tensor,)
    if not hasattr(tensor, "__tensor_flatten__"):
        return (tensor,) if _own_storage(tensor) is not None else None
    flattened = _flattened(tensor)
    if flattened is None:
        return None
    parts: list[torch.Tensor] = []
    for name in flattened[0]:
        inner = plain_parts(getattr(tensor, name))
        if inner is None:
            return None
        parts.extend(inner)
    return tuple(parts) or None


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a wrapper subclass whose values are inner tensors it flattens to (``__tensor_flatten__``,
    a quantized weight), other than a DTensor: its own ``__torch_dispatch__`` may write those inner tensors without
    moving any version counter. A parameter subclass holding its own data (a tagged parameter) is not one.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> is_wrapper_subclass(TwoTensor(torch.zeros(2), torch.ones(2))), is_wrapper_subclass(torch.zeros(2))
        (True, False)
    """
    return hasattr(type(tensor), "__tensor_flatten__") and not _is_dtensor(tensor)


def parameter_version(tensor: torch.Tensor) -> int:
    """A parameter's version counter, with those of the tensors that hold its values (see :func:`plain_parts`): an op
    can write a wrapper subclass's inner tensor (a quantized weight's scale) without moving the wrapper's counter.

    Args:
        tensor: The parameter.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> weight = TwoTensor(torch.zeros(2), torch.ones(2))
        >>> before = parameter_version(weight)
        >>> _ = weight.b.mul_(2)
        >>> parameter_version(weight) - before
        1
    """
    version = version_counter(tensor)
    if type(tensor) is nn.Parameter or type(tensor) is torch.Tensor or is_lazy(tensor) or _is_dtensor(tensor):
        # A DTensor's ops write its shard through it, moving its own counter (FSDP2 sets shards up behind it).
        return version
    return version + sum(version_counter(part) for part in plain_parts(tensor) or () if part is not tensor)


def buffer_written(owner: nn.Module, key: str, buffer: torch.Tensor | None, version: int) -> bool:
    """Whether the buffer ``owner`` holds as ``key`` is no longer ``buffer`` (replaced, created where it was ``None``)
    or was written since its version counter read ``version``.

    Args:
        owner: The module holding the buffer.
        key: Its name there.
        buffer: The buffer read then, or ``None``.
        version: Its version counter then (see ``buffer_version_counter``).

    Example::

        >>> norm = torch.nn.BatchNorm1d(2)
        >>> counter = norm.num_batches_tracked
        >>> version = counter._version
        >>> _ = norm(torch.randn(4, 2))
        >>> buffer_written(norm, "num_batches_tracked", counter, version)
        True
    """
    held = own_buffers(owner).get(key)
    return held is not buffer or (buffer is not None and buffer_version_counter(buffer) != version)


def same_inner_tensors(
    tensor: torch.Tensor, other: torch.Tensor, same: Callable[[torch.Tensor, torch.Tensor], bool]
) -> bool | None:
    """Whether two tensors of one subclass whose values are other tensors (a wrapper subclass's inner tensors, a
    DTensor's shard: see :func:`plain_parts`) hold the same ones by ``same``, compared without an op of the
    subclass's own (a quantized weight may implement none); ``None`` for plain tensors, tensors of two types, or
    values nowhere to be read.

    Args:
        tensor: One tensor.
        other: The other.
        same: Compares two plain tensors.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> same_inner_tensors(TwoTensor(torch.ones(2), torch.zeros(2)), TwoTensor(torch.ones(2), torch.ones(2)),
        ...     torch.equal), same_inner_tensors(torch.ones(2), torch.ones(2), torch.equal)
        (False, None)
    """
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter or type(tensor) is not type(other):
        return None
    parts, others = plain_parts(tensor), plain_parts(other)
    if parts is None or others is None or any(part is tensor for part in parts):
        return None
    return len(parts) == len(others) and all(map(same, parts, others))


def state_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor``'s values: a clone, or for a wrapper subclass (``__tensor_flatten__``: a quantized
    weight) the same subclass rebuilt from copies of its inner tensors, so that a class implementing only the ops its
    forward runs is copied without one of its own.

    Args:
        tensor: The tensor.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> copy = state_copy(TwoTensor(torch.zeros(2), torch.ones(2)))
        >>> type(copy).__name__, copy.b.tolist()
        ('TwoTensor', [1.0, 1.0])
    """
    flattened = _wrapper_flattening(tensor)
    if flattened is None:
        return tensor.detach().clone()
    names, context = flattened
    inner = {name: state_copy(getattr(tensor, name)) for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())  # type: ignore[attr-defined]


def write_values(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (a :func:`state_copy` of a tensor like ``tensor``) into ``tensor`` in place through ``.data``,
    moving no version counter; a wrapper subclass through its inner tensors (see :func:`state_copy`).

    Args:
        tensor: The tensor written.
        value: The values.

    Example::

        >>> buffer = torch.zeros(2)
        >>> write_values(buffer, torch.ones(2))
        >>> buffer.tolist(), buffer._version
        ([1.0, 1.0], 0)
    """
    flattened = _wrapper_flattening(tensor)
    if flattened is None:
        tensor.data.copy_(value)
        return
    for name in flattened[0]:
        write_values(getattr(tensor, name), getattr(value, name))


def _wrapper_flattening(tensor: torch.Tensor) -> tuple[list[str], Any] | None:
    """The ``__tensor_flatten__`` of a wrapper subclass whose values are its inner tensors'; ``None`` for a tensor
    that copies its own (a plain one, a DTensor, one whose ``__tensor_flatten__`` raises: through its own ops)."""
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
        return None
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return None
    return _flattened(tensor)


def _flattened(tensor: torch.Tensor) -> tuple[list[str], Any] | None:
    """``tensor.__tensor_flatten__()`` (its inner tensors' names and its context); ``None`` without the protocol, or
    for a layout its class does not flatten (it raises): read as a subclass without it, never a failure."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, context = flatten()
    except Exception:
        return None
    return list(names), context


def storage_pointer(tensor: torch.Tensor) -> int | None:
    """The address of the storage behind ``tensor`` (this rank's shard of a DTensor, the first inner tensor of a
    wrapper subclass, see :func:`plain_parts`), which views of it share; ``None`` for a subclass without one.

    Example::

        >>> base = torch.zeros(4)
        >>> storage_pointer(base[1:]) == storage_pointer(base)
        True
    """
    if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
        parts = plain_parts(tensor)
        if parts is None:
            return None
        tensor = parts[0]
    return _own_storage(tensor)


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether the storage behind a plain strided ``tensor`` still reaches every element it views. A storage freed
    since the tensor was made (an FSDP2 unit resizes its unsharded parameters' to 0 bytes as it reshards after its
    forward) does not: reading the tensor would read freed memory.

    Args:
        tensor: A tensor with storage of its own (see :func:`plain_parts`).

    Example::

        >>> weight = torch.ones(4, 4)
        >>> view = weight[1:]
        >>> _ = weight.untyped_storage().resize_(0)  # freed, as FSDP2 frees a gathered parameter
        >>> holds_values(view), holds_values(torch.ones(4, 4)[1:])
        (False, True)
    """
    if tensor.numel() == 0:
        return True
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # no storage of its own
        return False
    extent = (
        tensor.storage_offset()
        + 1
        + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    )
    return nbytes >= extent * tensor.element_size()


def _own_storage(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: its storage has no memory
        return None


def region_name(name: str) -> str:
    """A module or parameter name as users write it: without the ``_orig_mod`` a ``torch.compile`` wrapper adds, nor
    the ``_fsdp_wrapped_module`` of an FSDP1 unit (``auto_wrap_policy``).

    Args:
        name: A dotted name from ``named_modules()`` or ``named_parameters()``.

    Example::

        >>> region_name("model._orig_mod.blocks.0")
        'model.blocks.0'
        >>> region_name("model.blocks.0._fsdp_wrapped_module.linear.weight")
        'model.blocks.0.linear.weight'
    """
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def holds_fsdp_units(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it is an FSDP unit: FSDP1's ``FullyShardedDataParallel``, or a module
    FSDP2's ``fully_shard`` made an ``FSDPModule``. Both gather parameters into tensors they reuse, moving their
    version counters with their values unchanged.

    Args:
        module: Any module.

    Example::

        >>> holds_fsdp_units(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        False
    """
    units = tuple(unit for unit in (_FSDP1, _FSDP2) if unit is not None)
    return bool(units) and any(isinstance(sub, units) for sub in module.modules())


def is_fsdp1_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 unit (``FullyShardedDataParallel``): its own attributes are FSDP1's, and the
    module it wraps, a child, shares its name.

    Args:
        module: Any module.

    Example::

        >>> is_fsdp1_unit(torch.nn.Linear(2, 2))
        False
    """
    return _FSDP1 is not None and isinstance(module, _FSDP1)


def named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` by region name, without the compile wrappers and FSDP1's units: each shares its name
    with the module it compiles or wraps, which is the one to select and report.

    Args:
        module: The root module.

    Example::

        >>> model = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
        >>> [(name, type(sub).__name__) for name, sub in named_modules(model)]
        [('', 'Sequential'), ('0', 'Linear')]
    """
    for name, sub in module.named_modules():
        if not isinstance(sub, OptimizedModule) and not is_fsdp1_unit(sub):
            yield region_name(name), sub


def buffer_keys(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every buffer registered on ``module`` and its submodules, as its name, the module that holds it and its key
    there: those registered as ``None`` too (a buffer sized at the first forward).

    Args:
        module: The root module.

    Example::

        >>> norm = torch.nn.BatchNorm1d(2, track_running_stats=False)
        >>> [name for name, _, _ in buffer_keys(norm)]
        ['running_mean', 'running_var', 'num_batches_tracked']
    """
    return [
        (f"{prefix}.{key}" if prefix else key, owner, key)
        for prefix, owner in module.named_modules()
        for key in own_buffers(owner)
    ]


def buffer_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Each buffer of ``module`` that holds a tensor, by its name, with the module that holds it and its key there.

    Args:
        module: The root module.

    Example::

        >>> list(buffer_slots(torch.nn.BatchNorm1d(2)))
        ['running_mean', 'running_var', 'num_batches_tracked']
    """
    slots = {}
    for name, owner, key in buffer_keys(module):
        buffer = own_buffers(owner)[key]
        if buffer is not None:
            slots[name] = (owner, key, buffer)
    return slots


def is_framework_attribute(name: str) -> bool:
    """Whether an attribute name is a framework's bookkeeping on a module (``nn.Module``'s own, FSDP2's).

    Example::

        >>> is_framework_attribute("training"), is_framework_attribute("calls")
        (True, False)
    """
    return name in MODULE_INTERNALS or name.startswith(_FRAMEWORK_PREFIXES)


def generator_slots(module: nn.Module) -> list[tuple[str, torch.Generator]]:
    """The ``torch.Generator`` objects ``module`` and its submodules hold as attributes, by dotted name.

    Args:
        module: The root module.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.noise = torch.Generator().manual_seed(0)
        >>> [name for name, _ in generator_slots(layer)]
        ['noise']
    """
    return [
        (f"{prefix}.{name}" if prefix else name, value)
        for prefix, owner in module.named_modules()
        for name, value in vars(owner).items()
        if isinstance(value, torch.Generator)
    ]
