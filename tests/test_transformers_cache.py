"""transformers' key-value caches kept out of checkpointed regions however they reach a layer: by keyword, or by
position as transformers 5's ``GPT2Model`` and ``DecisionTransformerGPT2Model`` pass theirs; asked for by the
config's default or by ``use_cache=True`` in the call. Ground truth: the same model's gradients without
checkpointing (tiny models built from configs, no downloads)."""

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import DecisionTransformerConfig, DecisionTransformerModel, PreTrainedModel

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    check_recomputation,
    remove_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.kv_cache import CacheParameters
from tests.test_transformers import build, gradients, lm_loss, token_ids

DROPPED = "lightning_ckpt_determinism: checkpointed `{}` regions were called with {} with grad enabled"
ATTENTIONS = ("eager", "sdpa")


def padding_mask(padded: bool) -> torch.Tensor | None:
    """None, or a mask whose second sequence starts with five pad tokens (sdpa then takes the explicit-mask path)."""
    if not padded:
        return None
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    return mask


def recorded(closure: Callable[[], dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """What ``closure`` returns and the first clause of each package warning it raised, each time (Python's default
    filter would show one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = closure()
    return result, [
        str(w.message).partition(";")[0] for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)
    ]


def assert_same(plain: dict[str, torch.Tensor], checkpointed: dict[str, torch.Tensor]) -> None:
    assert plain.keys() == checkpointed.keys()
    assert all(torch.isfinite(value).all() for value in plain.values())
    assert [key for key in plain if not torch.equal(plain[key], checkpointed[key])] == []


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("asked", ["config", "call"])
def test_gpt2_with_its_cache_on_trains_with_the_gradients_of_no_checkpointing(
    asked: str, attention: str, padded: bool
) -> None:
    model, layer = build("gpt2", attention)
    assert model.config.use_cache is True
    kwargs: dict[str, object] = {"attention_mask": padding_mask(padded)}
    if asked == "call":
        kwargs["use_cache"] = True
    ids = token_ids()
    closure = lm_loss(model, ids, **kwargs)
    # Without checkpointing the cache fills once per forward, as the run it is compared with does not.
    plain = gradients(model, closure)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    checkpointed, messages = recorded(lambda: gradients(model, closure))
    assert_same(plain, checkpointed)
    if asked == "call":
        # `use_cache=True` outranks the config: GPT2Model makes a cache and hands it to each block by position.
        assert messages == [DROPPED.format("GPT2Block", "`use_cache`, `cache`")] * 2
    else:
        assert messages == []
    with torch.no_grad():
        assert model(input_ids=ids, use_cache=True).past_key_values.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt2_in_eval_mode_with_grad_and_its_cache_asked_has_the_gradients_of_no_checkpointing(attention: str) -> None:
    # Log-probabilities with gradients (dropout off by `eval()`): the regions are checkpointed, so the cache is dropped.
    model, layer = build("gpt2", attention)
    model.eval()
    ids = token_ids()
    closure = lm_loss(model, ids, use_cache=True)
    plain = gradients(model, closure)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    checkpointed, messages = recorded(lambda: gradients(model, closure))
    assert_same(plain, checkpointed)
    assert messages == [DROPPED.format("GPT2Block", "`use_cache`, `cache`")] * 2


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt2_blocks_checkpointed_below_the_model_drop_the_cache_it_passes_by_position(
    attention: str, padded: bool
) -> None:
    # The regions' root holds no `PreTrainedModel`, so no config is switched: the layer-level drop is all there is.
    model, layer = build("gpt2", attention)
    ids = token_ids()
    closure = lm_loss(model, ids, attention_mask=padding_mask(padded))
    plain = gradients(model, closure)
    regions = apply_activation_checkpointing(model.transformer.h, CheckpointingConfig(classes=[layer]))
    assert len(regions) == 2 and model.config.use_cache is True
    checkpointed, messages = recorded(lambda: gradients(model, closure))
    assert_same(plain, checkpointed)
    assert messages == [DROPPED.format("GPT2Block", "`use_cache`, `cache`")] * 2


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_check_of_gpt2_called_with_use_cache_finds_nothing(attention: str) -> None:
    model, layer = build("gpt2", attention)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    closure = lm_loss(model, token_ids(), attention_mask=padding_mask(True), use_cache=True)
    with pytest.warns(LightningCkptDeterminismWarning, match="regions were called with `use_cache`, `cache` with grad"):
        report = check_recomputation(model, closure, attribution=True)
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
    assert [(region.ops_compared > 0, region.cause) for region in report.regions] == [(True, None)] * 2


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt2_blocks_compiled_one_by_one_drop_the_cache_passed_by_position(attention: str) -> None:
    # `aot_eager` runs the traced graphs with eager kernels and the same dropout masks: bit-identical to eager.
    model, layer = build("gpt2", attention)
    closure = lm_loss(model, token_ids(), attention_mask=padding_mask(True), use_cache=True)
    plain = gradients(model, closure)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    for block in model.transformer.h:
        block.compile(backend="aot_eager")
    checkpointed, messages = recorded(lambda: gradients(model, closure))
    assert_same(plain, checkpointed)
    assert messages == [DROPPED.format("GPT2Block", "`use_cache`, `cache`")] * 2


def tiny_decision_transformer(attention: str) -> PreTrainedModel:
    torch.manual_seed(0)
    config = DecisionTransformerConfig(
        state_dim=3,
        act_dim=2,
        hidden_size=32,
        n_layer=2,
        n_head=2,
        max_ep_len=16,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attention
    model = DecisionTransformerModel(config)
    model.train()
    return model


def trajectory_loss(model: nn.Module, padded: bool) -> Callable[[], torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    batch, steps = 2, 5
    inputs = {
        "states": torch.randn(batch, steps, 3, generator=generator),
        "actions": torch.randn(batch, steps, 2, generator=generator),
        "rewards": torch.randn(batch, steps, 1, generator=generator),
        "returns_to_go": torch.randn(batch, steps, 1, generator=generator),
        "timesteps": torch.arange(steps).expand(batch, steps),
    }
    if padded:
        mask = torch.ones(batch, steps, dtype=torch.long)
        mask[1, :2] = 0
        inputs["attention_mask"] = mask

    def loss() -> torch.Tensor:
        out = model(**inputs)
        return out.action_preds.square().mean() + out.state_preds.square().mean() + out.return_preds.square().mean()

    return loss


def used_gradients(model: nn.Module, closure: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of the parameters ``closure``'s loss reaches (the encoder's token embedding is unused: the
    decision transformer feeds it embeddings), with the same dropout masks at every call."""
    torch.manual_seed(5)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(closure(), list(params.values()), allow_unused=True)
    return {name: grad for name, grad in zip(params, grads, strict=True) if grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("root", ["model", "blocks"])
def test_decision_transformer_trains_with_the_gradients_of_no_checkpointing(
    root: str, attention: str, padded: bool
) -> None:
    model = tiny_decision_transformer(attention)
    assert model.config.use_cache is True
    closure = trajectory_loss(model, padded)
    plain = used_gradients(model, closure)
    assert set(dict(model.named_parameters())) - set(plain) == {"encoder.wte.weight"}
    checkpointing = CheckpointingConfig(classes=["DecisionTransformerGPT2Block"])
    regions = apply_activation_checkpointing(model if root == "model" else model.encoder.h, checkpointing)
    assert len(regions) == 2
    # Through the model, its (shared) config is switched off; below it, the encoder's cache reaches each block by
    # position and is dropped there.
    assert model.config.use_cache is (root == "blocks")
    checkpointed, messages = recorded(lambda: used_gradients(model, closure))
    assert_same(plain, checkpointed)
    expected = [] if root == "model" else [DROPPED.format("DecisionTransformerGPT2Block", "`use_cache`, `cache`")] * 2
    assert messages == expected
    remove_activation_checkpointing(model)
    assert model.config.use_cache is True


def test_cache_parameters_are_read_from_the_layer_signature_once() -> None:
    model, _ = build("gpt2", "eager")
    block = model.transformer.h[0]
    # `GPT2Block.forward` is wrapped twice by transformers (`deprecate_kwarg`, `GradientCheckpointingLayer`): the
    # signature is followed to the function underneath.
    assert CacheParameters.of("GPT2Block", block.forward).positions == ((1, "cache"), (5, "use_cache"))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["GPT2Block"]))
    assert block.__dict__["forward"]._cache_parameters == CacheParameters("GPT2Block", ((1, "cache"), (5, "use_cache")))
    assert CacheParameters.of("Builtin", len).positions == ()


def test_a_module_from_outside_transformers_keeps_an_argument_named_cache() -> None:
    class Appends(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, cache: list[torch.Tensor], use_cache: bool = True) -> torch.Tensor:
            if use_cache:
                cache.append(x)
            return self.linear(x).tanh()

    torch.manual_seed(0)
    module = nn.Sequential(Appends())
    apply_activation_checkpointing(module, CheckpointingConfig(classes=["Appends"]))
    assert module[0].__dict__["forward"]._cache_parameters is None
    cache: list[torch.Tensor] = []
    x = torch.randn(2, 4, requires_grad=True)
    module[0](x, cache, True).sum().backward()
    # Recomputation runs the forward again: the user's own list is theirs to keep (the package leaves it as given).
    assert len(cache) == 2 and all(item is x for item in cache)


def test_a_layer_that_only_reads_its_cache_keeps_it_as_transformers_does() -> None:
    # transformers marks such a layer `_can_checkpoint_with_cache` (a decoder attending over the keys an encoder put
    # in the cache in the same forward): its recomputation reads the same cache, and it is kept; only `use_cache` goes.
    from transformers.modeling_layers import GradientCheckpointingLayer

    class ReadsCache(GradientCheckpointingLayer):
        _can_checkpoint_with_cache = True

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, cache: dict[str, torch.Tensor] | None = None, use_cache: bool = False):
            keys = cache["keys"] if cache is not None else x
            return torch.tanh(self.linear(x) @ keys.T @ keys)

    torch.manual_seed(0)
    plain = nn.Sequential(ReadsCache())
    model = nn.Sequential(ReadsCache())
    model.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["ReadsCache"]))
    assert model[0].__dict__["forward"]._cache_parameters == CacheParameters("ReadsCache", ((2, "use_cache"),), True)
    x, keys = torch.randn(3, 4), torch.randn(5, 4)
    grads = []
    for net in (plain, model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            net[0](x, {"keys": keys}, use_cache=True).sum().backward()
        grads.append([param.grad.clone() for param in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    [said] = [str(warning.message) for warning in caught]
    assert "were called with `use_cache` with grad enabled; they run with `use_cache=False`, reading the cache" in said
