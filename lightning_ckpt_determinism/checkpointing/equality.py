"""Whether state kept its value: tensors by shape, dtype and elements, objects of the user's own classes by their
attributes, anything else by identity or ``==``.

The probe of a region's first call and the checks read it alike: NaN in the same place on both sides, or the same
infinity, counts as equal. DTensors are compared as this rank's local shards, so no comparison runs a collective.
"""

import contextlib
import math
import numbers
import struct
import types
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from lightning_ckpt_determinism.checkpointing.modules import local_tensor, same_inner_tensors

__all__ = ["object_state", "own_dict", "same_item", "same_values", "slot_values", "slots_of"]


def same_values(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Whether two tensors have the same shape, dtype and values (NaN equal to NaN).

    Args:
        expected: One tensor (a DTensor is read as this rank's shard).
        actual: The other.

    Example::

        >>> same_values(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
        True
    """
    expected, actual = local_tensor(expected), local_tensor(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    inner = same_inner_tensors(expected, actual, same_values)
    if inner is not None:
        return inner
    if torch.equal(expected, actual):
        return True
    if not (expected.is_floating_point() or expected.is_complex()):
        return False
    if expected.is_complex():
        expected, actual = torch.view_as_real(expected.detach()), torch.view_as_real(actual.detach())
    return bool(((expected == actual) | (expected.isnan() & actual.isnan())).all())


def same_item(first: Any, second: Any) -> bool:
    """Identity, or equal values: tensors by :func:`same_values`, NumPy arrays alike, tuples, lists and dicts item by
    item, hook handles by the hooks they were registered into, anything else of one type by a usable ``==`` (a
    number holding NaN equal to one holding NaN in the same parts); an object of the user's own class whose ``==`` is
    identity, or is no truth value (a dataclass holding tensors), by its own attributes, to a depth of
    ``_OBJECT_DEPTH`` objects (a record made afresh at each pass with the same values is the same).

    Args:
        first: One value (an attribute, a container's item).
        second: The other.

    Example::

        >>> same_item(1, 1), same_item(1, 1.0), same_item(torch.ones(2), torch.ones(2))
        (True, False, True)
        >>> same_item(float("nan"), float("nan")), same_item(complex(1, float("nan")), complex(float("nan"), 1))
        (True, False)
        >>> same_item((torch.ones(2), torch.zeros(2)), (torch.ones(2), torch.zeros(2)))
        True
        >>> class Record:
        ...     def __init__(self, value):
        ...         self.value = value
        >>> same_item(Record(torch.ones(2)), Record(torch.ones(2))), same_item(Record(1), Record(2))
        (True, False)
    """
    return _same(first, second, _OBJECT_DEPTH)


_OBJECT_DEPTH = 3
"""How many objects deep :func:`same_item` compares objects by their attributes; deeper ones by identity."""

_OBJECT_ATTRIBUTES = 64
"""The most attributes an object compared by its attributes may have; one with more is compared by identity."""


def _same(first: Any, second: Any, depth: int) -> bool:
    if first is second:
        return True
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and same_values(first, second)
    if type(first) is not type(second):
        return False
    try:
        return _same_of_one_type(first, second, depth)
    except Exception:  # a container that holds itself
        return False


def _same_of_one_type(first: Any, second: Any, depth: int) -> bool:
    """:func:`same_item` of two values of one type that are not tensors."""
    if isinstance(first, RemovableHandle):
        # A step run again registers its hook again, under another id: a handle into the same hooks is the same.
        return first.hooks_dict_ref() is second.hooks_dict_ref()
    # Item by item: `==` over tensors in a tuple, list, dict or object array is no truth value.
    if isinstance(first, tuple | list):
        return len(first) == len(second) and all(
            _same(one, other, depth) for one, other in zip(first, second, strict=True)
        )
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(value, second[key], depth) for key, value in first.items())
    if isinstance(first, np.ndarray):
        if first.shape != second.shape or first.dtype != second.dtype:
            return False
        if first.dtype.kind == "O":
            return all(_same(one, other, depth) for one, other in zip(first.flat, second.flat, strict=True))
        return bool(np.array_equal(first, second, equal_nan=first.dtype.kind in "fc"))
    try:
        if bool(first == second):
            return True
    except Exception:  # an `==` that is no truth value: over tensors a dataclass holds, elementwise
        return _same_attributes(first, second, depth)
    if isinstance(first, numbers.Complex):
        return _both_nan_alike(first, second)
    return type(first).__eq__ is object.__eq__ and _same_attributes(first, second, depth)


def _same_attributes(first: Any, second: Any, depth: int) -> bool:
    """Whether two objects of the user's own class hold the same attributes (``depth`` more objects deep); an object
    that keeps state :func:`object_state` cannot read (a C base's, such as ``random.Random``'s or ``io.StringIO``'s,
    an exception's ``args``) is never the same as another."""
    if depth <= 0 or callable(first):
        return False
    own, other = object_state(first), object_state(second)
    if own is None or other is None or len(own) > _OBJECT_ATTRIBUTES or own.keys() != other.keys():
        return False
    return all(_same(value, other[key], depth - 1) for key, value in own.items())


def _both_nan_alike(first: numbers.Complex, second: numbers.Complex) -> bool:
    """Whether two numbers that are not ``==`` hold NaN in the same parts and equal values in the others (a float
    attribute set to NaN at each pass, ``float("nan") != float("nan")``)."""
    return all(
        one == other or (math.isnan(one) and math.isnan(other))
        for one, other in ((first.real, second.real), (first.imag, second.imag))
    )


_POINTER = struct.calcsize("P")
_HEAP_TYPE = 1 << 9  # `Py_TPFLAGS_HEAPTYPE`: a class made by a `class` statement

# Each class's slots, found once (classes hold them until they are collected).
_SLOTS: "weakref.WeakKeyDictionary[type, tuple[tuple[str, Any], ...] | None]" = weakref.WeakKeyDictionary()


def slots_of(cls: type) -> tuple[tuple[str, Any], ...] | None:
    """The slots of ``cls``'s instances (``__slots__``, as ``@dataclass(slots=True)`` makes), as ``(attribute name,
    member descriptor)`` pairs, where its instances keep all their state in their ``__dict__`` and these slots; ``None``
    where they keep state neither shows (a class written in C, or a C base's fields, such as ``random.Random``'s or
    an exception's ``args``, or items, as a tuple's), or a slot shares its name with another.

    Args:
        cls: The class of an object.

    Example::

        >>> class Memory:
        ...     __slots__ = ("last", "__count")
        >>> [name for name, _ in slots_of(Memory)], slots_of(int)
        (['_Memory__count', 'last'], None)
    """
    try:
        return _SLOTS[cls]
    except KeyError:
        found = _SLOTS[cls] = _slots_of(cls)
        return found
    except TypeError:  # a class that takes no weak reference
        return _slots_of(cls)


def _slots_of(cls: type) -> tuple[tuple[str, Any], ...] | None:
    # A class written in C keeps fields of its own, read-only members among them (`timedelta.days`, `slice.start`).
    if not all(klass.__flags__ & _HEAP_TYPE for klass in cls.__mro__[:-1]):
        return None
    # Each slot is a member descriptor in the `__dict__` of the class that declared it, under its stored name.
    members = [
        (name, member)
        for klass in cls.__mro__[:-1]
        for name, member in vars(klass).items()
        if isinstance(member, types.MemberDescriptorType)
    ]
    # Laid out as object's, with one pointer per slot, per `__weakref__` and per `__dict__` held inside the instance
    # (a dict Python manages lies before it): no field a slot or the `__dict__` does not show.
    pointers = len(members) + (cls.__weakrefoffset__ != 0) + (cls.__dictoffset__ > 0)
    if cls.__itemsize__ or cls.__basicsize__ != object.__basicsize__ + _POINTER * pointers:
        return None
    if len({name for name, _ in members}) != len(members):
        return None
    return tuple(members)


def object_state(value: object) -> dict[str, Any] | None:
    """The state of an object of the user's own class as its attributes: its ``__dict__`` (the live one) where that
    is all of it, a new dict of its ``__dict__``'s items and its set slots where it has slots (:func:`slots_of`);
    ``None`` where it keeps state neither shows (a C base's fields, an exception's ``args``), or has neither.

    Args:
        value: The object.

    Example::

        >>> class Memory:
        ...     __slots__ = ("last",)
        >>> memory = Memory()
        >>> object_state(memory)
        {}
        >>> memory.last = 1
        >>> object_state(memory), object_state(ValueError("no"))
        ({'last': 1}, None)
    """
    cls = type(value)
    members = slots_of(cls)
    if members is None:
        return None
    own = own_dict(value)
    if not members:
        return own
    return {**({} if own is None else own), **slot_values(value, members)}


def slot_values(value: object, members: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The values of ``value``'s slots that are set, read through each slot's own descriptor (``members``, from
    :func:`slots_of`): no property or ``__getattr__`` of the class is asked.

    Args:
        value: The object.
        members: Its class's slots.

    Example::

        >>> class Memory:
        ...     __slots__ = ("last", "count")
        >>> memory = Memory()
        >>> memory.count = 2
        >>> slot_values(memory, slots_of(Memory))
        {'count': 2}
    """
    values = {}
    for name, member in members:
        with contextlib.suppress(AttributeError):  # not set
            values[name] = member.__get__(value, type(value))
    return values


def own_dict(value: object) -> dict[str, Any] | None:
    """``value``'s own ``__dict__``, or ``None`` where its class gives its instances none (read without the class's
    ``__getattr__``, which may answer a missing ``__dict__`` with anything).

    Args:
        value: Any object.

    Example::

        >>> own_dict(1), own_dict(types.SimpleNamespace(a=1))
        (None, {'a': 1})
    """
    if not type(value).__dictoffset__:
        return None
    try:
        own = object.__getattribute__(value, "__dict__")
    except Exception:
        return None
    return own if isinstance(own, dict) else None
