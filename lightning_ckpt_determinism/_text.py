"""Plain-text tables, as the audit and the memory budget print them."""

from collections.abc import Sequence

__all__ = ["aligned"]


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
