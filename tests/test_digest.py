"""The sentinel's digests (`lightning_ckpt_determinism.verify.digest`): the documented integer formula, exact on
every bit pattern, whatever the tensor's layout."""

import itertools

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from lightning_ckpt_determinism.verify import digest as digest_module
from lightning_ckpt_determinism.verify.digest import (
    EXACT,
    SAMPLE_STRIDE,
    WEIGHT_BYTES,
    DigestMode,
    DigestPlans,
    digest,
    digests,
    fingerprint,
    words,
)


def formula(tensor: torch.Tensor, mode: DigestMode = EXACT) -> int:
    """The digest as the module documents it, in Python integers, wrapped to 64 bits at the end."""
    matrix = words(tensor, mode)
    assert matrix is not None
    table = matrix.tolist()
    total = 0
    for row, values in enumerate(table):
        total += ((0x9E3779B97F4A7C15 * (row + 1)) % 2**64 | 1) * sum(values)
    for column, values in enumerate(zip(*table, strict=True)):
        total += ((0xC2B2AE3D27D4EB4F * (column + 1)) % 2**64 & ~1) * sum(values)
    total %= 2**64
    return total - 2**64 if total >= 2**63 else total


def bit_patterns(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bits of every kind (NaNs, infinities, -0.0, subnormals among them) in a tensor of ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    size = torch.empty(0, dtype=dtype).element_size()
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    info = torch.iinfo(signed)
    raw = torch.randint(info.min, info.max, shape, dtype=signed, generator=generator)
    return raw.view(dtype) if dtype != torch.bool else raw.view(torch.uint8).bool()


TENSORS = {
    "float32 activations": lambda: bit_patterns((4, 8, 40), torch.float32),
    "a (batch, seq, 1) statistic": lambda: bit_patterns((4, 8, 1), torch.float32),
    "bfloat16, four to a word": lambda: bit_patterns((6, 36), torch.bfloat16),
    "bfloat16, two to a word": lambda: bit_patterns((6, 34), torch.bfloat16),
    "float32 of odd width": lambda: bit_patterns((3, 4, 17), torch.float32),
    "a misaligned float32 view": lambda: bit_patterns((5, 41), torch.float32).view(-1)[1:201].view(5, 40),
    "float16 of odd width, one to a word": lambda: bit_patterns((5, 7), torch.float16),
    "a boolean mask": lambda: torch.rand(8, 24, generator=torch.Generator().manual_seed(1)) > 0.5,
    "int64 indices": lambda: bit_patterns((3, 20), torch.int64),
    "float64": lambda: bit_patterns((3, 18), torch.float64),
    "complex64": lambda: bit_patterns((4, 10), torch.complex64),
    "a 0-dimensional tensor": lambda: torch.tensor(-3.5),
    "an empty tensor": lambda: torch.zeros(0, 5),
    "a transposed view": lambda: bit_patterns((40, 24), torch.float32).t(),
    "a sliced view": lambda: bit_patterns((10, 48), torch.float32)[2:, 5:],
}


@pytest.mark.parametrize("name", list(TENSORS))
@pytest.mark.parametrize(
    "mode",
    [EXACT, DigestMode("sampled", 0), DigestMode("sampled", 3), DigestMode("sampled", SAMPLE_STRIDE + 5)],
    ids=["exact", "window 0", "window 3", "wrapped"],
)
@pytest.mark.parametrize("one_pass", [True, False], ids=["in one pass", "from row and column sums"])
def test_digests_are_the_documented_integer_formula_on_any_bits(
    name: str, mode: DigestMode, one_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not one_pass:
        monkeypatch.setattr(digest_module, "ONE_PASS_WORDS", -1)
    tensor = TENSORS[name]()
    found = digests([tensor, tensor.clone()], mode)
    assert found.dtype == torch.int64
    assert found.tolist() == [formula(tensor, mode)] * 2


@pytest.mark.parametrize("mode", [EXACT, DigestMode("sampled", 3)], ids=["exact", "window 3"])
def test_digests_weighted_together_are_each_tensors_formula(mode: DigestMode) -> None:
    plans = DigestPlans()
    tensors = [TENSORS[name]() for name in TENSORS]
    pair = TwoTensor(bit_patterns((3, 20), torch.float32), bit_patterns((3, 20), torch.float32) + 1)
    found: list = [plans.sums(plans.read(tensor, mode)) for tensor in tensors]  # type: ignore[arg-type]
    found.insert(2, plans.digest_of(pair, mode))  # a wrapper subclass's digest, given whole
    expected = [formula(tensor, mode) for tensor in tensors]
    expected.insert(2, plans.digest_of(pair, mode).item())  # type: ignore[union-attr]
    for _ in range(2):  # the second time from the joined weights made the first
        together = plans.combined(found)
        assert together.dtype == torch.int64 and together.tolist() == expected
    assert plans.combined(found[:1]).tolist() == expected[:1]


def layouts(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """``values`` laid out in memory every way a saved tensor can be: each holds the same values."""
    found = {"contiguous": values}
    for shift in (1, 2, 3):  # storage offsets that split 64-bit words
        padded = torch.zeros(values.numel() + shift, dtype=values.dtype)
        padded[shift:] = values.reshape(-1)
        found[f"storage offset {shift}"] = padded[shift:].view(values.shape)
    if values.dim() >= 2:
        found["transposed back"] = values.transpose(-1, -2).contiguous().transpose(-1, -2)
        wider = torch.zeros(*values.shape[:-1], values.shape[-1] + 2, dtype=values.dtype)
        wider[..., 1:-1] = values
        found["a slice of wider rows"] = wider[..., 1:-1]
    ones = [index for index, size in enumerate(values.shape) if size == 1]
    if ones:  # a contiguous tensor with an odd stride on a dimension of size one (attention pooling's bmm saves one)
        strides = list(values.stride())
        strides[ones[0]] = 1 if strides[ones[0]] != 1 else 3
        found["an odd stride on a size-1 dimension"] = values.as_strided(values.shape, strides)
    return found


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


SHAPES = [(4, 6, 1), (3, 1, 8), (1, 64), (5, 7), (2, 3, 40), (), (0, 8), (3, 0), (6, 17)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_of_a_tensor_reads_as_its_contiguous_copy(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    values = bit_patterns(shape, dtype) if shape else bit_patterns((1,), dtype).reshape(())
    plans = DigestPlans()
    for name, tensor in layouts(values).items():
        copy = tensor.clone(memory_format=torch.contiguous_format)
        assert torch.equal(bits(copy), bits(values)), name
        for mode in (EXACT, DigestMode("sampled", 0), DigestMode("sampled", 5)):
            assert torch.equal(digests([tensor], mode, plans), digests([copy], mode)), (name, mode)
            assert digests([tensor], mode).tolist() == [formula(copy, mode)], (name, mode)


def test_a_fit_saved_attention_pooling_tensor_is_read_without_error() -> None:
    weights = torch.softmax(torch.randn(3, 6, 1), dim=1)
    saved = weights.transpose(1, 2)  # (3, 1, 6) contiguous, stride 1 on its dimension of size one
    assert saved.is_contiguous() and saved.stride()[1] == 1
    assert torch.equal(digests([saved]), digests([saved.contiguous().clone()]))


@pytest.mark.parametrize("bit", [0, 1, 22, 23, 30, 31], ids=lambda bit: f"bit {bit}")
@pytest.mark.parametrize("column", [2, 3], ids=["low half of a word", "high half of a word"])
def test_flipping_any_single_bit_in_any_row_changes_the_digest(bit: int, column: int) -> None:
    tensor = bit_patterns((8, 32), torch.float32)
    before = digest(tensor)
    for row in range(8):
        changed = tensor.clone()
        changed.view(torch.int32)[row, column] ^= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32)
        assert not torch.equal(digest(changed), before), f"row {row}"  # type: ignore[arg-type]


def test_rows_moved_words_moved_within_a_row_a_tensor_negated_or_rescaled_change_the_digest() -> None:
    rows = torch.linspace(-1, 1, 128).reshape(4, 32)  # as many negative values as positive
    words_reordered = rows.view(torch.int64).flip(1).view(torch.float32)  # pairs of float32 moved within rows
    rolled = rows.roll(2, 1)  # the features rolled by one whole 64-bit word
    found = digests([rows, rows.flip(0), rows.roll(1, 0), -rows, rows * 0.5, words_reordered, rolled]).tolist()
    assert len(set(found)) == 7


@pytest.mark.parametrize("first, second", list(itertools.combinations(range(8), 2)))
def test_any_two_words_of_a_row_swapped_change_the_digest(first: int, second: int) -> None:
    tensor = bit_patterns((3, 16), torch.float32)  # 8 words a row
    swapped = tensor.clone()
    pairs = swapped.view(torch.int64)
    pairs[1, [first, second]] = pairs[1, [second, first]]
    assert not torch.equal(digest(tensor), digest(swapped))  # type: ignore[arg-type]


def test_every_column_is_read_within_sample_stride_steps_and_short_rows_are_read_whole() -> None:
    columns = torch.arange(80, dtype=torch.float32).repeat(3, 1)  # 40 words of two float32 a row
    seen = set()
    for offset in range(SAMPLE_STRIDE):
        window = words(columns, DigestMode("sampled", offset))
        assert window is not None and window.shape[0] == 3 and 0 < window.shape[1] <= 3
        seen.update(int(value) for value in window[0].contiguous().view(torch.float32).tolist())
    assert seen == set(range(80))
    short = torch.zeros(4, 2, 8)  # rows of 8 elements, two joined into rows of 16 (8 words): no window
    assert words(short, DigestMode("sampled", 5)).shape == (4, 8)  # type: ignore[union-attr]


def test_tensors_without_readable_bits_have_no_digest() -> None:
    assert words(torch.zeros(4, 4).to_sparse()) is None
    assert digest(torch.empty(4, 4, device="meta")) is None
    assert digest(torch.zeros(0, 3)).item() == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no bits to read"):
        digests([torch.zeros(2, 2).to_sparse()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_digests_are_those_of_the_cpu() -> None:
    tensors = [TENSORS[name]() for name in ("float32 activations", "bfloat16, four to a word", "a boolean mask")]
    for mode in (EXACT, DigestMode("sampled", 3)):
        on_cuda = digests([tensor.cuda() for tensor in tensors], mode)
        assert on_cuda.device.type == "cuda"
        assert on_cuda.cpu().tolist() == digests(tensors, mode).tolist()
        plans = DigestPlans()
        together = plans.combined([plans.sums(plans.read(tensor.cuda(), mode)) for tensor in tensors])  # type: ignore[arg-type]
        assert together.device.type == "cuda" and together.cpu().tolist() == digests(tensors, mode).tolist()


def test_a_digest_mode_names_its_tier_and_keeps_it_from_step_to_step() -> None:
    with pytest.raises(ValueError, match="`tier` can be light, sampled, exact, got 'every'"):
        DigestMode("every")  # type: ignore[arg-type]
    sampled = DigestMode("sampled", 7)
    assert sampled.next_step() == DigestMode("sampled", 8)
    # The light tier reads the same window of each row as the sampled one.
    assert DigestMode("light", 7).window([(0, 1), (1, 1), (2, 1)]) == sampled.window([(0, 1), (1, 1), (2, 1)]) == (1, 1)
    assert EXACT.next_step().window([(0, 1), (1, 1)]) is None


def test_a_fingerprint_is_the_metadata_and_exact_digest_of_any_layout() -> None:
    values = bit_patterns((6, 40), torch.float32)
    found = fingerprint(values)
    assert found.shape == (6, 40) and found.dtype == torch.float32
    assert torch.equal(found.digest, digest(values))  # type: ignore[arg-type]
    for name, tensor in layouts(values).items():
        assert fingerprint(tensor).same_as(found), name
    assert not fingerprint(values.view(torch.int32)).same_as(found)  # the same bits, another dtype
    assert not fingerprint(values.reshape(40, 6)).same_as(found)
    unreadable = fingerprint(torch.zeros(2, 2).to_sparse())
    assert unreadable.digest is None and not unreadable.same_as(unreadable)


def test_plans_cached_for_shapes_that_vary_stay_bounded_and_digest_alike_after_the_cache_starts_again() -> None:
    # Sequence lengths that vary from step to step: each length has its own row count, so its own weights.
    plans = DigestPlans()
    kept = torch.randn(8, 33, 64)
    before = plans.digest_of(kept, EXACT)
    unbounded = 0
    for length in range(1, 2100):
        found = plans.digest_of(torch.ones(length, 16), EXACT)
        unbounded += (length + 8) * 8  # `length` row weights and 8 column weights (float32 pairs), 8 bytes each
        assert plans.held_bytes <= WEIGHT_BYTES
        assert found is not None and found.item() == digest(torch.ones(length, 16)).item()
    assert unbounded > WEIGHT_BYTES  # the cache started again at least once
    assert torch.equal(plans.digest_of(kept, EXACT), before)
