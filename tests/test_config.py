"""Tests for `lightning_ckpt_determinism.config`: the fields, their validation and the op and class resolvers."""

import pytest
import torch
from torch import nn

from lightning_ckpt_determinism import CheckpointingConfig
from lightning_ckpt_determinism.config import resolve_class_path, resolve_ops


def test_defaults_checkpoint_everything_matched_with_full_recomputation() -> None:
    config = CheckpointingConfig(classes=["Block"])
    assert config.classes == ["Block"]
    assert config.names == []
    assert config.every_n == 1
    assert config.save_ops == []
    assert config.preserve_rng_state is True
    assert config.preserve_host_rng is False
    assert config.protect_buffers is True
    assert config.determinism_check == "default"


def test_sequences_become_lists() -> None:
    # jsonargparse and users may hand tuples; the config stores lists so it compares and serialises alike.
    config = CheckpointingConfig(classes=("Block",), names=("model.blocks.*",), save_ops=("aten.mm",))
    assert config.classes == ["Block"]
    assert config.names == ["model.blocks.*"]
    assert config.save_ops == ["aten.mm"]


def test_empty_config_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"selects nothing: set `classes` .* or `names`"):
        CheckpointingConfig()


@pytest.mark.parametrize("every_n", [0, -1, True, 1.5])
def test_every_n_must_be_a_positive_integer(every_n: object) -> None:
    with pytest.raises(ValueError, match=rf"`every_n` must be an integer >= 1, got {every_n!r}"):
        CheckpointingConfig(classes=["Block"], every_n=every_n)  # type: ignore[arg-type]


def test_every_n_above_one_is_kept() -> None:
    assert CheckpointingConfig(names=["blocks.*"], every_n=3).every_n == 3


def test_unknown_determinism_check_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"`determinism_check` can be one of \['default', 'none'\], got 'strict'"):
        CheckpointingConfig(classes=["Block"], determinism_check="strict")


def test_determinism_check_none_is_accepted() -> None:
    assert CheckpointingConfig(classes=["Block"], determinism_check="none").determinism_check == "none"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("torch.nn.NoSuchLayer", r"`classes` entry 'torch.nn.NoSuchLayer' cannot be imported"),
        ("no_such_package.Block", r"`classes` entry 'no_such_package.Block' cannot be imported"),
        ("math.pi", r"`classes` entry 'math.pi' is not a class, got float"),
    ],
)
def test_unknown_class_path_is_rejected(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(classes=[path])


def test_bare_class_names_are_not_imported() -> None:
    # A bare name is matched against class names at apply time, so one that exists nowhere is not an error here.
    assert CheckpointingConfig(classes=["NoSuchBlock"]).classes == ["NoSuchBlock"]


def test_resolve_class_path_returns_the_class() -> None:
    assert resolve_class_path("torch.nn.TransformerEncoderLayer") is nn.TransformerEncoderLayer
    assert resolve_class_path("tests.helpers.DropoutBlock").__name__ == "DropoutBlock"


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ("aten.no_such_op", r"`save_ops` entry 'aten.no_such_op' is not an op torch knows"),
        ("no_such_namespace.mm", r"`save_ops` entry 'no_such_namespace.mm' is not an op torch knows"),
        ("mm", r"`save_ops` entry 'mm' is not an op name: use 'namespace.op'"),
        ("aten.mm.default.extra", r"`save_ops` entry 'aten.mm.default.extra' is not an op name"),
        ("aten..default", r"`save_ops` entry 'aten..default' is not an op name"),
        ("aten.mm.no_such_overload", r"`save_ops` entry 'aten.mm.no_such_overload' names an unknown overload"),
    ],
)
def test_unknown_save_op_is_rejected(op: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(classes=["Block"], save_ops=[op])


def test_resolve_ops_expands_packets_to_every_overload_without_duplicates() -> None:
    ops = resolve_ops(["aten.mm", "aten.mm.default", "aten.addmm.default"])
    expected_mm = [getattr(torch.ops.aten.mm, name) for name in torch.ops.aten.mm.overloads()]
    assert ops == [*expected_mm, torch.ops.aten.addmm.default]
    assert torch.ops.aten.mm.default in ops


def test_resolve_ops_keeps_a_single_overload() -> None:
    assert resolve_ops(["aten.bmm.default"]) == [torch.ops.aten.bmm.default]
    assert resolve_ops([]) == []
