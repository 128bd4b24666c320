"""Digests of saved tensors: exact integer sums of their bit patterns, weighted by row and by column, one integer per
tensor, on its device, in two reductions per tensor.

A tensor's bits are read as integer words, as wide as its last dimension allows: 64-bit words where that dimension
spans a multiple of 8 bytes (``float32`` pairs, ``bfloat16`` quadruples, ``float64``), else 32-bit words (an odd
number of ``float32``), else one ``int32`` per element (sign-extended); complex dtypes as their real pairs. The words
form a matrix of ``R`` rows and ``C`` columns, a row being the trailing dimensions of at least :data:`ROW_ELEMENTS`
elements (the last dimension of an activation, several for a ``(batch, seq, 1)`` statistic). The digest is

    sum over r of a[r] * (sum over c of word[r, c])  +  sum over c of b[c] * (sum over r of word[r, c])

in 64-bit integers, wrapping around: row sums weighted by odd row weights ``a`` (:func:`row_weights`) and column sums
weighted by even column weights ``b`` (:func:`column_weights`), both drawn from the position by multiplicative
hashes. Integer sums are exact and independent of the order of summation, so the same bits give the same digest
whatever the thread count, kernel or device; NaN, ``-0.0`` and every other bit pattern are told apart. A small matrix
is weighed in one pass instead, each word times ``a[r] + b[c]`` and summed (the same integer, in two kernels and
a temporary of its size: :data:`ONE_PASS_WORDS`); of a larger one nothing bigger than its row and column sums is held,
so no temporary of a large tensor's size is made on any device. Every single changed word
changes the digest (``a[r] + b[c]`` is odd, so invertible modulo the wrap), and so do values moved to other rows,
words moved within a row (the column sums change), a tensor rescaled, a ``float32`` or ``bfloat16`` one negated. What a
digest misses: changes that cancel in every row sum and every column sum at once (four words of a rectangle changed by
``+d, -d, -d, +d``), and the top bit flipped in an even number of 64-bit words, since each flip adds ``2**63`` times an
odd weight, ``2**63`` modulo the wrap (two ``float64`` values negated; a ``float64`` or complex tensor negated, or a
complex one conjugated, when it holds an even number of such words).

Every tensor is read through one path (:class:`DigestPlans`): a plan worked out once per shape, strides and dtype
views the tensor's memory as its word matrix; a tensor that is not laid out as that matrix (permuted, sliced,
misaligned for wider words) is first copied into one. What a read takes of the matrix is a :class:`DigestMode`, made
once by the caller and handed to every read: all of it (``"exact"``), or (``"sampled"``, ``"light"``) one window of
about ``1 / SAMPLE_STRIDE`` of the last dimension of every row, the window moving with an offset the caller moves on
from step to step, so that every word is read within ``SAMPLE_STRIDE`` steps; tensors whose last dimension is shorter
than ``SAMPLE_STRIDE`` words are read whole. A change that touches a whole row (a redrawn mask, noise, a scale, a
flipped route) shows at once, a change of single words (or words moved within a window) when the window comes to them.

A conjugated or negative view (``x.conj()`` of a complex tensor, the negative views torch's complex kernels make) is
read as the values it shows, from a resolved copy where its bits cannot be viewed as words. A wrapper tensor subclass
(a quantized weight, torch's ``TwoTensor``) is read through the inner tensors that hold its values
(:func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`): its digest is their digests weighted by
their position with the odd row weights, so that a change of any inner tensor, or two inner tensors swapped, changes
it. What a subclass keeps outside its inner tensors (Python values in its ``__tensor_flatten__`` context) is not
read; a subclass without inner tensors to read has no digest (:func:`readable` is false).

The attribution observer identifies an op's inputs by a :class:`Fingerprint`: the tensor's metadata and its exact
digest.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal, get_args

import torch

from lightning_ckpt_determinism.checkpointing.modules import plain_parts
from lightning_ckpt_determinism.config import choice_message
from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = [
    "EXACT",
    "INTEGER_OF_SIZE",
    "SAMPLE_STRIDE",
    "WEIGHT_BYTES",
    "DigestMode",
    "DigestPlans",
    "DigestTier",
    "Fingerprint",
    "Sums",
    "digest",
    "digests",
    "fingerprint",
    "readable",
    "row_weights",
    "words",
]

ROW_ELEMENTS = 16
"""The fewest elements a row of a digest spans (trailing dimensions are joined until they reach it)."""

SAMPLE_STRIDE = 16
"""A sampled digest reads a window of about one word in this many of each row's last dimension."""

DigestTier = Literal["light", "sampled", "exact"]
"""How much of each tensor a digest reads: one window of each row (``"light"``, whose reader, the sentinel, also
digests only a few of a region's saved tensors, and ``"sampled"``), or every word (``"exact"``). The one list of the
sentinel's tiers: every other place reads it with ``typing.get_args``."""


_TIERS = frozenset(get_args(DigestTier))

Sums = tuple[torch.Tensor, torch.Tensor]
"""A word matrix's row sums and column sums (:meth:`DigestPlans.sums`)."""


@dataclass(frozen=True)
class DigestMode:
    """What a digest reads of each tensor, decided once by its caller (the sentinel, per step) and handed to every
    read, so that no two reads of one step can take different words.

    Args:
        tier: ``"exact"`` reads every word; ``"sampled"`` and ``"light"`` read the window ``offset`` of each row
            (windows of ``ceil(columns / SAMPLE_STRIDE)`` columns, taken in turn; rows shorter than ``SAMPLE_STRIDE``
            words, or joined from several dimensions, are read whole).
        offset: The window a sampled digest reads, taken modulo the row's windows (so that moving it on by one each
            step reads every word within ``SAMPLE_STRIDE`` steps); an exact digest reads every word whatever it is.

    Raises:
        ValueError: If ``tier`` is not one of :data:`DigestTier`.

    Example::

        >>> mode = DigestMode("sampled", offset=3)
        >>> mode.window([(0, 2), (2, 2), (4, 2), (6, 2)]), mode.next_step().offset
        ((6, 2), 4)
        >>> EXACT.window([(0, 2), (2, 2)]) is None
        True
    """

    tier: DigestTier = "exact"
    offset: int = 0

    def __post_init__(self) -> None:
        if self.tier not in _TIERS:
            raise ValueError(choice_message("tier", self.tier, get_args(DigestTier)))

    def window(self, windows: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The window ``(start, width)`` of each row this mode reads, or ``None`` for the whole row.

        Args:
            windows: The windows a row is cut into (none for a row read whole).

        Example::

            >>> DigestMode("sampled", offset=5).window([(0, 3), (3, 3)])
            (3, 3)
        """
        if self.tier == "exact" or not windows:
            return None
        return windows[self.offset % len(windows)]

    def next_step(self) -> "DigestMode":
        """The mode of the next step: the same tier, its offset moved on by one.

        Example::

            >>> EXACT.next_step()
            DigestMode(tier='exact', offset=1)
        """
        return replace(self, offset=self.offset + 1)


EXACT = DigestMode()
"""Every word of every tensor, the mode of reads that must see all of it (buffers, fingerprints)."""


def readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values a digest can read as bits: strided, not quantized nor meta, elements of 1, 2, 4
    or 8 bytes (complex ones as their real pairs); this rank's shard of a DTensor, and each inner tensor of a wrapper
    subclass, all on one device (:func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`).

    Args:
        tensor: The tensor.

    Example::

        >>> readable(torch.zeros(2, 3)), readable(torch.zeros(2, 2).to_sparse())
        (True, False)
    """
    if type(tensor) is torch.Tensor:
        return _readable(tensor)
    parts = plain_parts(tensor)
    return parts is not None and all(_readable(part) for part in parts) and len({part.device for part in parts}) == 1


def _readable(data: torch.Tensor) -> bool:
    if data.layout != torch.strided or data.is_quantized or data.is_meta:
        return False
    size = data.element_size() // 2 if data.is_complex() else data.element_size()
    return size in INTEGER_OF_SIZE


def words(tensor: torch.Tensor, mode: DigestMode = EXACT) -> torch.Tensor | None:
    """The ``(rows, columns)`` integer matrix a digest of ``tensor`` (this rank's shard of a DTensor) reads: all of
    its words, or one window of each row; ``None`` for a tensor whose values cannot be read as bits
    (:func:`readable`) or are held by more than one inner tensor (a wrapper subclass: see :func:`digest`).

    Args:
        tensor: The tensor.
        mode: What to read (:class:`DigestMode`); every word by default.

    Example::

        >>> words(torch.zeros(4, 64)).shape, words(torch.zeros(4, 64)).dtype  # float32 pairs
        (torch.Size([4, 32]), torch.int64)
        >>> words(torch.zeros(4, 64), DigestMode("sampled", offset=3)).shape  # words 6 and 7 of each row
        torch.Size([4, 2])
        >>> words(torch.zeros(4, 7)).shape, words(torch.zeros(4, 7)).dtype  # rows joined to 28 elements
        (torch.Size([1, 28]), torch.int32)
    """
    return DigestPlans().read(tensor, mode)


def row_sums(matrix: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a word matrix, in 64-bit integers.

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


def column_weights(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The weights of ``count`` columns: ``(0xC2B2AE3D27D4EB4F * (c + 1)) mod 2^64`` with its low bit cleared (so
    that a row weight plus a column weight is odd), as signed 64-bit integers.

    Args:
        count: Columns.
        device: Where the weights go.

    Example::

        >>> column_weights(2)
        tensor([-4417276706812531890, -8834553413625063778])
    """
    return (torch.arange(1, count + 1, dtype=torch.int64, device=device) * _COLUMN_HASH) & ~1


def digests(
    tensors: Sequence[torch.Tensor], mode: DigestMode = EXACT, plans: "DigestPlans | None" = None
) -> torch.Tensor:
    """The digests of ``tensors`` (all on one device), as one ``int64`` vector on that device, in their order.

    Args:
        tensors: The tensors; each must be :func:`readable` (callers leave out those that are not).
        mode: What to read of each (:class:`DigestMode`); every word by default.
        plans: Where the plans and weights come from (a :class:`DigestPlans` kept by the caller, so that they are
            worked out once per shape); a fresh one when ``None``.

    Example::

        >>> rows = torch.arange(64.0).reshape(4, 16) - 20
        >>> found = digests([rows, rows.flip(0), rows.flip(1), -rows, 2 * rows]).tolist()
        >>> len(set(found))  # rows moved, words moved within rows, other signs, another scale: five digests
        5
    """
    plans = plans or DigestPlans()
    found = [plans.digest_of(tensor, mode) for tensor in tensors]
    if any(one is None for one in found):
        raise ValueError("digests: a tensor has no bits to read (check `readable(tensor)` first)")
    if not found:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(found)  # type: ignore[arg-type]


def digest(tensor: torch.Tensor, mode: DigestMode = EXACT) -> torch.Tensor | None:
    """The digest of one tensor, as a 0-dimensional ``int64`` tensor on its device, or ``None`` when it is not
    :func:`readable`.

    Args:
        tensor: The tensor.
        mode: What to read (:class:`DigestMode`); every word by default.

    Example::

        >>> digest(torch.zeros(1)) == digest(-torch.zeros(1))  # 0.0 and -0.0 differ in their sign bit
        tensor(False)
        >>> values = torch.tensor([1 + 2j, 3 - 4j])
        >>> bool(digest(values.conj()) == digest(values.conj().resolve_conj()))  # the values a conjugate shows
        True
    """
    return DigestPlans().digest_of(tensor, mode)


@dataclass(frozen=True)
class Fingerprint:
    """A tensor, identified by its metadata and its exact digest (the attribution observer compares an op's inputs by
    it).

    Attributes:
        shape: The shape (of this rank's shard of a DTensor).
        dtype: The dtype.
        digest: The :func:`digest` of every word, on the tensor's device; ``None`` for tensors whose values cannot be
            read (:func:`readable`): such fingerprints never match.

    Example::

        >>> Fingerprint((1,), torch.float32, None).same_as(Fingerprint((1,), torch.float32, None))
        False
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: torch.Tensor | None

    def same_as(self, other: object) -> bool:
        """Whether ``other`` is a fingerprint of a tensor with the same metadata and bits.

        Args:
            other: Another fingerprint (anything else is not the same).

        Example::

            >>> fingerprint(torch.tensor([1.0, 2.0])).same_as(fingerprint(torch.tensor([1.0, 2.0])))
            True
        """
        if not isinstance(other, Fingerprint) or self.digest is None or other.digest is None:
            return False
        if (self.shape, self.dtype) != (other.shape, other.dtype) or self.digest.device != other.digest.device:
            return False
        return torch.equal(self.digest, other.digest)


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """A :class:`Fingerprint` of ``tensor`` (this rank's shard of a DTensor): its metadata and exact digest, which
    tell apart any change of value and nearly any reordering.

    Args:
        tensor: The tensor.

    Example::

        >>> fingerprint(torch.tensor([1.0, 2.0])).same_as(fingerprint(torch.tensor([2.0, 1.0])))
        False
    """
    local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
    return Fingerprint(tuple(local.shape), local.dtype, digest(local))


class DigestPlans:
    """How tensors are read and their sums weighted, worked out once per shape, strides and dtype: the views that
    read a tensor's words as a matrix, and the weights of each count of rows and columns.

    Example::

        >>> plans = DigestPlans()
        >>> plans.read(torch.zeros(3, 32), EXACT).shape
        torch.Size([3, 16])
        >>> plans.read(torch.zeros(32, 24).t(), EXACT).shape  # permuted: read from a copy laid out as its words
        torch.Size([24, 16])
    """

    def __init__(self) -> None:
        self._plans: dict[tuple[torch.Size, tuple[int, ...], torch.dtype], _Plan | None] = {}
        self._weights: dict[tuple[int, int, torch.device, bool], torch.Tensor] = {}
        self._weight_bytes = 0
        self._vectors: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """The bytes its cached weights and vectors hold on their devices. The caches are bounded, so that shapes
        that vary from step to step (sequence lengths) cannot grow them: at most :data:`WEIGHT_BYTES` of weights,
        1,024 vectors and 4,096 plans, each cache cleared when a new entry would pass its bound.

        Example::

            >>> plans = DigestPlans()
            >>> _ = plans.digest_of(torch.zeros(4, 64), EXACT)
            >>> plans.held_bytes  # a weight for each of its 4 rows of 32 words (one pass), 8 bytes each
            1024
        """
        vectors = sum(vector.numel() * vector.element_size() for vector in self._vectors.values())
        return self._weight_bytes + vectors

    def digest_of(self, tensor: torch.Tensor, mode: DigestMode) -> torch.Tensor | None:
        """``tensor``'s digest (a 0-dimensional ``int64`` tensor on its device), or ``None`` when it is not
        :func:`readable`: a wrapper subclass's is its inner tensors' digests, weighted by their position.

        Args:
            tensor: The tensor.
            mode: What to read of each of its inner tensors (:class:`DigestMode`).

        Example::

            >>> from torch.testing._internal.two_tensor import TwoTensor
            >>> one, two = torch.zeros(4), torch.ones(4)
            >>> plans = DigestPlans()
            >>> bool(plans.digest_of(TwoTensor(one, two), EXACT) == plans.digest_of(TwoTensor(two, one), EXACT))
            False
        """
        if type(tensor) is torch.Tensor:
            matrix = self.read(tensor, mode)
            return None if matrix is None else self.digest(matrix)
        parts = plain_parts(tensor)
        if parts is None:
            return None
        found = []
        for part in parts:
            matrix = self.read(part, mode)
            if matrix is None:
                return None
            found.append(self.digest(matrix))
        if len(found) == 1:
            return found[0]
        if len({one.device for one in found}) > 1:
            return None
        return self._weighted(torch.stack(found), len(found), 0)

    def read(self, tensor: torch.Tensor, mode: DigestMode) -> torch.Tensor | None:
        """``tensor``'s word matrix (all of it, or the window ``mode`` reads of each row), or ``None`` when it is not
        :func:`readable` or its values are held by more than one inner tensor (see :meth:`digest_of`).

        Args:
            tensor: The tensor (this rank's shard of a DTensor, a wrapper subclass's one inner tensor, is read; a
                conjugated or negative view as the values it shows).
            mode: What to read (:class:`DigestMode`).
        """
        data = tensor
        if type(data) is not torch.Tensor:
            parts = plain_parts(data)
            if parts is None or len(parts) != 1:
                return None
            data = parts[0]
        key = (data.shape, data.stride(), data.dtype)
        try:
            plan = self._plans.get(key, _UNPLANNED)
            if plan is _UNPLANNED:
                if len(self._plans) >= _PLANS:
                    self._plans.clear()  # shapes that vary from step to step bound the cache
                plan = self._plans[key] = _Plan.of(data)
            return None if plan is None else plan.read(data, mode)
        except RuntimeError:
            # A conjugated or negative view refuses to be viewed as words of another dtype: its values are read from
            # a resolved copy. Asked only here, so that reading an ordinary tensor costs no more than before.
            if not (data.is_conj() or data.is_neg()):
                raise
            return self.read(data.resolve_conj().resolve_neg(), mode)

    def digest(self, matrix: torch.Tensor) -> torch.Tensor:
        """The digest of a word matrix (from :meth:`read`), a 0-dimensional ``int64`` tensor on its device.

        Args:
            matrix: The words.
        """
        found = self.digest_or_sums(matrix)
        return found if not isinstance(found, tuple) else self._weighted_sums(found)

    def digest_or_sums(self, matrix: torch.Tensor) -> Sums | torch.Tensor:
        """A word matrix's digest where it is small enough to weigh in one pass (:data:`ONE_PASS_WORDS`), else its
        row and column sums, for :meth:`combined` to weigh with others': the cheaper of the two for each size.

        Args:
            matrix: The words, from :meth:`read`.

        Example::

            >>> plans = DigestPlans()
            >>> plans.digest_or_sums(torch.ones(2, 2, dtype=torch.int64)).shape
            torch.Size([])
        """
        rows, columns = matrix.shape
        if rows * columns <= _one_pass_words(matrix.device):  # each word times its row's weight plus its column's
            return matrix.mul(self._weights_of(rows, columns, matrix.device, each_word=True)).sum(dtype=torch.int64)
        return self.sums(matrix)

    @staticmethod
    def sums(matrix: torch.Tensor) -> Sums:
        """A word matrix's row sums and column sums, in 64-bit integers: what :meth:`combined` weights into its digest
        together with others (two reductions; the weighting is left for many at once).

        Args:
            matrix: The words, from :meth:`read`.

        Example::

            >>> DigestPlans.sums(torch.tensor([[1, 2], [3, 4]]))
            (tensor([3, 7]), tensor([4, 6]))
        """
        return matrix.sum(1, dtype=torch.int64), matrix.sum(0, dtype=torch.int64)

    def combined(self, found: Sequence[Sums | torch.Tensor]) -> torch.Tensor:
        """The digests of several tensors, from each one's :meth:`sums` (or its digest, for a wrapper subclass, from
        :meth:`digest_of`), as one ``int64`` vector on their device: the same values as :meth:`digest` of each, in a
        few kernels for all of them (their sums and their weights joined, multiplied, summed as they run, and the
        running sum read at each tensor's end), however many they are.

        Args:
            found: Each tensor's sums or digest, all on one device, at least one.

        Example::

            >>> plans = DigestPlans()
            >>> matrices = [torch.arange(6).view(2, 3), torch.arange(8).view(4, 2)]
            >>> together = plans.combined([plans.sums(matrix) for matrix in matrices])
            >>> together.tolist() == [plans.digest(matrix).item() for matrix in matrices]
            True
        """
        if len(found) == 1:  # one tensor: its digest as :meth:`digest` weights it, in two kernels
            only = found[0]
            if not isinstance(only, tuple):
                return only.view(1)
            return self._weighted_sums(only).view(1)
        device = (found[0][0] if isinstance(found[0], tuple) else found[0]).device
        # A zero first, so that the running sum starts at zero and a tensor without elements adds nothing.
        zero = self.vector((0,), device)
        parts, weights, lengths = [zero], [zero], []
        for entry in found:
            if isinstance(entry, tuple):
                rows, columns = entry[0].shape[0], entry[1].shape[0]
                parts.extend(entry)
                weights.append(self._weights_of(rows, columns, device))
                lengths.append(rows + columns)
            else:
                parts.append(entry.view(1))
                weights.append(self.vector((1,), device))
                lengths.append(1)
        # The running sum wraps around like every sum of the digest, so its differences at the tensors' ends are
        # each tensor's weighted sum exactly.
        running = torch.cat(parts).mul_(torch.cat(weights)).cumsum(0)
        # Where the running sum starts, after the leading zero, and where each tensor ends.
        ends = running.index_select(0, self.vector((0, *accumulate(lengths)), device))
        return ends[1:] - ends[:-1]

    def _weighted_sums(self, sums: Sums) -> torch.Tensor:
        """The digest of one matrix from its row and column sums."""
        return self._weighted(torch.cat(sums), sums[0].shape[0], sums[1].shape[0])

    def _weighted(self, sums: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """The dot product of ``rows`` row sums then ``columns`` column sums with their weights."""
        weights = self._weights_of(rows, columns, sums.device)
        if sums.device.type == "cpu":
            return torch.dot(sums, weights)
        return (sums * weights).sum()  # integer dot products are CPU-only

    def _weights_of(self, rows: int, columns: int, device: torch.device, *, each_word: bool = False) -> torch.Tensor:
        """The weights of ``rows`` row sums then ``columns`` column sums, or (``each_word``) the ``(rows, columns)``
        matrix of each word's row weight plus its column weight; made once per counts and device."""
        key = (rows, columns, device, each_word)
        weights = self._weights.get(key)
        if weights is None:
            row, column = row_weights(rows, device), column_weights(columns, device)
            weights = row.view(rows, 1) + column if each_word else torch.cat([row, column])
            size = weights.numel() * weights.element_size()
            if self._weight_bytes + size > WEIGHT_BYTES:
                self._weights.clear()  # shapes that vary from step to step bound the cache
                self._weight_bytes = 0
            self._weights[key] = weights
            self._weight_bytes += size
        return weights

    def vector(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``values`` as an ``int64`` vector on ``device``, made once per values and device. Off the CPU it is made
        on the device, value by value: a host list copied there would wait for the device's queue.

        Args:
            values: The integers.
            device: Where the vector goes.

        Example::

            >>> plans = DigestPlans()
            >>> plans.vector((0, 3, 5), torch.device("cpu")).tolist()
            [0, 3, 5]
            >>> plans.vector((0, 3, 5), torch.device("cpu")) is plans.vector((0, 3, 5), torch.device("cpu"))
            True
        """
        key = (values, device)
        found = self._vectors.get(key)
        if found is None:
            if len(self._vectors) >= _VECTORS:
                self._vectors.clear()  # values that vary from call to call (sequence lengths) bound the cache
            if device.type == "cpu" or not values:
                found = torch.tensor(values, dtype=torch.int64, device=device)
            else:
                found = torch.cat([torch.full((1,), value, dtype=torch.int64, device=device) for value in values])
            self._vectors[key] = found
        return found


class _Plan:
    """How one shape, strides and dtype of tensor is read as its word matrix.

    A tensor laid out as its words (contiguous, its storage offset a whole number of words) is viewed: as words
    directly when its strides are the standard ones, else flattened first (a contiguous tensor may carry any stride
    on a dimension of size 1, which a dtype view refuses). Any other is copied into a contiguous tensor first. A
    tensor without elements reads as an empty matrix.
    """

    __slots__ = ("columns", "copy", "element", "empty", "flatten", "per_word", "rows", "widen", "windows", "word")

    def __init__(self, tensor: torch.Tensor) -> None:
        shape, size = tensor.shape, tensor.element_size()
        word = _word_size(shape[-1] if shape else 1, size)
        self.element, self.word = INTEGER_OF_SIZE[size], INTEGER_OF_SIZE[max(word, size)]
        self.per_word = word // size or 1
        self.widen = word < 4
        self.empty = tensor.numel() == 0
        self.copy = not tensor.is_contiguous()
        self.flatten = not self.copy and (tensor.dim() == 0 or tensor.stride() != _standard_strides(shape))
        self.columns = _row_elements(shape) // self.per_word
        self.rows = tensor.numel() // self.per_word // self.columns if self.columns else 0
        last = (shape[-1] if shape else 1) // self.per_word
        self.windows = _windows(self.columns, last)

    @staticmethod
    def of(tensor: torch.Tensor) -> "_Plan | None":
        """The plan for ``tensor``'s shape, strides and dtype, or ``None`` when it is not :func:`readable`."""
        if not _readable(tensor):
            return None
        if tensor.is_complex():
            return _ComplexPlan(tensor)
        return _Plan(tensor)

    def read(self, tensor: torch.Tensor, mode: DigestMode) -> torch.Tensor:
        if self.empty:
            return torch.zeros(0, 0, dtype=torch.int64, device=tensor.device)
        data = tensor
        if self.copy or data.storage_offset() % self.per_word:
            data = data.clone(memory_format=torch.contiguous_format)
        elif self.flatten:
            data = data.view(-1)
        if self.widen:  # one 1- or 2-byte element to a word: sign-extended
            data = data.view(self.element).to(torch.int32)
        elif data.dtype != self.word:  # one view, however many elements make a word
            data = data.view(self.word)
        window = mode.window(self.windows)
        if window is None:
            return data.view(self.rows, self.columns)
        start, width = window
        return data.as_strided((self.rows, width), (self.columns, 1), data.storage_offset() + start)


class _ComplexPlan(_Plan):
    """A complex tensor is read as its real pairs (``view_as_real``), planned as such."""

    __slots__ = ("real",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.real = _Plan(torch.view_as_real(tensor))

    def read(self, tensor: torch.Tensor, mode: DigestMode) -> torch.Tensor:
        return self.real.read(torch.view_as_real(tensor), mode)


_UNPLANNED = object.__new__(_Plan)

# The integer vectors `DigestPlans.vector` keeps: the ends of a step's or a region call's digested tensors, the region
# of each comparison, the slots a recomputation compares (a few hundred for a model of fixed shapes, as the light
# tier's rotation and windows turn; a few bytes each).
_VECTORS = 1024

# The plans `DigestPlans` keeps (a few hundred bytes each), one per shape, strides and dtype read.
_PLANS = 4096

WEIGHT_BYTES = 1 << 24
"""The most bytes of row and column weights a :class:`DigestPlans` keeps, over all its devices (16 MiB: the
weights of a million rows); past it the cache starts again."""

ONE_PASS_WORDS = 1 << 13
"""The most words of a matrix on the CPU that :meth:`DigestPlans.digest` weighs in one pass, each word times its row's
weight plus its column's, then summed: two kernels and nothing to weigh after, where row and column sums take two
kernels and two more to weigh them. The product is a temporary of the matrix's size (64 KiB at most) and the weights
a matrix of that size, kept. Past it the sums are cheaper on a CPU, which multiplies 64-bit integers one at a time."""

ONE_PASS_WORDS_OFF_CPU = 1 << 18
"""The same bound on other devices (2 MiB of words), where a product costs about what a sum does and each kernel
launch costs the host the same whatever its size: bounded by the memory of the temporary and of the kept weights."""


def _one_pass_words(device: torch.device) -> int:
    return ONE_PASS_WORDS if device.type == "cpu" else ONE_PASS_WORDS_OFF_CPU


# 0x9E3779B97F4A7C15 (2^64 over the golden ratio) and 0xC2B2AE3D27D4EB4F (a 64-bit prime of xxHash), as signed
# 64-bit integers.
_ROW_HASH = 0x9E3779B97F4A7C15 - 2**64
_COLUMN_HASH = 0xC2B2AE3D27D4EB4F - 2**64

INTEGER_OF_SIZE: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""By byte size: the integer dtype that reads an element's or a word's bits."""


def _word_size(last: int, size: int) -> int:
    """The bytes of a word for a last dimension of ``last`` elements of ``size`` bytes: 8, 4, or one element."""
    for word in (8, 4):
        if last * size % word == 0 and size <= word:
            return word
    return size


def _standard_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


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
