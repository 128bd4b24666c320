"""Digests of saved tensors: exact integer sums of their bit patterns, one integer per tensor, on its device.

A tensor's elements are read as the signed integers of their own width (``float32`` as ``int32``, ``bfloat16`` as
``int16``, complex as its real pairs) and summed along its rows in 32-bit integers (64-bit for 64-bit dtypes); the
row sums are then combined into one integer, each weighted by its row's position (a dot product with ``1, 2, 3 ...``).
The arithmetic wraps around, and integer sums are exact and, modulo the wrap, independent of the order of summation,
so the same bits give the same digest whatever the thread count or kernel; NaN, ``-0.0`` and every other bit
pattern are told apart. The weights make it position-sensitive: values moved to other rows change it. A row is the
trailing dimensions of at least :data:`ROW_ELEMENTS` elements (the last dimension of an activation, several for a
``(batch, seq, 1)`` statistic). What a digest misses: a reordering within a row, and changes that cancel out modulo
2^32 (which any change of a single element, or of a row by a scale or noise, does not).

Sampled digests read one contiguous window of ``1 / SAMPLE_STRIDE`` of each row (of rows of at least
:data:`SAMPLE_STRIDE` elements), the window moving with an offset the caller rotates from step to step, so that
every element is read within ``SAMPLE_STRIDE`` steps. A window, unlike a strided sample, reads a fraction of the
memory too. A change that touches a whole row (a redrawn mask, noise, a scale, a flipped route) shows at once, a
change of single elements only when the window comes to them.
"""

import torch

from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = ["ROW_ELEMENTS", "SAMPLE_STRIDE", "RowWeights", "digest"]

ROW_ELEMENTS = 16
"""The fewest elements a row of a digest spans (trailing dimensions are joined until they reach it)."""

SAMPLE_STRIDE = 16
"""A sampled digest reads one element in this many of each row."""


def digest(tensor: torch.Tensor, offset: int | None = None, weights: "RowWeights | None" = None) -> torch.Tensor | None:
    """The digest of ``tensor`` (this rank's shard of a DTensor), or ``None`` for a tensor whose values cannot be read
    as bits (sparse, quantized, meta, sub-byte dtypes).

    Args:
        tensor: The tensor.
        offset: ``None`` reads every element; an integer reads the window ``offset % SAMPLE_STRIDE`` of each row.
        weights: Where the row weights come from (a :class:`RowWeights` kept by the caller, so that they are made
            once per device); a fresh one when ``None``.

    Example::

        >>> rows = torch.arange(64.0).reshape(2, 32)
        >>> digest(rows).shape
        torch.Size([])
        >>> torch.equal(digest(rows), digest(rows.flip(0)))  # the same values in other rows
        False
        >>> digest(torch.zeros(1)) == digest(-torch.zeros(1))  # 0.0 and -0.0 differ in their sign bit
        tensor(False)
    """
    data = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
    if data.layout != torch.strided or data.is_quantized or data.is_meta:
        return None
    if data.is_complex():
        data = torch.view_as_real(data)
    bits = _BITS.get(data.element_size())
    if bits is None:
        return None
    if data.dim() == 0:
        data = data.reshape(1)
    dims = _row_dims(data.shape)
    columns = data.shape[-1]
    view = data.view(bits[0])
    if offset is not None and columns >= SAMPLE_STRIDE:
        width = -(-columns // SAMPLE_STRIDE)
        start = offset % SAMPLE_STRIDE * width
        view = view[..., start : start + width]
    rows = view.sum(dim=dims, dtype=bits[1]).reshape(-1)
    return torch.dot(rows, (weights or RowWeights())(rows))


class RowWeights:
    """The weights ``1, 2, 3 ...`` of a digest's rows, made once per length, device and integer type.

    Example::

        >>> RowWeights()(torch.zeros(3, dtype=torch.int32))
        tensor([1, 2, 3], dtype=torch.int32)
    """

    def __init__(self) -> None:
        self._made: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        key = (rows.numel(), rows.device, rows.dtype)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = torch.arange(1, key[0] + 1, dtype=rows.dtype, device=rows.device)
        return made


# By element size: the integer view of the bits, and the integer type of their sums.
_BITS = {
    1: (torch.int8, torch.int32),
    2: (torch.int16, torch.int32),
    4: (torch.int32, torch.int32),
    8: (torch.int64, torch.int64),
}


def _row_dims(shape: torch.Size) -> tuple[int, ...]:
    """The trailing dimensions one row spans: the fewest whose elements reach :data:`ROW_ELEMENTS`, or all."""
    elements = 1
    for count, size in enumerate(reversed(shape), start=1):
        elements *= size
        if elements >= ROW_ELEMENTS:
            return tuple(range(-count, 0))
    return tuple(range(-len(shape), 0))
