"""Plain text the package prints: tables, as the audit and the memory budget print them, and a saved tensor in
words, as the sentinel names the first one that differed."""

from collections.abc import Sequence

import torch

__all__ = ["aligned", "describe_saved"]


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` as lines whose columns line up: each cell padded to its column's widest, two spaces between columns,
    no trailing spaces.

    Args:
        rows: The cells of each row, the header first; every row has as many cells.

    Example::

        >>> aligned([("module", "plan"), ("blocks.0", "plain")])
        ['module    plan', 'blocks.0  plain']
    """
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def ordinal(number: int) -> str:
    """``number`` as an English ordinal.

    Args:
        number: A count from 1.

    Example::

        >>> [ordinal(number) for number in (1, 2, 3, 4, 11, 12, 13, 21, 102)]
        ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '102nd']
    """
    suffix = "th" if 11 <= number % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def describe_saved(position: int, producer: str | None, shape: Sequence[int] | None, dtype: torch.dtype | None) -> str:
    """A tensor a checkpointed region saved for backward, in words: which one it was, the autograd node that made
    it, its shape and dtype.

    The node is the tensor's ``grad_fn``: the backward of the op that produced the tensor, which is not always the
    op that saved it (``tanh`` saves its output, which ``tanh`` made; a linear layer saves its input, which the op
    before made).

    Args:
        position: Its place among the tensors the region's forward saved, counted from 0.
        producer: The name of its ``grad_fn`` (``"AddmmBackward0"``); ``None`` for a tensor without one (an input,
            a tensor that needs no gradient).
        shape: Its shape; ``None`` when unknown.
        dtype: Its dtype; ``None`` when unknown.

    Example::

        >>> describe_saved(2, "AddmmBackward0", (16, 16), torch.float32)
        'the 3rd tensor the region saved (made by `AddmmBackward0`, shape (16, 16), float32)'
        >>> describe_saved(0, None, (4,), torch.int64)
        'the 1st tensor the region saved (with no autograd history, shape (4,), int64)'
    """
    parts = [f"made by `{producer}`" if producer else "with no autograd history"]
    if shape is not None:
        parts.append(f"shape {tuple(shape)}")
    if dtype is not None:
        parts.append(str(dtype).removeprefix("torch."))
    return f"the {ordinal(position + 1)} tensor the region saved ({', '.join(parts)})"
