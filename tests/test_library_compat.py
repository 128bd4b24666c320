"""Each entry of `_library_compat` pinned on the installed Lightning, torchmetrics and jsonargparse: the real error or
object, read as the package reads it."""

from argparse import ArgumentError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torchmetrics import MeanMetric

from lightning_ckpt_determinism import _library_compat as compat
from tests.helpers import StackModule, trainer_kwargs


@dataclass
class _Inner:
    every_n: PositiveInt = 1


def _parse_error(value: object) -> str:
    """jsonargparse's own message for a value its type refuses, nested under two keys."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--outer", type=_Inner)
    with pytest.raises(ArgumentError) as raised:
        parser.parse_object({"outer": {"every_n": value}})
    return str(raised.value)


def test_rejected_value_names_the_nested_key_and_why_from_jsonargparses_message() -> None:
    found = compat.rejected_value(_parse_error(0))
    assert found.startswith("`outer.every_n`: ") and "0" in found


def test_package_message_in_finds_a_validators_message_listed_by_jsonargparse() -> None:
    text = 'Parser key "checkpointing":\n  - `every_n` must be an integer >= 1, got 0.'
    assert compat.package_message_in(text) == "`every_n` must be an integer >= 1, got 0."
    assert compat.package_message_in(_parse_error(0)) is None  # jsonargparse's own messages never start with a name


def test_literal_rejection_reads_the_choices_and_the_value_from_jsonargparses_message() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--mode", type=Literal["warn", "raise"])
    with pytest.raises(ArgumentError) as raised:
        parser.parse_object({"mode": "stop"})
    reason = compat.rejected_value(str(raised.value)).removeprefix("`mode`: ")
    assert compat.literal_rejection(reason) == (["warn", "raise"], "stop")
    assert compat.literal_rejection(compat.rejected_value(_parse_error(0))) is None


def test_lightnings_error_for_an_unknown_strategy_name_is_recognised() -> None:
    with pytest.raises(ValueError) as raised:
        Trainer(strategy="dpp", accelerator="cpu", logger=False, enable_progress_bar=False)
    assert compat.is_unknown_strategy_error(raised.value)
    assert not compat.is_unknown_strategy_error(ValueError("dropout probability has to be between 0 and 1"))


def test_a_class_given_an_argument_it_does_not_take_is_read_with_its_path_and_the_option() -> None:
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=str | Strategy)
    given = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"checkpointing": {"classes": []}}}
    with pytest.raises(ArgumentError) as raised:
        parser.parse_object({"strategy": given})
    assert compat.class_refusing(str(raised.value)) == (
        "lightning.pytorch.strategies.DDPStrategy",
        "checkpointing.classes",
    )
    assert compat.class_refusing(_parse_error(0)) is None


def test_a_single_value_where_a_list_is_expected_is_read_with_the_value() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--classes", type=list[str])
    with pytest.raises(ArgumentError) as raised:
        parser.parse_object({"classes": "ConvBlock"})
    reason = compat.rejected_value(str(raised.value)).removeprefix("`classes`: ")
    assert compat.list_expected(reason) == "ConvBlock"
    assert compat.list_expected(compat.rejected_value(_parse_error(0))) is None


def test_a_metrics_states_and_bookkeeping_are_what_an_update_changes() -> None:
    metric = MeanMetric()
    names = compat.metric_state_names(metric)
    assert len(names) == 2 and "weight" in names
    before = {key: vars(metric).get(key) for key in compat.METRIC_BOOKKEEPING}
    metric.update(torch.tensor([1.0, 3.0]))
    assert float(metric.compute()) == 2.0
    after = {key: vars(metric).get(key) for key in compat.METRIC_BOOKKEEPING}
    assert set(compat.METRIC_BOOKKEEPING) <= set(vars(metric))
    assert after["_update_count"] == before["_update_count"] + 1
    assert after["_computed"] is not None


@pytest.mark.parametrize(("every", "accumulate"), [(1, 1), (3, 1), (2, 2), (0, 1)])
def test_the_batches_lightning_logs_at_its_interval_are_those_it_logs_with_no_stop_asked(
    tmp_path: Path, every: int, accumulate: int
) -> None:
    seen: list[tuple[bool, bool]] = []

    class Reader(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            seen.append((compat.lightning_logs_this_batch(trainer), trainer._logger_connector.should_update_logs))
            # A stop asked on this process alone: Lightning logs the batch; the interval does not move.
            trainer.should_stop = len(seen) == 2
            if trainer.should_stop:
                seen.append((compat.lightning_logs_this_batch(trainer), trainer._logger_connector.should_update_logs))
                trainer.should_stop = False

    kwargs = trainer_kwargs(tmp_path, max_steps=6, callbacks=[Reader()], log_every_n_steps=every)
    Trainer(**kwargs, accumulate_grad_batches=accumulate).fit(StackModule())
    stopped = seen.pop(2)
    assert [ours for ours, _ in seen] == [lightnings for _, lightnings in seen]
    assert any(ours for ours, _ in seen) == (every > 0) and stopped == (seen[1][0], every > 0)


def test_lightning_notes_the_module_it_compiles() -> None:
    module = StackModule()
    assert not compat.compiled_by_lightning(module)
    from lightning.pytorch.utilities.compile import from_compiled

    compiled = from_compiled(torch.compile(module, backend="eager"))
    assert compiled is module and compat.compiled_by_lightning(module)


def test_transformers_marks_the_layers_that_only_read_their_cache() -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Reader(GradientCheckpointingLayer):
        _can_checkpoint_with_cache = True

    assert GradientCheckpointingLayer._can_checkpoint_with_cache is False
    assert compat.reads_cache_only(Reader()) and not compat.reads_cache_only(GradientCheckpointingLayer())


def test_every_entry_is_pinned_here() -> None:
    pinned = {
        "rejected_value",
        "package_message_in",
        "literal_rejection",
        "is_unknown_strategy_error",
        "metric_state_names",
        "class_refusing",
        "list_expected",
        "bool_expected",
        "lightning_logs_this_batch",
        "compiled_by_lightning",
        "reads_cache_only",
        "ModelSetupHook",
    }
    assert set(compat.__all__) == pinned | {"METRIC_BOOKKEEPING"}


@pytest.mark.parametrize("strategy", [DDPStrategy, FSDPStrategy])
def test_the_model_setup_hook_is_handed_the_lightning_strategys_own_setup_model(strategy: type) -> None:
    handed = []

    class Probe(compat.ModelSetupHook, strategy):  # type: ignore[misc, valid-type]
        def _around_setup_model(self, model: torch.nn.Module, setup: Any) -> torch.nn.Module:
            handed.append(setup)
            return model

    probe = Probe()
    model = torch.nn.Linear(1, 1)
    assert probe._setup_model(model) is model
    (setup,) = handed
    assert setup.__self__ is probe and setup.__func__ is strategy._setup_model


def test_a_value_a_bool_argument_refuses_is_read_as_jsonargparse_prints_it() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--flag", type=bool)
    with pytest.raises(ArgumentError) as raised:
        parser.parse_object({"flag": 2})
    found = compat.rejected_value(str(raised.value))
    assert found.startswith("`flag`: ")
    assert compat.bool_expected(found.removeprefix("`flag`: ")) == "2"
