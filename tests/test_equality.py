"""`same_values` and `same_item` (`checkpointing/equality.py`), which the first-call probe and the checks share, held
against the checks' own elementwise difference: equal exactly where that difference is zero."""

import io
import random

import numpy as np
import pytest
import torch

from lightning_ckpt_determinism.checkpointing.equality import object_state, own_dict, same_item, same_values
from lightning_ckpt_determinism.verify.compare import max_abs_difference

NAN, INF = float("nan"), float("inf")

PAIRS = [
    (torch.tensor([1.0, NAN]), torch.tensor([1.0, NAN])),
    (torch.tensor([1.0, NAN]), torch.tensor([NAN, 1.0])),
    (torch.tensor([INF, -INF]), torch.tensor([INF, -INF])),
    (torch.tensor([INF]), torch.tensor([-INF])),
    (torch.tensor([-0.0]), torch.tensor([0.0])),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-6])),
    (torch.tensor([3, 4]), torch.tensor([3, 5])),
    (torch.tensor([True, False]), torch.tensor([True, True])),
    (torch.tensor([complex(NAN, 1.0)]), torch.tensor([complex(NAN, 2.0)])),
    (torch.tensor([complex(NAN, 1.0)]), torch.tensor([complex(NAN, 1.0)])),
    (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)),
]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_same_values_is_a_zero_elementwise_difference(first: torch.Tensor, second: torch.Tensor) -> None:
    assert same_values(first, second) is (max_abs_difference(first, second) == 0.0)


def test_same_values_needs_the_same_shape_and_dtype() -> None:
    assert not same_values(torch.zeros(2), torch.zeros(1, 2))
    assert not same_values(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_same_item_compares_tensors_by_values_and_anything_else_by_type_and_equality() -> None:
    assert same_item(torch.tensor([NAN]), torch.tensor([NAN]))
    assert not same_item(torch.ones(1), 1.0)
    assert same_item(3, 3) and not same_item(3, 3.0) and not same_item(True, 1)
    assert not same_item(torch.ones(2), torch.ones(2) + 1)
    # An `==` that is no truth value never raises: such objects are compared by their attributes, where they have any.
    assert same_item(Ambiguous(1), Ambiguous(1)) and not same_item(Ambiguous(1), Ambiguous(2))
    assert not same_item(SlottedAmbiguous(), SlottedAmbiguous())  # no attributes to read: unequal


def test_same_item_compares_tuples_lists_dicts_and_arrays_item_by_item() -> None:
    stats = (torch.ones(2), torch.tensor([NAN, 2.0]))
    assert same_item(stats, tuple(value.clone() for value in stats))
    assert not same_item(stats, (torch.ones(2), torch.tensor([NAN, 3.0])))
    assert not same_item(stats, list(stats)) and not same_item(stats, stats[:1])
    assert same_item({8: [torch.ones(2)]}, {8: [torch.ones(2)]}) and not same_item({8: [torch.ones(2)]}, {9: [1]})
    assert same_item([np.array([NAN, 1.0])], [np.array([NAN, 1.0])])
    assert not same_item(np.zeros(2), np.zeros(3)) and not same_item(np.zeros(2), np.zeros(2, dtype=np.int64))
    tensors = np.empty(2, dtype=object)
    tensors[:] = [torch.ones(2), torch.zeros(3)]
    assert same_item(tensors, tensors.copy()) and not same_item(tensors, np.array([1, 2], dtype=object))


def test_same_item_answers_unequal_where_no_comparison_ends_and_never_raises() -> None:
    loop: list[object] = []
    loop.append(loop)
    again: list[object] = []
    again.append(again)
    assert not same_item(loop, again)
    assert not same_item({"a": Ambiguous(1)}, {"a": Ambiguous(2)})


def test_objects_of_the_users_own_classes_are_compared_by_their_attributes_a_few_objects_deep() -> None:
    # A record made afresh with the same values is the same state; other values, or another class, are not.
    assert same_item(Record(Record(torch.ones(2))), Record(Record(torch.ones(2))))
    assert not same_item(Record(Record(torch.ones(2))), Record(Record(torch.zeros(2))))
    assert not same_item(Record(1), Ambiguous(1))
    # Deeper than three objects, identity decides: a chain of fresh records is unequal, the same chain equal.
    deep = Record(Record(Record(Record(1))))
    assert same_item(deep, deep) and not same_item(deep, Record(Record(Record(Record(1)))))
    assert not same_item(len, abs)  # callables are never compared by their attributes


def test_objects_keeping_state_outside_their_dict_are_never_taken_for_the_same_by_their_attributes() -> None:
    # Their `__dict__` says nothing of a slot, a C base's state or an exception's arguments: identity decides.
    assert not same_item(random.Random(1), random.Random(2)) and not same_item(random.Random(1), random.Random(1))
    assert not same_item(io.StringIO("a"), io.StringIO("b"))
    assert not same_item(ValueError("a"), ValueError("b"))
    assert not same_item(Slotted(1), Slotted(2)) and not same_item(Record(Slotted(1)), Record(Slotted(2)))


def test_objects_keeping_all_their_state_in_slots_are_compared_by_their_slots() -> None:
    assert same_item(OnlySlots(1, torch.ones(2)), OnlySlots(1, torch.ones(2)))
    assert not same_item(OnlySlots(1, torch.ones(2)), OnlySlots(2, torch.ones(2)))
    assert not same_item(OnlySlots(1, torch.ones(2)), OnlySlots(1, torch.zeros(2)))
    unset = OnlySlots(1, torch.ones(2))
    del unset.mean
    assert not same_item(unset, OnlySlots(1, torch.ones(2)))
    assert same_item(Record(OnlySlots(3, None)), Record(OnlySlots(3, None)))
    # A slot not set is read as absent, without the class's own `__getattr__` (which may raise anything).
    assert same_item(AnswersUnknownNames(), AnswersUnknownNames())
    assert object_state(AnswersUnknownNames()) == {} and own_dict(AnswersUnknownNames()) is None


class AnswersUnknownNames:
    """A slotted object whose ``__getattr__`` raises ``KeyError`` for a name it does not know, its slot not set."""

    __slots__ = ("value",)

    def __getattr__(self, name: str) -> object:
        raise KeyError(name)


class OnlySlots:
    """An object keeping all its state in slots, one of them private (stored under a mangled name)."""

    __slots__ = ("__count", "mean")

    def __init__(self, count: int, mean: torch.Tensor | None) -> None:
        self.__count = count
        self.mean = mean


class Ambiguous:
    """An object whose ``==`` returns a tensor of several elements."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> torch.Tensor:  # type: ignore[override]
        return torch.ones(2) == torch.ones(2)

    __hash__ = object.__hash__


class SlottedAmbiguous:
    """An object whose ``==`` returns a tensor of several elements, and which has no ``__dict__``."""

    __slots__ = ()

    def __eq__(self, other: object) -> torch.Tensor:  # type: ignore[override]
        return torch.ones(2) == torch.ones(2)

    __hash__ = object.__hash__


class Slotted:
    """An object keeping part of its state in a slot, beside its ``__dict__``."""

    __slots__ = ("__dict__", "count")

    def __init__(self, count: int) -> None:
        self.count = count


class Record:
    """An object of a user's own class, compared by identity by ``==``."""

    def __init__(self, value: object) -> None:
        self.value = value


def test_same_item_takes_nan_for_nan_in_the_same_parts_of_a_number() -> None:
    assert same_item(NAN, float("nan")) and same_item(np.float32(NAN), np.float32(NAN))
    assert same_item(complex(NAN, 1.0), complex(NAN, 1.0))
    assert not same_item(complex(NAN, 1.0), complex(1.0, NAN)) and not same_item(complex(NAN, 1.0), complex(NAN, 2.0))
    assert not same_item(NAN, 1.0) and not same_item(np.float32(NAN), NAN)


def test_hook_handles_are_the_same_where_they_were_registered_into_the_same_hooks() -> None:
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    handle = first.register_forward_hook(lambda *args: None)
    again = first.register_forward_hook(lambda *args: None)  # a step run again registers under another id
    elsewhere = second.register_forward_hook(lambda *args: None)
    assert handle.id != again.id
    assert same_item(handle, again) and same_item([handle], [again])
    assert not same_item(handle, elsewhere)
