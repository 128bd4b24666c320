"""What a sentinel tier's digests cost on their own, with nothing of the package around them: a floor for the tier.

The benchmark GPT's blocks are checkpointed by hand (``torch.utils.checkpoint``, non-reentrant, torch's own metadata
check), and a bare extractor digests, at the forward and after the recomputation, what the tier digests: the same
positions (every activation a block saves, learned from the first block call; under the light tier its rule,
:meth:`~lightning_ckpt_determinism.verify.sentinel.light_layout.SavedLayout.targets`, over that layout), the same
windows moving on with the steps (all of each tensor under ``"exact"``), and the same formula
(:class:`~lightning_ckpt_determinism.verify.digest.DigestPlans`: a small read weighed in one pass, a larger one by its
row and column sums, weighed with the call's others). A tensor whose values are written after it is saved is digested
when the block's forward returns, as the sentinel does. Each block call keeps its digests as the sentinel keeps a
region call's: its sums weighed when its forward returns and once its recomputation's last tensor is digested, so
that no sums outlive the call. The step compares every pair in one comparison and reads the result back, as the
step-level benchmark does with the sentinel.

It leaves out everything else the sentinel does: the region contexts, the parameter and buffer watch, the profiles and
code paths, failure handling, the report. So its ratio over the same hand-written step without digests is about the
least any implementation of the tier's coverage costs on the machine; the tier's own ratio over the package's step
without a sentinel is measured in the same rounds, beside it.

At widths of 256 and more, glibc's allocator gives memory back and faults it in again at a rate that depends on each
variant's history (thousands of minor page faults a step for one variant, none for another), enough to move a ratio
by 5 %. Pinning it, ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=68719476736`` in the environment, leaves
no page faults in a step.

``python -m benchmarks.digest_floor --dims 128 --rounds 61 --tier light`` prints one row per width; prefix it with
those two settings to pin the allocator.
"""

import argparse
import statistics
import sys
from functools import partial
from typing import Any, get_args

import torch
import torch.utils.checkpoint as torch_checkpoint

from benchmarks.common import (
    HandCheckpointedGPT,
    ModelSize,
    Regions,
    Variant,
    build_model,
    interleaved_times,
    lm_loss,
    make_batch,
    make_optimizer,
    paired_ratios,
    torch_threads,
    train_step,
)
from benchmarks.sentinel import THREADS, watched
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationSentinel
from lightning_ckpt_determinism.verify.digest import DigestMode, DigestPlans, DigestTier, Sums, readable
from lightning_ckpt_determinism.verify.sentinel.calls import Digests, as_vector, from_parameters, joined
from lightning_ckpt_determinism.verify.sentinel.light_layout import SavedLayout

CHECK = "lightning_ckpt_determinism_benchmark_digest_floor"
"""The ``determinism_check`` name the floor's extractor is registered under in torch's registry."""

_default_extractor = torch_checkpoint._default_meta_extractor


Found = Sums | torch.Tensor
"""A tensor's digest, or its row and column sums where its read is too large for one pass."""


class _Call:
    """One block call's digests, as the sentinel keeps a region call's: the forward's, joined when its forward
    returns, and its recomputation's, joined once the last of them is taken, so that no sums outlive the call."""

    __slots__ = ("forward", "kept", "recomputed", "remaining")

    def __init__(self) -> None:
        self.kept: list[_Kept] = []
        self.forward: Digests | None = None
        self.recomputed: list[Found | None] = []
        self.remaining = 0


class _Kept:
    """What torch keeps of a target at the forward: its call, its slot there and its digest, once taken (``None``
    while its values are written)."""

    __slots__ = ("call", "digest", "floor", "mode", "slot")

    def __init__(self, floor: "DigestFloor", mode: DigestMode, call: _Call) -> None:
        self.floor, self.mode, self.call = floor, mode, call
        self.slot = len(call.kept)
        call.kept.append(self)
        self.digest: Found | None = None

    def __ne__(self, other: object) -> bool:
        call = self.call
        if isinstance(other, _Recomputed) and call.forward is not None:
            call.recomputed[self.slot] = self.floor.digest(other.tensor, self.mode)
            call.remaining -= 1
            if call.remaining == 0:
                self.floor.recomputed(call)
        return False

    __hash__ = None  # type: ignore[assignment]


class _Recomputed:
    """A recomputed tensor as the extractor gives it to torch's comparison: a target's kept value digests it, any
    other kept value (torch's metadata) compares with its metadata."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __ne__(self, other: object) -> bool:
        return bool(_default_extractor(self.tensor) != other)

    __hash__ = None  # type: ignore[assignment]


class DigestFloor:
    """The bare extractor of one hand-checkpointed model: a position count per block call, the step's targets, the
    digests kept in pairs for the step's one comparison.

    Args:
        tier: The sentinel tier whose digests it takes: ``"light"`` its targets, ``"sampled"`` and ``"exact"`` every
            activation a block saves.

    Example::

        >>> floor = DigestFloor("sampled")
        >>> floor.next_step(); floor.end_step()
        0
    """

    def __init__(self, tier: DigestTier = "light") -> None:
        self.plans = DigestPlans()
        self.mode = DigestMode(tier)
        self.layout: SavedLayout | None = None
        self.filled_late: frozenset[int] = frozenset()
        self.pairs: list[tuple[Digests, Digests]] = []
        self.compared = 0
        # Digests replaced by a constant: what the floor costs besides them.
        self.constant = False
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._targets: dict[int, DigestMode] = {}
        self._position = 0
        self._in_forward = False
        self._held: list[tuple[_Kept, torch.Tensor]] = []
        self._call = _Call()
        self._learning: list[tuple[int, torch.Tensor, bool, torch.Tensor | None]] | None = None
        self._state: set[int] = set()

    def watch(self, model: torch.nn.Module) -> None:
        """Learn the layout from ``model``'s next block call, its parameters and buffers left out by their storage."""
        self._state = {tensor.untyped_storage().data_ptr() for tensor in [*model.parameters(), *model.buffers()]}
        self._learning = []

    def next_step(self) -> None:
        """Move the windows and the rotating target on, as the sentinel's ``next_step`` does."""
        self.mode = self.mode.next_step()

    def end_step(self) -> int:
        """Compare the step's digests in one comparison (one more where some calls weighed sums) and read back how
        many differed (with constant digests, none counts as compared)."""
        pairs, self.pairs = self.pairs, []
        singles: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        vectors: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for before, after in pairs:
            if isinstance(before, list) and isinstance(after, list):
                singles[0].extend(before)
                singles[1].extend(after)
            else:
                vectors[0].append(as_vector(before))
                vectors[1].append(as_vector(after))
        self.compared += 0 if self.constant else len(singles[0]) + sum(vector.numel() for vector in vectors[0])
        differing = [
            (join(forward) != join(recomputed)).sum()
            for join, (forward, recomputed) in ((torch.stack, singles), (torch.cat, vectors))
            if forward
        ]
        return int(sum(differing)) if differing else 0

    def recomputed(self, call: _Call) -> None:
        """``call``'s recomputation is digested: its digests joined, paired with the forward's for the step."""
        found = call.recomputed
        if call.forward is not None and all(entry is not None for entry in found):
            self.pairs.append((call.forward, joined(self.plans, found)))  # type: ignore[arg-type]
        call.forward, call.recomputed = None, []

    def digest(self, tensor: torch.Tensor, mode: DigestMode) -> Found | None:
        """``tensor``'s digest as the sentinel takes it, or its row and column sums where its read is too large for
        one pass (or the constant, while :attr:`constant`)."""
        if self.constant:
            zero = self._zeros.get(tensor.device)
            if zero is None:
                zero = self._zeros[tensor.device] = torch.zeros((), dtype=torch.int64, device=tensor.device)
            return zero
        matrix = self.plans.read(tensor, mode)
        return None if matrix is None else self.plans.digest_or_sums(matrix)

    def targets(self) -> dict[int, DigestMode]:
        """The positions a block call digests at this step, each with the mode its digest reads."""
        if self.layout is None:
            return {}
        if self.mode.tier == "light":
            return self.layout.targets(self.mode)
        return dict.fromkeys(self.layout.compared, self.mode)

    def run_block(self, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One block's forward or recomputation, its saved tensors counted from zero."""
        self._position, self._in_forward = 0, True
        self._targets = self.targets()
        call = self._call = _Call()
        try:
            out = block(x)
        finally:
            self._in_forward = False
        if self._learning is not None:
            self._learn(self._learning)
        for kept, tensor in self._held:
            kept.digest = self.digest(tensor, kept.mode)
        self._held = []
        found = [kept.digest for kept in call.kept]
        if found and all(entry is not None for entry in found):
            call.forward = joined(self.plans, found)  # type: ignore[arg-type]
            call.recomputed, call.remaining = [None] * len(found), len(found)
        return out

    def extract(self, tensor: torch.Tensor) -> Any:
        """torch's extractor: a target's digest at the forward; torch's metadata for the others."""
        if not self._in_forward:
            return _Recomputed(tensor)
        position = self._position
        self._position = position + 1
        if self._learning is not None:
            self._note(position, tensor)
        mode = self._targets.get(position)
        if mode is None:
            return _default_extractor(tensor)
        kept = _Kept(self, mode, self._call)
        if position in self.filled_late:
            self._held.append((kept, tensor))
        else:
            kept.digest = self.digest(tensor, mode)
        return kept

    def _note(self, position: int, tensor: torch.Tensor) -> None:
        assert self._learning is not None
        if tensor.untyped_storage().data_ptr() in self._state or not readable(tensor):
            return
        self._learning.append((position, tensor, from_parameters(tensor), self.plans.digest_of(tensor, self.mode)))

    def _learn(self, seen: list[tuple[int, torch.Tensor, bool, torch.Tensor | None]]) -> None:
        """The layout of the call just run, as the light tier learns it: every activation compared, those computed
        from parameters alone (a weight's cast under autocast) as weights, of the others those that require grad
        counted as computed from the region's values, and those whose digest changed since they were saved as filled
        late."""
        self._learning = None
        self.filled_late = frozenset(
            position
            for position, tensor, _, at_save in seen
            if at_save is None or not torch.equal(at_save, self.plans.digest_of(tensor, self.mode))
        )
        floating = [
            (position, tensor.requires_grad)
            for position, tensor, weight, _ in seen
            if tensor.dtype.is_floating_point and not weight
        ]
        self.layout = SavedLayout(
            saved=self._position,
            compared=tuple(position for position, _, _, _ in seen),
            floating=tuple(position for position, _ in floating),
            derived=tuple(position for position, computed in floating if computed),
            weights=tuple(position for position, _, weight, _ in seen if weight),
        )


class FloorGPT(HandCheckpointedGPT):
    """The benchmark GPT checkpointed by hand, each block's saved tensors handed to a :class:`DigestFloor`."""

    floor: DigestFloor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            run = partial(self.floor.run_block, block)
            x = torch_checkpoint.checkpoint(run, x, use_reentrant=False, determinism_check=CHECK)
        return self.head(self.ln_f(x))


def floor_model(size: ModelSize, device: torch.device, tier: DigestTier = "light") -> FloorGPT:
    """The benchmark GPT of ``size``, with the weights of every other variant, and its :class:`DigestFloor` of
    ``tier``, which has learned its layout from one forward and backward (its gradients dropped). The floor's extractor
    is registered in torch's registry under :data:`CHECK`, in place of any earlier model's: one floor model runs at a
    time."""
    torch.manual_seed(0)
    model = FloorGPT(size.vocab_size, size.seq_len, size.dim, size.heads, size.layers, size.dropout).to(device)
    model.floor = DigestFloor(tier)
    torch_checkpoint._allowed_determinism_checks_to_fns[CHECK] = model.floor.extract
    model.floor.watch(model)
    lm_loss(model, *make_batch(size, device)).backward()
    model.floor.end_step()
    model.zero_grad(set_to_none=True)
    return model


def floor_step(model: FloorGPT, step: Any) -> int:
    """One training step with the floor's digests: the windows moved on, the step, its one comparison read back."""
    model.floor.next_step()
    step()
    return model.floor.end_step()


RATIOS = (
    ("floor", "hand"),
    ("floor, digests constant", "hand"),
    ("sentinel", "step"),
    ("step", "hand"),
    ("hand again", "hand"),
)
"""The ratios :func:`measure` gives: each variant over the step it adds to."""


def _with_constant_digests(model: FloorGPT, step: Any) -> int:
    model.floor.constant = True
    try:
        return floor_step(model, step)
    finally:
        model.floor.constant = False


def measure(
    size: ModelSize, device: torch.device, rounds: int, warmup: int = 3, tier: DigestTier = "light"
) -> dict[str, float]:
    """The floor's and the sentinel's step-level ratios at ``tier``, interleaved in one process.

    Args:
        size: The benchmark GPT's shape.
        device: Where to train.
        rounds: Interleaved rounds of each variant.
        warmup: Untimed rounds first, after one step of the sentinel, which learns its layouts (the floor learns
            its own when it is made).
        tier: The sentinel's tier, and the floor's.

    Returns:
        ``"step ms"`` (the hand-written step), the medians of ``"floor/hand"``, ``"floor, digests constant/hand"``
        (what the floor costs besides its digests), ``"sentinel/step"`` (over the package's step without a
        sentinel), ``"step/hand"`` and ``"hand again/hand"`` (the run's noise), the saved tensors each compares a step
        after their first (``"floor compared"``, ``"sentinel compared"``: each digested at the forward and after the
        recomputation) and the floor's mismatches.

    Example::

        >>> size = ModelSize(layers=2, dim=32, heads=2, seq_len=16, batch_size=2, vocab_size=32)
        >>> found = measure(size, torch.device("cpu"), rounds=1, warmup=2)
        >>> found["floor mismatches"], found["floor compared"] == found["sentinel compared"]
        (0, True)
    """

    def made(model: torch.nn.Module) -> Any:
        inputs, targets = make_batch(size, device)
        return partial(train_step, model, make_optimizer(model), inputs, targets)

    hand = made(build_model(size, Variant("hand", hand=True), device))
    floor = floor_model(size, device, tier)
    floored = made(floor)
    mismatches = []
    package = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    step = made(package)
    sentinel = RecomputationSentinel(package, mode=tier)
    regions = Regions(package)
    functions = {
        "hand": hand,
        "floor": lambda: mismatches.append(floor_step(floor, floored)),
        "floor, digests constant": partial(_with_constant_digests, floor, floored),
        "step": step,
        "sentinel": partial(watched, regions, sentinel, step, device),
        "hand again": hand,
    }
    with torch_threads(THREADS):
        functions["sentinel"]()  # its first step, which learns the layouts: left out of the counts
        floor_before, sentinel_before = floor.floor.compared, sentinel.report().compared
        times = interleaved_times(functions, rounds, warmup, device)
    steps = rounds + warmup
    return {
        "step ms": statistics.median(times["hand"]) * 1e3,
        **{f"{a}/{b}": statistics.median(paired_ratios(times[a], times[b])) for a, b in RATIOS},
        "floor compared": (floor.floor.compared - floor_before) / steps,
        "sentinel compared": (sentinel.report().compared - sentinel_before) / steps,
        "floor mismatches": sum(mismatches),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the floor's and a sentinel tier's step-level ratios for models of several widths.

    Example::

        python -m benchmarks.digest_floor --dims 128 --rounds 61 --tier sampled
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.digest_floor", description=main.__doc__)
    parser.add_argument("--dims", default="128", help="model widths, comma-separated (sequence = width / 2)")
    parser.add_argument("--rounds", type=int, default=61, help="interleaved rounds of each variant")
    parser.add_argument("--tier", choices=get_args(DigestTier), default="light", help="the sentinel's tier")
    parser.add_argument("--device", default="cpu", help="where to train (cuda on a GPU)")
    args = parser.parse_args(argv)
    print(
        f"| width | hand step ms | floor / hand | floor, digests constant / hand | `{args.tier}` / step | step / hand"
        " | hand again / hand | compared a step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dim in (int(text) for text in args.dims.split(",")):
        size = ModelSize(layers=4, dim=dim, heads=4, seq_len=dim // 2, batch_size=8, vocab_size=256)
        found = measure(size, torch.device(args.device), args.rounds, tier=args.tier)
        print(
            f"| {dim} | {found['step ms']:.1f} | **{found['floor/hand']:.3f}** |"
            f" {found['floor, digests constant/hand']:.3f} | {found['sentinel/step']:.3f} |"
            f" {found['step/hand']:.3f} | {found['hand again/hand']:.3f} |"
            f" {found['floor compared']:.1f} (sentinel {found['sentinel compared']:.1f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
