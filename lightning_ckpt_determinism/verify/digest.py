"""Digests of saved tensors: exact integer sums of their bit patterns, weighted by position, one integer per tensor,
on its device, in one reduction and one dot product per tensor.

A tensor's bits are read as integer words, as wide as its last dimension allows: 64-bit words where that dimension
spans a multiple of 8 bytes (``float32`` pairs, ``bfloat16`` quadruples, ``float64``), else 32-bit words (an odd
number of ``float32``), else one ``int32`` per element (sign-extended); complex dtypes as their real pairs. The words
form a matrix of ``R`` rows, a row being the trailing dimensions of at least :data:`ROW_ELEMENTS` elements (the last
dimension of an activation, several for a ``(batch, seq, 1)`` statistic). The digest is

    sum over r of a[r] * (sum over c of word[r, c])

in 64-bit integers, wrapping around, with odd row weights ``a`` that a multiplicative hash draws from the row's
position (:func:`row_weights`): one reduction (:func:`row_sums`) and one dot product (:meth:`DigestPlans.weigh`) per
tensor, so that nothing larger than one tensor's row sums is ever held. Integer sums are exact and independent of
the order of summation, so the same bits give the same digest whatever the thread count or kernel; NaN, ``-0.0`` and
every other bit pattern are told apart. Any change of a single word changes the digest (its weight is odd, so
invertible modulo the wrap), values moved to other rows change it, and so does a tensor negated or rescaled. What a
digest misses: a reordering within a row, and changes within a row that cancel in its sum (two words changed by
opposite amounts; a row negated with as many words turning up as down).

Sampled digests read one window of about ``1 / SAMPLE_STRIDE`` of the last dimension of every row, the window
moving with an offset the caller rotates from step to step, so that every word is read within ``SAMPLE_STRIDE``
steps; tensors whose last dimension is shorter than ``SAMPLE_STRIDE`` words are read whole. A change that touches a
whole row (a redrawn mask, noise, a scale, a flipped route) shows at once, a change of single words only when the
window comes to them. Tensors that are not views of a matrix of their words (permuted or misaligned ones) are copied
into one first.
"""

from collections.abc import Sequence

import torch

from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = ["ROW_ELEMENTS", "SAMPLE_STRIDE", "DigestPlans", "digest", "digests", "row_sums", "row_weights", "words"]

ROW_ELEMENTS = 16
"""The fewest elements a row of a digest spans (trailing dimensions are joined until they reach it)."""

SAMPLE_STRIDE = 16
"""A sampled digest reads a window of about one word in this many of each row's last dimension."""


def words(tensor: torch.Tensor, offset: int | None = None) -> torch.Tensor | None:
    """The ``(rows, columns)`` integer matrix a digest of ``tensor`` (this rank's shard of a DTensor) reads: all of
    its words, or the window ``offset`` of each row; ``None`` for a tensor whose values cannot be read as bits
    (sparse, quantized, meta, sub-byte dtypes).

    Args:
        tensor: The tensor.
        offset: ``None`` reads every word; an integer reads the window ``offset`` of each row (windows of
            ``ceil(columns / SAMPLE_STRIDE)`` columns, taken in turn).

    Example::

        >>> words(torch.zeros(4, 64)).shape, words(torch.zeros(4, 64)).dtype  # float32 pairs
        (torch.Size([4, 32]), torch.int64)
        >>> words(torch.zeros(4, 64), offset=3).shape  # words 6 and 7 of each row
        torch.Size([4, 2])
        >>> words(torch.zeros(4, 7)).shape, words(torch.zeros(4, 7)).dtype  # rows joined to 28 elements
        (torch.Size([1, 28]), torch.int32)
    """
    data = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
    if data.layout != torch.strided or data.is_quantized or data.is_meta:
        return None
    if data.is_complex():
        data = torch.view_as_real(data)
    size = data.element_size()
    if size not in _WORD:
        return None
    if data.dim() == 0:
        data = data.reshape(1)
    per_word = _word_size(data.shape[-1], size) // size or 1
    columns = _row_elements(data.shape) // per_word
    data = _as_words(data, size)
    rows = data.numel() // columns if columns else 0
    try:
        matrix = data.view(rows, columns)
    except RuntimeError:  # not a view of a matrix (a permuted tensor): its words in order, in a copy
        matrix = data.reshape(rows, columns)
    windows = _windows(columns, data.shape[-1])
    if offset is not None and windows:
        start, width = windows[offset % len(windows)]
        matrix = matrix[:, start : start + width]
    return matrix


def row_sums(matrix: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a word matrix, in 64-bit integers: the one reduction a digest makes of each tensor.

    Args:
        matrix: Words, from :func:`words` or :meth:`DigestPlans.read`.

    Example::

        >>> row_sums(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
        tensor([3, 7])
    """
    return matrix.sum(1, dtype=torch.int64)


def row_weights(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The weights of ``count`` rows: ``(0x9E3779B97F4A7C15 * (r + 1)) mod 2^64``, made odd, as signed 64-bit
    integers.

    Args:
        count: Rows.
        device: Where the weights go.

    Example::

        >>> row_weights(2)
        tensor([-7046029254386353131,  4354685564936845355])
    """
    return (torch.arange(1, count + 1, dtype=torch.int64, device=device) * _ROW_HASH) | 1


def digests(
    tensors: Sequence[torch.Tensor], offset: int | None = None, plans: "DigestPlans | None" = None
) -> torch.Tensor:
    """The digests of ``tensors`` (all on one device), as one ``int64`` vector on that device, in their order.

    Args:
        tensors: The tensors; each must have :func:`words` (callers leave out those that do not).
        offset: ``None`` reads every word; an integer reads the window ``offset`` of each row.
        plans: Where the views and weights come from (a :class:`DigestPlans` kept by the caller, so that they are
            worked out once per shape); a fresh one when ``None``.

    Example::

        >>> rows = torch.arange(64.0).reshape(4, 16) - 20
        >>> found = digests([rows, rows.flip(0), -rows, 2 * rows]).tolist()
        >>> len(set(found))  # other rows, other signs, another scale: four digests
        4
    """
    plans = plans or DigestPlans()
    matrices = [plans.read(tensor, offset) for tensor in tensors]
    if any(matrix is None for matrix in matrices):
        raise ValueError("digests: a tensor has no bits to read (check `words(tensor)` first)")
    if not matrices:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([plans.digest(matrix) for matrix in matrices])  # type: ignore[arg-type]


def digest(tensor: torch.Tensor, offset: int | None = None) -> torch.Tensor | None:
    """The digest of one tensor, as a 0-dimensional ``int64`` tensor on its device, or ``None`` without
    :func:`words`.

    Args:
        tensor: The tensor.
        offset: ``None`` reads every word; an integer reads the window ``offset`` of each row.

    Example::

        >>> digest(torch.zeros(1)) == digest(-torch.zeros(1))  # 0.0 and -0.0 differ in their sign bit
        tensor(False)
    """
    matrix = words(tensor, offset)
    return None if matrix is None else DigestPlans().digest(matrix)


class DigestPlans:
    """How tensors are read and their row sums weighted, worked out once per shape: the views that read a
    contiguous tensor's words, and the row weights of each count of rows.

    Example::

        >>> plans = DigestPlans()
        >>> plans.read(torch.zeros(3, 32)).shape
        torch.Size([3, 16])
        >>> plans.weigh(torch.tensor([0, 1])) == row_weights(2)[1]
        tensor(True)
    """

    def __init__(self) -> None:
        self._views: dict[tuple[torch.Size, torch.dtype], _View | None] = {}
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def read(self, tensor: torch.Tensor, offset: int | None = None) -> torch.Tensor | None:
        """``tensor``'s word matrix (all of it, or the window ``offset`` of each row), or ``None`` for a tensor whose
        values cannot be read as bits: what :func:`words` gives, through two views for a contiguous tensor.

        Args:
            tensor: The tensor (a plain tensor: this rank's shard of a DTensor).
            offset: ``None`` reads every word; an integer reads the window ``offset`` of each row.
        """
        if tensor.is_contiguous():
            key = (tensor.shape, tensor.dtype)
            view = self._views.get(key, _UNPLANNED)
            if view is _UNPLANNED:
                view = self._views[key] = _View.of(tensor)
            if view is not None and tensor.storage_offset() % view.per_word == 0:
                return view.read(tensor, offset)
        return words(tensor, offset)

    def weigh(self, sums: torch.Tensor) -> torch.Tensor:
        """The digest of a tensor from its :func:`row_sums`: their dot product with :func:`row_weights`, a
        0-dimensional ``int64`` tensor on their device.

        Args:
            sums: The tensor's row sums.
        """
        key = (len(sums), sums.device)
        weights = self._weights.get(key)
        if weights is None:
            weights = self._weights[key] = row_weights(len(sums), sums.device)
        if sums.device.type == "cpu":
            return torch.dot(sums, weights)
        return (sums * weights).sum()  # integer dot products are CPU-only

    def digest(self, matrix: torch.Tensor) -> torch.Tensor:
        """The digest of a word matrix (from :meth:`read`), a 0-dimensional ``int64`` tensor on its device.

        Args:
            matrix: The words.
        """
        return self.weigh(row_sums(matrix))


class _View:
    """The views that read one shape of contiguous tensor whose elements pack whole into words: its words, then
    their matrix or a window of it."""

    __slots__ = ("columns", "per_word", "rows", "windows", "word")

    def __init__(self, word: torch.dtype, per_word: int, rows: int, columns: int, windows: list[tuple[int, int]]):
        self.word, self.per_word, self.rows, self.columns, self.windows = word, per_word, rows, columns, windows

    @staticmethod
    def of(tensor: torch.Tensor) -> "_View | None":
        """The views for ``tensor``'s shape, or ``None`` where :func:`words` must read it."""
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized:
            return None
        size = tensor.element_size()
        if tensor.is_meta or tensor.is_complex() or size not in _WORD or tensor.dim() == 0:
            return None
        word = _word_size(tensor.shape[-1], size)
        if word < 4:
            return None
        columns = _row_elements(tensor.shape) * size // word
        rows = tensor.numel() * size // word // columns if columns else 0
        return _View(_WORD[word], word // size, rows, columns, _windows(columns, tensor.shape[-1] * size // word))

    def read(self, tensor: torch.Tensor, offset: int | None) -> torch.Tensor:
        data = tensor.view(self.word)
        if offset is None or not self.windows:
            return data.view(self.rows, self.columns)
        start, width = self.windows[offset % len(self.windows)]
        return data.as_strided((self.rows, width), (self.columns, 1), data.storage_offset() + start)


_UNPLANNED = _View(torch.int32, 1, 0, 0, [])

# 0x9E3779B97F4A7C15 (2^64 over the golden ratio) as a signed 64-bit integer.
_ROW_HASH = 0x9E3779B97F4A7C15 - 2**64

# By byte size: the integer type of an element or a word.
_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _word_size(last: int, size: int) -> int:
    """The bytes of a word for a last dimension of ``last`` elements of ``size`` bytes: 8, 4, or one element."""
    for word in (8, 4):
        if last * size % word == 0 and size <= word:
            return word
    return size


def _as_words(data: torch.Tensor, size: int) -> torch.Tensor:
    """``data``'s elements as words of :func:`_word_size` bytes, sign-extended to ``int32`` when narrower."""
    word = _word_size(data.shape[-1], size)
    elements = data.view(_WORD[size])
    if word == size:
        return elements if size >= 4 else elements.to(torch.int32)
    try:
        return elements.view(_WORD[word])
    except RuntimeError:  # not contiguous in its last dimension, or not aligned to a word: packed from a copy
        return elements.clone(memory_format=torch.contiguous_format).view(_WORD[word])


def _windows(columns: int, last: int) -> list[tuple[int, int]]:
    """The windows (start, width) a sampled digest takes in turn from rows of ``columns`` words whose last dimension
    has ``last`` words: ``ceil(columns / SAMPLE_STRIDE)`` wide, none (the rows read whole) for rows shorter than
    SAMPLE_STRIDE words or joined from several dimensions."""
    if columns < SAMPLE_STRIDE or columns != last:
        return []
    width = -(-columns // SAMPLE_STRIDE)
    return [(start, min(width, columns - start)) for start in range(0, columns, width)]


def _row_elements(shape: torch.Size) -> int:
    """The elements of one row: the trailing dimensions' product, from the last, until it reaches ROW_ELEMENTS."""
    elements = 1
    for size in reversed(shape):
        elements *= size
        if elements >= ROW_ELEMENTS:
            break
    return elements
