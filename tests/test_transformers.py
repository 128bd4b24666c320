"""Hugging Face transformers models (tiny GPT-2 and Llama built from configs, no downloads) under the package's
checkpointing: the key-value cache kept out of recomputation, exact gradients, clean attribution and a clean fit."""

import copy
import logging
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.kv_cache import is_transformers_model
from tests.helpers import trainer_kwargs

VOCAB = 64
CACHE_LINE = "lightning_ckpt_determinism: set `config.use_cache = False` on `{}` while its layers are checkpointed"


def tiny_gpt2(attention: str) -> PreTrainedModel:
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = attention
    return GPT2LMHeadModel(config)


def tiny_llama(attention: str) -> PreTrainedModel:
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attention
    return LlamaForCausalLM(config)


MODELS: dict[str, tuple[Callable[[str], PreTrainedModel], str]] = {
    "gpt2": (tiny_gpt2, "GPT2Block"),
    "llama": (tiny_llama, "LlamaDecoderLayer"),
}
CASES = [(name, attention) for name in MODELS for attention in ("eager", "sdpa")]


def build(name: str, attention: str) -> tuple[PreTrainedModel, str]:
    torch.manual_seed(0)
    make, layer = MODELS[name]
    model = make(attention)
    model.train()
    return model, layer


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: nn.Module, ids: torch.Tensor, **kwargs: object) -> Callable[[], torch.Tensor]:
    return lambda: model(input_ids=ids, labels=ids, **kwargs).loss


def gradients(model: nn.Module, closure: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of ``closure``'s loss, with the same dropout masks at every call (GPT-2 drops out)."""
    torch.manual_seed(5)
    params = dict(model.named_parameters())
    return dict(zip(params, torch.autograd.grad(closure(), list(params.values())), strict=True))


@pytest.mark.parametrize(("name", "attention"), CASES)
def test_checkpointed_layers_give_the_gradients_of_no_checkpointing_with_the_cache_turned_off_and_restored(
    name: str, attention: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, layer = build(name, attention)
    assert model.config.use_cache is True
    ids = token_ids()
    plain = gradients(model, lm_loss(model, ids))
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        regions = apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    assert len(regions) == 2
    (line,) = [record.getMessage() for record in caplog.records if "use_cache" in record.getMessage()]
    assert line.startswith(CACHE_LINE.format(type(model).__name__))
    assert model.config.use_cache is False
    checkpointed = gradients(model, lm_loss(model, ids))
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[key], checkpointed[key]) for key in plain)
    assert sorted(remove_activation_checkpointing(model)) == sorted(regions)
    assert model.config.use_cache is True


@pytest.mark.parametrize(("name", "attention"), CASES)
def test_attribution_of_a_clean_model_finds_nothing(name: str, attention: str) -> None:
    model, layer = build(name, attention)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    report = check_recomputation(model, lm_loss(model, token_ids()), attribution=True)
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
    assert len(report.regions) == 2
    assert all(region.ops_compared > 0 for region in report.regions)
    assert [(region.diverged, region.cause, region.first_divergent_op) for region in report.regions] == [
        (False, None, None)
    ] * 2


def test_checks_of_a_model_returning_its_hidden_states_leave_its_output_hooks_as_training_does() -> None:
    # transformers installs its output-capturing hooks at the first call that asks for hidden states, behind an
    # attribute it creates: the checks put both back, and the recomputation registers none.
    plain, layer = build("llama", "eager")
    model, _ = build("llama", "eager")
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    counts = []
    for step in range(3):
        ids = token_ids(step)
        report = check_recomputation(model, lambda ids=ids: hidden_states_loss(model, ids))
        assert (report.diverged, report.grad_divergence, report.attribute_mutations) == (False, 0.0, [])
        grads = [gradients(twin, lambda twin=twin, ids=ids: hidden_states_loss(twin, ids)) for twin in (plain, model)]
        assert all(torch.equal(grads[0][key], grads[1][key]) for key in grads[0])
        counts.append([len(twin(input_ids=ids, output_hidden_states=True).hidden_states) for twin in (plain, model)])
    assert counts == [[3, 3]] * 3


def hidden_states_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    return out.loss + sum(state.square().mean() for state in out.hidden_states)


def test_a_cache_passed_in_training_is_dropped_with_a_warning_and_the_gradients_stay_exact() -> None:
    model, layer = build("llama", "eager")
    ids = token_ids()
    plain = gradients(model, lm_loss(model, ids))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    with pytest.warns(LightningCkptDeterminismWarning, match="regions were called with `use_cache`, `cache` with grad"):
        checkpointed = gradients(model, lm_loss(model, ids, use_cache=True))
    assert all(torch.equal(plain[key], checkpointed[key]) for key in plain)
    # Without grad nothing is recomputed: the cache works as it does without checkpointing.
    with torch.no_grad():
        assert model(input_ids=ids, use_cache=True).past_key_values.get_seq_length() == ids.shape[1]


def test_models_built_from_one_config_keep_its_cache_off_until_the_last_ones_checkpointing_is_removed() -> None:
    # Each model's switch was its own: removing the first model's checkpointing turned the shared config's cache back
    # on while the second's layers were still checkpointed.
    first = tiny_gpt2("sdpa")
    torch.manual_seed(0)
    second = GPT2LMHeadModel(first.config)
    plain = copy.deepcopy(second)
    config = CheckpointingConfig(classes=["GPT2Block"])
    apply_activation_checkpointing(first, config)
    apply_activation_checkpointing(second, config)
    remove_activation_checkpointing(first)
    assert first.config.use_cache is False
    ids = token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningCkptDeterminismWarning)  # no cache reaches a checkpointed layer
        checkpointed = gradients(second, lm_loss(second, ids))
    expected = gradients(plain, lm_loss(plain, ids))
    assert all(torch.equal(expected[key], checkpointed[key]) for key in expected)
    remove_activation_checkpointing(second)
    assert first.config.use_cache is True


def test_a_copy_of_a_model_sharing_its_config_gets_its_cache_back_when_its_own_checkpointing_is_removed() -> None:
    first = tiny_gpt2("sdpa")
    second = GPT2LMHeadModel(first.config)
    config = CheckpointingConfig(classes=["GPT2Block"])
    apply_activation_checkpointing(first, config)
    apply_activation_checkpointing(second, config)
    for copied in (copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        assert copied.config is not first.config and copied.config.use_cache is False
        remove_activation_checkpointing(copied)
        assert copied.config.use_cache is True
    assert first.config.use_cache is False


def test_a_copy_sharing_its_originals_config_object_joins_its_switch() -> None:
    first = tiny_gpt2("sdpa")
    apply_activation_checkpointing(first, CheckpointingConfig(classes=["GPT2Block"]))
    copied = copy.deepcopy(first, {id(first.config): first.config})
    assert copied.config is first.config
    remove_activation_checkpointing(copied)
    assert first.config.use_cache is False  # the original's layers are still checkpointed
    remove_activation_checkpointing(first)
    assert first.config.use_cache is True


def test_a_cache_turned_back_on_while_a_model_is_checkpointed_is_turned_off_for_the_next_model() -> None:
    first = tiny_gpt2("sdpa")
    config = CheckpointingConfig(classes=["GPT2Block"])
    apply_activation_checkpointing(first, config)
    first.config.use_cache = True  # for a `generate()` between training phases
    second = GPT2LMHeadModel(first.config)
    apply_activation_checkpointing(second, config)
    assert first.config.use_cache is False
    remove_activation_checkpointing(first)
    remove_activation_checkpointing(second)
    assert first.config.use_cache is True


def test_a_model_whose_cache_is_off_is_left_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    model, layer = build("gpt2", "sdpa")
    model.config.use_cache = False
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    assert not [record for record in caplog.records if "use_cache" in record.getMessage()]
    remove_activation_checkpointing(model)
    assert model.config.use_cache is False


def test_transformers_models_are_recognised_by_their_base_class() -> None:
    model, _ = build("gpt2", "eager")
    assert is_transformers_model(model) and is_transformers_model(model.transformer)
    assert not is_transformers_model(model.transformer.h[0])


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_transformers_gradient_checkpointing_under_a_region_is_warned_with_what_to_turn_off(enable: str) -> None:
    model, layer = build("llama", "sdpa")
    if not hasattr(model, enable):
        pytest.skip(f"this transformers has no `{enable}`")
    # The older name is deprecated from transformers 5.x on, and warns so itself.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, enable)({"use_reentrant": False})
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        for _ in range(2):
            lm_loss(model, token_ids())().backward()
    messages = [str(w.message) for w in caught if isinstance(w.message, LightningCkptDeterminismWarning)]
    # Once per region, at its first forward, in words that name no region: Python's default filter shows it once.
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert messages[0].startswith(
        "lightning_ckpt_determinism: checkpointed `LlamaDecoderLayer` regions have another activation checkpointing"
        " inside them: transformers' gradient checkpointing (`activation_checkpointing_enable()`, formerly"
        " `gradient_checkpointing_enable()`). Nested"
    )
    assert "do not call `activation_checkpointing_enable()` or `gradient_checkpointing_enable()`" in messages[0]
    assert "call the matching `..._disable()`" in messages[0]


def noisy_sdpa(module: nn.Module, *args: object, **kwargs: object) -> tuple[torch.Tensor, object]:
    """sdpa attention scaled by a draw from NumPy's global RNG: a defect of recomputation inside every layer."""
    out, weights = sdpa_attention_forward(module, *args, **kwargs)
    return out * (1 + 0.01 * float(np.random.standard_normal())), weights


AttentionInterface.register("lightning_ckpt_determinism_tests_noisy", noisy_sdpa)


@pytest.mark.parametrize("noisy", [False, True], ids=["clean", "a defect inside the layers"])
def test_transformers_checkpointing_stacked_on_regions_is_off_in_the_reference_pass(noisy: bool) -> None:
    # Left on there, transformers' checkpoint recomputed the layers in both passes and a defect inside them cancelled
    # out: the check read 0.0 where the gradients differ from a plain twin's.
    plain, layer = build("llama", "lightning_ckpt_determinism_tests_noisy" if noisy else "sdpa")
    model = copy.deepcopy(plain)
    ids = token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable({"use_reentrant": False})
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[layer]))
    grads = []
    for twin in (plain, model):
        np.random.seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LightningCkptDeterminismWarning)  # the nesting warning
            lm_loss(twin, ids)().backward()
        grads.append([param.grad for param in twin.parameters()])
    differs = any(not torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert differs is noisy
    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LightningCkptDeterminismWarning)
        report = check_recomputation(model, lm_loss(model, ids))
    assert report.diverged is noisy and (report.grad_divergence > 0.0) is noisy
    assert all(sub.gradient_checkpointing for sub in model.modules() if type(sub).__name__ == layer)


def test_a_check_of_a_model_with_only_transformers_checkpointing_is_an_error() -> None:
    model, _ = build("gpt2", "eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(CheckpointingConfigError, match="found no region of this package in GPT2LMHeadModel") as err:
        check_recomputation(model, lm_loss(model, token_ids()))
    assert "It has transformers' gradient checkpointing (on `GPT2Block`)" in str(err.value)
    assert "`apply_activation_checkpointing(module, CheckpointingConfig(classes=[...]))`" in str(err.value)


class CausalLM(pl.LightningModule):
    """A transformers model trained on fixed random tokens."""

    def __init__(self, name: str, attention: str) -> None:
        super().__init__()
        self.model, _ = build(name, attention)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(3)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("name", "attention"), [("gpt2", "eager"), ("llama", "sdpa")])
def test_a_lightning_fit_logs_no_divergence_and_leaves_the_cache_as_it_was(
    name: str, attention: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = CausalLM(name, attention)
    layer = MODELS[name][1]
    monitor = RecomputationMonitor(every_n_steps=1, attribution="always")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[layer]))
    kwargs = trainer_kwargs(tmp_path, max_steps=3, strategy=strategy, callbacks=[monitor], logger=CSVLogger(tmp_path))
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        pl.Trainer(**kwargs).fit(module)
    assert [(record.step, record.grad_divergence, record.diverged) for record in monitor.history] == [
        (step, 0.0, False) for step in range(3)
    ]
    assert monitor.last_report is not None
    assert [region.cause for region in monitor.last_report.regions] == [None, None]
    assert any(
        record.getMessage().startswith(CACHE_LINE.format(type(module.model).__name__)) for record in caplog.records
    )
    assert module.model.config.use_cache is True
    assert checkpointed_modules(module) == {}


class RotaryAttention(nn.Module):
    """An attention block holding transformers' own rotary embedding, as models that keep it per layer do."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(config)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        cos, sin = self.rotary(x, torch.arange(length).expand(batch, length))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_dynamic_rotary_embedding_reset_by_a_short_step_after_a_long_eval_call_keeps_exact_gradients() -> None:
    config = LlamaConfig(
        hidden_size=16,
        num_attention_heads=2,
        max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    plain = nn.Sequential(RotaryAttention(config))
    model = nn.Sequential(RotaryAttention(config))
    model.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    inputs = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(1))
    for twin in (plain, model):
        with torch.no_grad():
            twin.eval()(inputs)  # longer than max_position_embeddings: the frequencies grow
        twin.train()
    x = inputs[:, :6]  # shorter: the forward resets them
    grads = [torch.autograd.grad(twin(x).pow(2).mean(), list(twin.parameters())) for twin in (plain, model)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    report = check_recomputation(model, lambda: model(x).pow(2).mean(), attribution=True)
    assert (report.grad_divergence, [region.cause for region in report.regions]) == (0.0, [None])
