"""The checks' comparison of gradients in every layout: sparse ones give the figures of their dense forms (the ground
truth: the same comparison on ``to_dense()``), a layout the checks cannot compare is a finding on every rank, never an
exception, and no cross-rank reduction sees anything but a small strided tensor."""

import math
import threading
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, check_recomputation
from lightning_ckpt_determinism.lightning.parallel import all_reduce
from lightning_ckpt_determinism.verify.compare import exactly_equal, gradient_divergence
from lightning_ckpt_determinism.verify.gradients import GradientStash
from lightning_ckpt_determinism.verify.live_step import GradientComparison, compare_gradients

NAN, INF = math.nan, math.inf


def rows(indices: list[int], values: list[list[float]], size: int = 6) -> torch.Tensor:
    """A hybrid COO tensor of ``size`` rows of two, as ``nn.Embedding(sparse=True)`` gives: uncoalesced, a row
    specified as often as ``indices`` names it."""
    index = torch.tensor([indices], dtype=torch.long)
    return torch.sparse_coo_tensor(index, torch.tensor(values).view(-1, 2), (size, 2), check_invariants=True)


def embedding_gradient(ids: list[int], scale: float = 1.0) -> torch.Tensor:
    table = nn.Embedding(6, 2, sparse=True)
    (table(torch.tensor(ids)) * torch.arange(1.0, 2 * len(ids) + 1).view(-1, 2) * scale).sum().backward()
    assert table.weight.grad is not None
    return table.weight.grad


def blocks(layout: torch.layout, dense: torch.Tensor) -> torch.Tensor:
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        return dense.to_sparse(layout=layout, blocksize=(2, 2))
    return dense.to_sparse(layout=layout)


DENSE = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [4.0, 0.0, 0.5, 0.0]])
OTHER = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.5], [0.0, 1.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0]])

PAIRS: dict[str, Callable[[], tuple[torch.Tensor | None, torch.Tensor | None]]] = {
    "embedding gradients, equal": lambda: (embedding_gradient([1, 3, 1]), embedding_gradient([1, 3, 1])),
    "embedding gradients, other rows": lambda: (embedding_gradient([1, 3, 1]), embedding_gradient([1, 4, 1])),
    "embedding gradients, other values": lambda: (embedding_gradient([1, 3, 1]), embedding_gradient([1, 3, 1], 1.5)),
    "a row specified twice against once": lambda: (
        rows([2, 2], [[1.0, 2.0], [3.0, 4.0]]),
        rows([2], [[4.0, 6.0]]),
    ),
    "an explicit zero on one side only": lambda: (rows([1, 4], [[1.0, 2.0], [0.0, 0.0]]), rows([1], [[1.0, 2.0]])),
    "NaN and the same infinity on both sides": lambda: (
        rows([0, 3], [[NAN, 1.0], [INF, 2.0]]),
        rows([3, 0], [[INF, 2.5], [NAN, 1.0]]),
    ),
    "an infinity on one side only": lambda: (rows([0], [[INF, 1.0]]), rows([0, 5], [[1.0, 1.0], [1.0, 1.0]])),
    "a NaN in the reference only": lambda: (rows([0, 2], [[NAN, 1.0], [3.0, 4.0]]), rows([2], [[3.0, 4.0]])),
    "an empty gradient against one": lambda: (rows([], []), rows([4], [[1.0, -1.0]])),
    "no reference gradient": lambda: (None, embedding_gradient([0, 5])),
    "no other gradient": lambda: (embedding_gradient([0, 5]), None),
    "sparse against strided": lambda: (embedding_gradient([2, 3]), embedding_gradient([2, 3], 2.0).to_dense()),
    "hybrid against fully sparse": lambda: (rows([1], [[1.0, 2.0]]), rows([1], [[1.0, 3.0]]).to_dense().to_sparse()),
    **{
        f"{layout} blocks": partial(lambda layout: (blocks(layout, DENSE), blocks(layout, OTHER)), layout)
        for layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
    },
}


def densified(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The dense form, repeated elements summed in float64."""
    return None if tensor is None else tensor.double().to_dense()


def same_figure(actual: float, expected: float) -> bool:
    # Sums over the specified elements add the same terms as sums over the dense form, in another order.
    return actual == pytest.approx(expected, rel=1e-12, abs=0.0) or (math.isnan(actual) and math.isnan(expected))


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_sparse_pair_gives_the_figures_of_its_dense_forms(name):
    ref, other = PAIRS[name]()
    sparse = [grad for grad in (ref, other) if grad is not None and grad.layout is not torch.strided]
    assert sparse, "the case holds no sparse gradient"
    coalesced_before = [grad.is_coalesced() for grad in sparse if grad.layout is torch.sparse_coo]
    expected = gradient_divergence([densified(ref)], [densified(other)])
    actual = gradient_divergence([ref], [other])
    assert same_figure(actual[0], expected[0]), (actual, expected)
    assert actual[1] == expected[1]
    # The live-step engine, from its fast path of exact equality to its figures, agrees (where the reference gave a
    # gradient: a missing one is a finding of its own).
    live = compare_gradients(["w"], [other], [ref])
    if ref is not None:
        assert same_figure(live.grad_divergence, expected[0])
        assert (live.error, live.per_parameter) == (None, {"w": expected[1][0]})
    else:
        assert live.error is not None and "gave no gradient for ['w']" in live.error
    # The comparison coalesces copies: the gradients are left as autograd made them.
    assert [grad.is_coalesced() for grad in sparse if grad.layout is torch.sparse_coo] == coalesced_before


@pytest.mark.parametrize("name", [name for name in PAIRS if "no " not in name])
def test_exact_equality_of_a_sparse_pair_is_that_of_its_dense_forms_or_left_to_the_figures(name):
    ref, other = PAIRS[name]()
    assert ref is not None and other is not None
    dense_equal = torch.equal(ref.to_dense(), other.to_dense())
    # Never equal where the dense forms differ (NaN differs from itself, as in `torch.equal`); where they agree, only
    # an explicit zero or a strided side leaves the verdict to the figures (0.0).
    assert exactly_equal(ref, other) <= dense_equal
    assert exactly_equal(ref, ref.clone()) == torch.equal(ref.to_dense(), ref.to_dense())
    if exactly_equal(ref, other) != dense_equal:
        assert gradient_divergence([ref], [other]) == (0.0, [0.0])


@pytest.mark.parametrize(("values", "skipped"), [([[1.0, 2.0], [3.0, 4.0]], False), ([[1.0, INF], [3.0, 4.0]], True)])
def test_a_non_finite_sparse_live_gradient_is_skipped_as_a_dense_one_is(values, skipped):
    live = rows([1, 1], values)
    reference = rows([1], [[4.0, 6.0]])
    result = compare_gradients(["t"], [live], [reference], skip_non_finite=True)
    dense = compare_gradients(["t"], [live.to_dense()], [reference.to_dense()], skip_non_finite=True)
    assert result.skipped is dense.skipped is skipped
    # Its rows sum to the reference's: nothing differs where it is compared.
    assert result.grad_divergence == dense.grad_divergence == 0.0


def test_setting_sparse_gradients_aside_puts_the_same_tensors_back():
    table = nn.Embedding(6, 2, sparse=True)
    table(torch.tensor([1, 3, 1])).sum().backward()
    grad = table.weight.grad
    assert grad is not None and grad.layout is torch.sparse_coo and not grad.is_coalesced()
    stash = GradientStash([table.weight])
    assert table.weight.grad is None
    stash.put_back()
    assert table.weight.grad is grad
    copies = GradientStash([table.weight], clone=True)
    copies.put_back()
    copy = table.weight.grad
    assert copy is not grad and copy.layout is torch.sparse_coo and copy.is_coalesced() == grad.is_coalesced()
    assert torch.equal(copy.to_dense(), grad.to_dense())


def mkldnn_gradient() -> torch.Tensor:
    weight = nn.Parameter(torch.ones(2, 2).to_mkldnn())
    (weight.to_dense() * 3).sum().backward()
    assert weight.grad is not None and weight.grad.layout is torch._mkldnn
    return weight.grad


def nested_gradient() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize(
    ("make", "shown"), [(mkldnn_gradient, "b (torch._mkldnn)"), (nested_gradient, "b (nested torch.strided)")]
)
def test_a_layout_the_check_cannot_compare_is_a_finding_naming_it(make, shown):
    odd = make()
    result = compare_gradients(["a", "b"], [torch.ones(2), odd], [torch.ones(2), odd])
    assert result.error is not None and f"['{shown}'] hold gradients in a layout it cannot compare" in result.error
    assert (result.grad_divergence, result.max_abs_diff) == (math.inf, math.inf)
    assert gradient_divergence([torch.ones(2), odd], [torch.ones(2), odd]) == (math.inf, [0.0, math.inf])


class MkldnnScale(nn.Module):
    """A linear layer scaled by a weight held as an MKL-DNN tensor: its gradient is MKL-DNN too."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4, 4).to_mkldnn())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) @ self.scale.to_dense())


@pytest.mark.parametrize("gradients", ["autograd", "backward"])
def test_check_recomputation_reports_an_mkldnn_gradient_instead_of_raising(gradients):
    torch.manual_seed(0)
    model = nn.Sequential(MkldnnScale(), nn.Linear(4, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    report = check_recomputation(model, lambda: model(torch.ones(3, 4)).sum(), gradients=gradients)
    assert report.diverged and report.grad_divergence == math.inf
    assert report.error is not None and "['0.scale (torch._mkldnn)'] hold gradients in a layout" in report.error


class ThreadRanks:
    """Ranks simulated by threads: each rank's strategy reduces through one barrier, and every tensor reduced is
    recorded with its layout."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._slots: list[torch.Tensor] = [torch.empty(0)] * world_size
        self.layouts: list[tuple[torch.layout, torch.dtype, int]] = []

    def strategy(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(reduce=partial(self._reduce, rank))

    def _reduce(self, rank: int, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.layouts.append((tensor.layout, tensor.dtype, tensor.dim()))
        self._slots[rank] = tensor
        self._barrier.wait()
        stacked = torch.stack(self._slots)
        reduced = stacked.sum(0) if reduce_op == "sum" else stacked.amax(0)
        self._barrier.wait()
        return reduced


Compare = Callable[[int, Callable], GradientComparison]


def on_two_ranks(compare: Compare) -> tuple[list[GradientComparison], ThreadRanks]:
    ranks = ThreadRanks(2)
    results: list[GradientComparison | BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            results[rank] = compare(rank, all_reduce(ranks.strategy(rank)))
        except BaseException as error:  # a rank that failed or waited in vain fails the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(isinstance(result, GradientComparison) for result in results), results
    return results, ranks  # type: ignore[return-value]


def test_a_sparse_difference_on_one_rank_gives_every_rank_the_figures_of_both_ranks_together():
    live = [embedding_gradient([1, 3], 1.25), torch.tensor([3.0, 4.0])]
    reference = [embedding_gradient([1, 3]), torch.tensor([3.0, 4.0])]
    # Rank 1 holds the same dense gradient and no sparse one.
    per_rank = {0: (live, reference), 1: ([None, torch.tensor([3.0, 4.0])], [None, torch.tensor([3.0, 4.0])])}
    results, ranks = on_two_ranks(lambda rank, sums: compare_gradients(["t", "w"], *per_rank[rank], all_reduce=sums))
    together = gradient_divergence(
        [reference[0].to_dense(), reference[1], reference[1]], [live[0].to_dense(), live[1], live[1]]
    )
    for result in results:
        assert same_figure(result.grad_divergence, together[0]) and result.grad_divergence > 0
        assert result.per_parameter == {"t": together[1][0], "w": 0.0}
    assert set(ranks.layouts) <= {(torch.strided, torch.float64, 1)}
    assert len(ranks.layouts) == 2 * 3  # the flags, the sums, the maxima


def test_a_layout_one_rank_cannot_compare_is_a_finding_on_every_rank():
    odd = nested_gradient()
    per_rank = {0: ([torch.ones(2), None], [torch.ones(2), None]), 1: ([torch.ones(2), odd], [torch.ones(2), odd])}
    results, ranks = on_two_ranks(lambda rank, sums: compare_gradients(["a", "b"], *per_rank[rank], all_reduce=sums))
    errors = [result.error or "" for result in results]
    assert "parameters of another rank hold gradients in a layout" in errors[0]
    assert "['b (nested torch.strided)'] hold gradients in a layout" in errors[1]
    assert all(result.grad_divergence == math.inf for result in results)
    assert len(ranks.layouts) == 2  # one collective: no rank waits in a reduction the other skipped
