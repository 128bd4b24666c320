"""Wrapper tensor subclasses (torch's ``TwoTensor``, a quantized weight) and conjugated or negative views in
checkpointed regions: the process never crashes, training equals torch's checkpoint and no checkpointing, the
sentinel reads each subclass through its inner tensors and each view as the values it shows, and a defect in them is
seen."""

import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any, get_args

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify.digest import EXACT, DigestPlans, DigestTier, digest, fingerprint, row_weights
from tests.helpers import DIM, REPO, DropoutBlock, StackModule, trainer_kwargs
from tests.test_verdicts import STEPS, WIDTH, Case, Head, tokens, trial

TIERS = get_args(DigestTier)


def values(tensor: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The plain tensors holding a tensor's values, read with torch's own subclass protocol."""
    if tensor is None or type(tensor) in (torch.Tensor, nn.Parameter):
        return [tensor]
    return [inner for name in tensor.__tensor_flatten__()[0] for inner in values(getattr(tensor, name))]


def same_values(first: list[torch.Tensor | None], second: list[torch.Tensor | None]) -> bool:
    """Every inner tensor of every tensor bit-identical (``torch.equal`` on a ``TwoTensor`` reads its first only)."""
    ones = [part for tensor in first for part in values(tensor)]
    others = [part for tensor in second for part in values(tensor)]
    return len(ones) == len(others) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(ones, others, strict=True)
    )


def same_state(first: nn.Module, second: nn.Module) -> bool:
    one, other = first.state_dict(), second.state_dict()
    return list(one) == list(other) and same_values(list(one.values()), list(other.values()))


def two_tensor_weights(model: nn.Module) -> nn.Module:
    """Every linear layer's weight made a ``TwoTensor`` parameter whose second inner tensor is half the first, as a
    quantized-weight library replaces weights: the two inner tensors hold different values all the way through."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
            module.weight = nn.Parameter(TwoTensor(weight.clone(), weight * 0.5))
    return model


class Pair(torch.autograd.Function):
    """Makes a ``TwoTensor`` of ``x`` and ``x * scale`` (its gradient flows back through both)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return TwoTensor(x.detach(), x.detach() * scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.a + ctx.scale * grad.b, None


class Unpair(torch.autograd.Function):
    """The sum of a ``TwoTensor``'s inner tensors, as a plain tensor."""

    @staticmethod
    def forward(ctx: Any, pair: torch.Tensor) -> torch.Tensor:
        return pair.a + pair.b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return TwoTensor(grad, grad)


class TwoInput(nn.Module):
    """Feeds the region (``body``) a ``TwoTensor`` input: every activation after it is one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(TwoTensor(x, x * 0.5)))


class TwoActivation(nn.Module):
    """Makes a ``TwoTensor`` activation inside the region from plain tensors, and a plain one again. With ``defect``,
    its second inner tensor is scaled by a call count kept in a list (which recomputation does not replay): only
    that inner tensor of the saved activations differs."""

    def __init__(self, defect: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.defect = defect
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0
        if self.defect:
            self.calls.append(1)
            scale += 0.1 * len(self.calls)
        return self.out(Unpair.apply(torch.tanh(Pair.apply(self.inp(x), scale))))


class CountedScale(nn.Module):
    """Linear, tanh and linear, scaled by a call count kept in a list (not replayed): a defect on whatever tensors
    flow through it. With ``second_only`` the scale is a ``TwoTensor`` that scales the second inner tensor alone: with
    ``TwoTensor`` weights, recomputation then changes the second inner tensor of the weights' gradients and nothing
    else."""

    def __init__(self, second_only: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.calls: list[int] = []
        self.second_only = second_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        scale: Any = 1 + 0.1 * len(self.calls)
        if self.second_only:
            scale = TwoTensor(torch.ones(WIDTH), torch.full((WIDTH,), scale))
        return self.out(torch.tanh(self.inp(x) * scale))


class TwoTensorGain(nn.Module):
    """Updates a running gain held in a ``TwoTensor`` buffer from its activations, then reads both inner tensors: the
    region's first call snapshots its buffers (through their inner tensors) to learn which ones to replay."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("gain", TwoTensor(torch.ones(WIDTH), torch.full((WIDTH,), 2.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            self.gain.mul_(0.9).add_(0.1 * h.abs().mean(dim=(0, 1)))
        return torch.tanh(h * Unpair.apply(self.gain))


def plain_body() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "input": TwoInput,
    "weight": lambda: two_tensor_weights(Head(plain_body())),
    "activation": lambda: Head(TwoActivation()),
}


def gradients(model: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of one step on ``tokens(0)``, from none."""
    for param in model.parameters():
        param.grad = None
    out = run(model, tokens(0))
    F.mse_loss(out, torch.zeros_like(out)).backward()
    return [param.grad for param in model.parameters()]


def by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model with its region checkpointed by torch's own non-reentrant checkpoint."""
    region = checkpoint(model.body, TwoTensor(x, x * 0.5) if isinstance(model, TwoInput) else x, use_reentrant=False)
    return model.head(region)


@pytest.mark.parametrize("tier", ["off", *TIERS])
@pytest.mark.parametrize("where", list(BUILDS))
def test_a_subclass_input_weight_or_activation_trains_as_torch_checkpoint_and_is_compared(
    where: str, tier: str
) -> None:
    torch.manual_seed(0)
    plain = BUILDS[where]()
    torch.manual_seed(0)
    hand = BUILDS[where]()
    torch.manual_seed(0)
    ours = BUILDS[where]()
    apply_activation_checkpointing(ours, CheckpointingConfig(names=["body"]))
    expected = gradients(plain, lambda model, x: model(x))
    assert same_values(expected, gradients(hand, by_hand))
    if tier == "off":
        assert same_values(expected, gradients(ours, lambda model, x: model(x)))
        return
    with recomputation_sentinel(ours, mode=tier) as sentinel:  # type: ignore[arg-type]
        assert same_values(expected, gradients(ours, lambda model, x: model(x)))
    report = sentinel.report()
    # The region's saved activations are subclasses (or, with a subclass weight, made from one): all compared.
    assert report.compared > 0 and report.mismatches == 0 and report.not_compared == 0, report


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("where", list(BUILDS))
def test_a_clean_subclass_model_is_exact_under_the_sentinel_and_the_check_at_every_step(where: str, tier: str) -> None:
    result = trial(Case(BUILDS[where]), tier)
    assert same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0 and result.sentinel.not_compared == 0, result.sentinel.regions
    assert result.sentinel.compared > 0
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
        assert [region.cause for region in report.regions] == [None]


@pytest.mark.parametrize("tier", TIERS)
def test_a_subclass_buffer_the_forward_updates_is_replayed_and_trains_as_the_twin(tier: str) -> None:
    result = trial(Case(lambda: Head(TwoTensorGain())), tier)
    assert same_state(result.plain, result.checkpointed)
    assert not same_values([result.plain.body.gain], [TwoTensor(torch.ones(WIDTH), torch.full((WIDTH,), 2.0))])
    assert result.sentinel.compared > 0 and result.sentinel.mismatches == 0 and result.sentinel.not_compared == 0
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
        assert report.buffer_mutations == []


DEFECTS: dict[str, Callable[[], nn.Module]] = {
    # Only the second inner tensor of the saved activations differs: seen only if that inner tensor is read.
    "the second inner tensor of an activation": lambda: Head(TwoActivation(defect=True)),
    "activations made from a subclass weight": lambda: two_tensor_weights(Head(CountedScale())),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", list(DEFECTS))
def test_a_defect_in_subclass_values_is_seen_by_the_sentinel_and_named_by_the_check(name: str, tier: str) -> None:
    result = trial(Case(DEFECTS[name]), tier)
    found = result.sentinel.regions["body"]
    assert found.mismatches > 0 and found.not_compared == 0, found
    assert found.first_mismatch is not None and found.first_mismatch.startswith("the "), found
    for report in result.checks:
        assert report.diverged and report.grad_divergence > 0.0
        assert [(region.name, region.cause) for region in report.regions] == [("body", "python_state")]


def test_a_subclass_in_the_first_checkpointed_forward_never_kills_the_process() -> None:
    # A regression of the probe or the sentinel cloning a subclass with Python dispatch off is a segmentation fault:
    # run in a child process, so that it fails this test instead of ending the test session.
    script = (
        "import torch\n"
        "from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing,"
        " recomputation_sentinel\n"
        "from tests.test_subclasses import BUILDS, Head, TwoTensorGain, gradients\n"
        "for where, build in {**BUILDS, 'buffer': lambda: Head(TwoTensorGain())}.items():\n"
        f"    for tier in {('off', *TIERS)!r}:\n"
        "        model = build()\n"
        "        apply_activation_checkpointing(model, CheckpointingConfig(names=['body']))\n"
        "        if tier == 'off':\n"
        "            gradients(model, lambda model, x: model(x))\n"
        "        else:\n"
        "            with recomputation_sentinel(model, mode=tier):\n"
        "                gradients(model, lambda model, x: model(x))\n"
        "        print(where, tier, 'trained')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:-1] == [
        f"{where} {tier} trained" for where in [*BUILDS, "buffer"] for tier in ("off", *TIERS)
    ]


class Opaque(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__``: its values are out of the package's reach."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "Opaque":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device, requires_grad=inner.requires_grad
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = torch.utils._pytree.tree_map_only(Opaque, lambda t: t.inner, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return torch.utils._pytree.tree_map_only(torch.Tensor, cls, out)


class Unflattenable(Opaque):
    """A wrapper subclass whose ``__tensor_flatten__`` refuses its layout."""

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        raise NotImplementedError("no flatten for this layout")


def unwrapped(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [tensor.inner if isinstance(tensor, Opaque) else tensor for tensor in tensors]


class OpaqueInput(nn.Module):
    def __init__(self, kind: type[Opaque] = Opaque) -> None:
        super().__init__()
        self.kind = kind
        self.body = plain_body()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.kind(x)))


@pytest.mark.parametrize("kind", [Opaque, Unflattenable])
@pytest.mark.parametrize("tier", TIERS)
def test_a_subclass_without_inner_tensors_is_left_out_counted_and_noted_once(
    tier: str, kind: type[Opaque], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    hand = OpaqueInput(kind)
    torch.manual_seed(0)
    ours = OpaqueInput(kind)
    apply_activation_checkpointing(ours, CheckpointingConfig(names=["body"]))
    expected = [gradients(hand, lambda model, x: model.head(checkpoint(model.body, kind(x), use_reentrant=False)))]
    with caplog.at_level(logging.WARNING), recomputation_sentinel(ours, mode=tier) as sentinel:  # type: ignore[arg-type]
        found = [gradients(ours, lambda model, x: model(x)) for _ in range(2)]
    assert all(same_values(unwrapped(expected[0]), unwrapped(grads)) for grads in found)
    region = sentinel.report().regions["body"]
    assert region.compared == 0 and region.mismatches == 0 and region.not_compared > 0
    name = kind.__name__
    notes = [record.getMessage() for record in caplog.records if f"`{name}`" in record.getMessage()]
    assert len(notes) == 1 and f"region `body` saves a `{name}`" in notes[0] and "not compared" in notes[0]


def test_a_subclass_whose_flatten_raises_trains_checkpointed_as_under_torchs_checkpoint() -> None:
    torch.manual_seed(0)
    hand = OpaqueInput(Unflattenable)
    torch.manual_seed(0)
    ours = OpaqueInput(Unflattenable)
    apply_activation_checkpointing(ours, CheckpointingConfig(names=["body"]))
    expected = gradients(
        hand, lambda model, x: model.head(checkpoint(model.body, Unflattenable(x), use_reentrant=False))
    )
    assert same_values(unwrapped(expected), unwrapped(gradients(ours, lambda model, x: model(x))))


class UnflattenableScale(nn.Module):
    """Scales its body's output by a buffer held as a subclass whose ``__tensor_flatten__`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.body = plain_body()
        self.register_buffer("scale", Unflattenable(torch.full((WIDTH,), 0.5)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * self.scale.inner)


def test_a_buffer_whose_flatten_raises_is_copied_through_its_own_ops_and_trains_as_under_torchs_checkpoint() -> None:
    torch.manual_seed(0)
    hand = nn.Sequential(UnflattenableScale())
    torch.manual_seed(0)
    ours = nn.Sequential(UnflattenableScale())
    apply_activation_checkpointing(ours, CheckpointingConfig(names=["0"]))
    expected = gradients(hand, lambda model, x: checkpoint(model[0], x, use_reentrant=False))
    for _ in range(2):
        assert same_values(expected, gradients(ours, lambda model, x: model(x)))


def test_a_subclass_digest_reads_every_inner_tensor_by_the_formula() -> None:
    first, second = torch.randn(4, 16), torch.randn(4, 16)
    pair = TwoTensor(first, second)
    expected = (torch.stack([digest(first), digest(second)]) * row_weights(2)).sum()  # type: ignore[misc]
    assert torch.equal(digest(pair), expected)  # type: ignore[arg-type]
    changed = second.clone()
    changed[3, 15] += 1.0
    assert not torch.equal(digest(pair), digest(TwoTensor(first, changed)))  # type: ignore[arg-type]
    assert not torch.equal(digest(pair), digest(TwoTensor(second, first)))  # type: ignore[arg-type]
    assert fingerprint(pair).same_as(fingerprint(TwoTensor(first.clone(), second.clone())))
    assert not fingerprint(pair).same_as(fingerprint(TwoTensor(first, changed)))
    assert DigestPlans().read(pair, EXACT) is None  # two inner tensors: no single word matrix


def test_conjugated_and_negative_views_are_digested_as_the_values_they_show() -> None:
    values = torch.randn(4, 16, dtype=torch.complex64)
    assert values.conj().is_conj()
    assert torch.equal(digest(values.conj()), digest(values.conj().resolve_conj()))  # type: ignore[arg-type]
    assert fingerprint(values.conj()).same_as(fingerprint(values.conj().resolve_conj()))
    real = torch.randn(4, 16)
    negative = torch._neg_view(real)  # contiguous, so that nothing copies it on the way
    assert negative.is_neg() and negative.is_contiguous()
    assert torch.equal(digest(negative), digest(-real))  # type: ignore[arg-type]
    imaginary = values.conj().imag  # the public way to a negative view
    assert imaginary.is_neg()
    assert torch.equal(digest(imaginary), digest(-values.imag))  # type: ignore[arg-type]


class ConjugateMix(nn.Module):
    """Multiplies a complex activation by the conjugate of its scaled copy: ``mul`` saves that conjugated view. With
    ``defect``, the scale is a call count kept in a list (not replayed): of the region's saved tensors only the
    conjugated view differs."""

    def __init__(self, defect: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 2 * WIDTH)
        self.defect = defect
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(self.inp(x).unflatten(-1, (WIDTH, 2)))
        scale = 1.0
        if self.defect:
            self.calls.append(1)
            scale += 0.1 * len(self.calls)
        return torch.view_as_real(z * (z * scale).conj()).flatten(-2)[..., :WIDTH]


def test_the_region_saves_a_conjugated_view() -> None:
    kinds = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kinds.append((tensor.dtype, tensor.is_conj()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ConjugateMix()(tokens(0))
    assert (torch.complex64, True) in kinds


@pytest.mark.parametrize("tier", TIERS)
def test_a_clean_region_saving_a_conjugated_view_compares_every_saved_tensor(tier: str) -> None:
    result = trial(Case(lambda: Head(ConjugateMix())), tier)
    assert result.gradients_equal and same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0 and result.sentinel.not_compared == 0
    for report in result.checks:
        assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)


@pytest.mark.parametrize("tier", TIERS)
def test_a_defect_confined_to_a_conjugated_view_is_seen(tier: str) -> None:
    result = trial(Case(lambda: Head(ConjugateMix(defect=True))), tier)
    found = result.sentinel.regions["body"]
    assert found.mismatches > 0 and found.not_compared == 0, found
    assert found.first_mismatch is not None and "`ConjBackward0`" in found.first_mismatch
    assert "complex64" in found.first_mismatch
    assert [(region.name, region.cause) for region in result.checks[0].regions] == [("body", "python_state")]


class TwoTensorModule(StackModule):
    """:class:`~tests.helpers.StackModule` of plain blocks whose linear weights are ``TwoTensor`` parameters."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock", momentum=0.0)
        two_tensor_weights(self.model)


def test_the_default_monitor_trains_a_model_with_subclass_weights_as_a_plain_twin(tmp_path: Any) -> None:
    pl.seed_everything(0, verbose=False)
    initial = TwoTensorModule()
    trained = {}
    runs = (("plain", None, False), ("checkpointed", None, True), ("monitored", RecomputationMonitor(), True))
    for name, monitor, checkpointed in runs:
        pl.seed_everything(0, verbose=False)
        module = TwoTensorModule()
        config = CheckpointingConfig(names=["model.blocks.*"])
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=config) if checkpointed else "auto"
        callbacks = [] if monitor is None else [monitor]
        trainer = pl.Trainer(**trainer_kwargs(tmp_path / name, max_steps=4, strategy=strategy, callbacks=callbacks))
        trainer.fit(module)
        assert trainer.global_step == 4
        trained[name] = (module, monitor)
    (plain, _), (checkpointed, _), (monitored, monitor) = (trained[name] for name, _, _ in runs)
    assert isinstance(monitored.model.blocks[0].linear.weight, TwoTensor)
    assert not same_state(plain, initial)  # it trained
    assert same_state(plain, checkpointed) and same_state(plain, monitored)
    assert monitor is not None
    checked = [entry for entry in monitor.history if entry.skipped is None]
    assert checked and [entry.grad_divergence for entry in checked] == [0.0] * len(checked)
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0 and report.mismatches == 0 and report.not_compared == 0


def test_a_qlora_block_with_a_torchao_nf4_weight_trains_as_without_checkpointing() -> None:
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

    class QLoRA(nn.Module):
        """A frozen NF4 base weight and a trainable low-rank adapter, as QLoRA writes them."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(nf4.to_nf4(torch.randn(128, 128)), requires_grad=False)
            self.down = nn.Linear(128, 4, bias=False)
            self.up = nn.Linear(4, 128, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(nf4.linear_nf4(x, self.weight) + self.up(self.down(x)))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(128, 128), QLoRA(), nn.Linear(128, 1))

    plain, ours = build(), build()
    apply_activation_checkpointing(ours, CheckpointingConfig(classes=["QLoRA"]))
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    plain(x).sum().backward()
    with recomputation_sentinel(ours, mode="exact") as sentinel:
        for _ in range(STEPS):
            for param in ours.parameters():
                param.grad = None
            ours(x).sum().backward()
    pairs = zip(plain.parameters(), ours.parameters(), strict=True)
    trainable = [(a.grad, b.grad) for a, b in pairs if a.requires_grad]
    assert trainable and all(torch.equal(a, b) for a, b in trainable)  # type: ignore[arg-type]
    report = sentinel.report()
    assert report.compared > 0 and report.mismatches == 0 and report.not_compared == 0
    checked = check_recomputation(ours, lambda: ours(x).sum())
    assert (checked.diverged, checked.grad_divergence, checked.error) == (False, 0.0, None)


DIM_Q = 16


class Int8Weight(torch.Tensor):
    """A quantized weight as a small library writes one: int8 values and a scale per row, implementing only the ops a
    linear layer runs on it (``detach``, ``t``, ``addmm``, ``mm``), every other op refused."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, transposed: bool = False) -> "Int8Weight":
        shape = data.shape[::-1] if transposed else data.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=scale.dtype)  # type: ignore[attr-defined,no-any-return]

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, transposed: bool = False) -> None:
        self.data_int8, self.scale, self.transposed = data, scale, transposed

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, bool]]:
        return ["data_int8", "scale"], {"transposed": self.transposed}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, bool], *_: Any) -> "Int8Weight":
        return Int8Weight(inner["data_int8"], inner["scale"], meta["transposed"])

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int8Weight":
        scale = weight.abs().amax(dim=1) / 127
        return cls(torch.round(weight / scale[:, None]).to(torch.int8), scale)

    def values(self) -> torch.Tensor:
        weight = self.data_int8.to(self.scale.dtype) * self.scale[:, None]
        return weight.t() if self.transposed else weight

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return Int8Weight(args[0].data_int8, args[0].scale, args[0].transposed)
        if func is aten.t.default:
            return Int8Weight(args[0].data_int8, args[0].scale, not args[0].transposed)
        if func in (aten.mm.default, aten.addmm.default):
            plain = [arg.values() if isinstance(arg, Int8Weight) else arg for arg in args]
            return func(*plain, **(kwargs or {}))
        raise NotImplementedError(f"Int8Weight does not support {func}")


class Int8Adapter(nn.Module):
    """A frozen int8 base weight, held as a ``Parameter`` or a buffer, and a trainable low-rank adapter."""

    def __init__(self, held_as: str) -> None:
        super().__init__()
        weight = Int8Weight.quantized(torch.randn(DIM_Q, DIM_Q))
        if held_as == "parameter":
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.register_buffer("weight", weight)
        self.down = nn.Linear(DIM_Q, 4, bias=False)
        self.up = nn.Linear(4, DIM_Q, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight) + self.up(self.down(x)))


@pytest.mark.parametrize("held_as", ["parameter", "buffer"])
def test_a_quantized_weight_implementing_only_its_forwards_ops_trains_and_is_checked_as_without_checkpointing(
    held_as: str,
) -> None:
    # The package copies, compares and puts back such a weight through its inner tensors, never with an op of its own.
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(DIM_Q, DIM_Q), Int8Adapter(held_as), nn.Linear(DIM_Q, 1))

    plain, ours = build(), build()
    apply_activation_checkpointing(ours, CheckpointingConfig(classes=["Int8Adapter"]))
    x = torch.randn(8, DIM_Q, generator=torch.Generator().manual_seed(1))
    with recomputation_sentinel(ours, mode="exact") as sentinel:
        for _ in range(STEPS):
            grads = []
            for model in (plain, ours):
                model.zero_grad(set_to_none=True)
                model(x).sum().backward()
                grads.append([param.grad for param in model.parameters() if param.requires_grad])
            assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    report = sentinel.report()
    assert report.compared > 0 and report.mismatches == 0
    checked = check_recomputation(ours, lambda: ours(x).sum(), attribution=True)
    assert (checked.diverged, checked.grad_divergence, checked.error, checked.buffer_mutations) == (
        False,
        0.0,
        None,
        [],
    )
    assert same_state(plain, ours)


def test_the_check_compares_every_inner_tensor_of_a_subclass_gradient() -> None:
    torch.manual_seed(0)
    model = two_tensor_weights(Head(CountedScale(second_only=True)))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
    x = tokens(0)

    def loss() -> torch.Tensor:
        out = model(x)
        return F.mse_loss(out, torch.zeros_like(out))

    report = check_recomputation(model, loss)
    # Ground truth: the two passes' gradients, read inner tensor by inner tensor. `torch.equal` on a `TwoTensor`
    # reads its first inner tensor only, where the two passes agree.
    model.body.calls.clear()
    reference = gradients(model, lambda m, x: m.head(m.body.forward.plain_forward(x)))
    model.body.calls.clear()
    recomputed = gradients(model, lambda m, x: m(x))
    firsts = [values(grad)[0] for grad in reference], [values(grad)[0] for grad in recomputed]
    assert all(torch.equal(a, b) for a, b in zip(*firsts, strict=True))
    assert not same_values(reference, recomputed)
    assert report.diverged and report.grad_divergence > 0.0, report


class ObservedInt8Adapter(Int8Adapter):
    """An ``Int8Adapter`` whose forward updates its frozen weight's scale in place (a running-scale observer): a write
    to an inner tensor, which never moves the wrapper's own version counter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.scale.mul_(1.01)
        return super().forward(x)


def test_a_write_to_a_quantized_weights_inner_tensor_is_a_parameter_write_the_check_puts_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM_Q, DIM_Q), ObservedInt8Adapter("parameter"), nn.Linear(DIM_Q, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["ObservedInt8Adapter"]))
    x = torch.randn(8, DIM_Q, generator=torch.Generator().manual_seed(1))
    scale = model[1].weight.scale
    before = scale.clone()
    report = check_recomputation(model, lambda: model(x).sum(), attribution=True)
    # The check ran the forward twice and recomputed once: it leaves the scale as it found it.
    assert torch.equal(scale, before) and report.not_restored == []
    assert report.diverged
    assert [(region.name, region.cause) for region in report.regions] == [("1", "parameter_write")]
    with recomputation_sentinel(model, mode="exact") as sentinel:
        model(x).sum().backward()
    found = sentinel.report().regions["1"]
    # The saved activation made with the scale, and the weight recomputation wrote (as for a plain parameter).
    assert (found.compared, found.mismatches) == (3, 2), found
    # The live step: the forward's write and the recomputation's, as without the package (twice 1.01).
    assert torch.allclose(scale, before * 1.01**2)


class ScaleHistoryWeight(Int8Weight):
    """An :class:`Int8Weight` whose every use updates its scale in place (a delayed-scaling history), inside its own
    ``__torch_dispatch__``: below the dispatch keys that move version counters."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, transposed: bool = False) -> "ScaleHistoryWeight":
        shape = data.shape[::-1] if transposed else data.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=scale.dtype)  # type: ignore[attr-defined,no-any-return]

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, bool], *_: Any) -> "ScaleHistoryWeight":
        return ScaleHistoryWeight(inner["data_int8"], inner["scale"], meta["transposed"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default, aten.t.default):
            weight = args[0]
            transposed = not weight.transposed if func is aten.t.default else weight.transposed
            return ScaleHistoryWeight(weight.data_int8, weight.scale, transposed)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for arg in args:
            if isinstance(arg, ScaleHistoryWeight):
                arg.scale.mul_(0.5).add_(0.01)
        return out


def test_check_recomputation_puts_back_an_inner_tensor_a_subclass_writes_in_its_own_dispatch() -> None:
    # Its version counters never moved, so the check left the scale updated by its passes (6 uses where the step made
    # 2) and said nothing was left unrestored: training after the check differed from training without it.
    torch.manual_seed(0)
    adapter = Int8Adapter("parameter")
    adapter.weight = nn.Parameter(
        ScaleHistoryWeight(adapter.weight.data_int8, adapter.weight.scale), requires_grad=False
    )
    model = nn.Sequential(nn.Linear(DIM_Q, DIM_Q), adapter, nn.Linear(DIM_Q, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["Int8Adapter"]))
    x = torch.randn(8, DIM_Q, generator=torch.Generator().manual_seed(1))
    before = adapter.weight.scale.clone()
    report = check_recomputation(model, lambda: model(x).sum())
    assert torch.equal(adapter.weight.scale, before)
    assert report.not_restored == []


def _jagged_loss(model: nn.Module) -> torch.Tensor:
    parts = [torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rows)) for rows in (3, 5, 2)]
    return sum(out.square().sum() for out in model(torch.nested.nested_tensor(parts, layout=torch.jagged)).unbind())


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_a_jagged_nested_tensor_is_attributed_by_the_ops_it_runs_not_its_metadata_queries(
    preserve_rng_state: bool,
) -> None:
    # The nested tensor sends size and stride queries through dispatch, not alike in the forward and its
    # recomputation: attribution compared them as ops and named `python_state` at op 0 of both regions, clean or not.
    torch.manual_seed(0)
    model = nn.Sequential(DropoutBlock(), DropoutBlock())
    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=preserve_rng_state)
    apply_activation_checkpointing(model, config)
    report = check_recomputation(model, lambda: _jagged_loss(model), attribution=True)
    assert report.diverged is not preserve_rng_state
    expected = None if preserve_rng_state else "rng_not_preserved"
    assert [(region.cause, region.ops_compared > 0) for region in report.regions] == [(expected, True)] * 2
