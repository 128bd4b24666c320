"""The benchmark runs at its smallest size so it cannot rot; its values are checked for sanity, never for speed."""

import contextlib
import io
import itertools
import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

import lightning_ckpt_determinism
from benchmarks import (
    budget,
    budget_search,
    compiled,
    digest_floor,
    memory,
    moe,
    monitor,
    probes,
    saved_tensors,
    sentinel,
    sentinel_host,
    wrapper_overhead,
)
from benchmarks.common import ModelSize, Regions, Variant, build_model, interleaved_times, lm_loss, make_batch
from benchmarks.run import main
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationSentinel, recomputation_sentinel
from lightning_ckpt_determinism.verify import digest
from lightning_ckpt_determinism.verify.digest import DigestMode, DigestPlans, DigestTier
from lightning_ckpt_determinism.verify.sentinel.calls import KeptTensor, RegionCall

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
TIERS = get_args(DigestTier)
STEP_VARIANTS = ["none", "hand-written", "package", "package +host_rng"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The JSON and the printed table of one ``--size tiny`` run."""
    path = tmp_path_factory.mktemp("benchmarks") / "tiny.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--size", "tiny", "--json", str(path)]) == 0
    return json.loads(path.read_text()), printed.getvalue()


def _finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _sane_summary(stats: dict[str, float]) -> bool:
    return all(_finite_positive(stats[key]) for key in ("min", "q1", "median", "q3", "max")) and (
        stats["min"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["max"]
    )


def test_tiny_run_writes_every_section(tiny: tuple[dict[str, Any], str]) -> None:
    result, _ = tiny
    assert {
        "step_time",
        "memory",
        "check_cost",
        "check_memory",
        "lightning",
        "check_cost_ddp",
        "sentinel",
        "memory_budget",
        "goals",
        "notes",
        "machine",
        "size",
    } <= set(result)
    assert result["command"].startswith("python benchmarks/run.py --size tiny")
    assert result["size"] == {
        "layers": 2,
        "dim": 16,
        "heads": 2,
        "seq_len": 8,
        "batch_size": 2,
        "vocab_size": 16,
        "dropout": 0.1,
    }
    machine = result["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["torch_threads"] == torch.get_num_threads()
    assert machine["cores"] >= 1 and machine["cpu"]
    assert result["wall_s"] > 0


def test_step_times_and_ratios_are_finite_and_positive(tiny: tuple[dict[str, Any], str]) -> None:
    steps = tiny[0]["step_time"]
    assert list(steps["variants"]) == STEP_VARIANTS
    assert all(_sane_summary(stats) and stats["n"] == 3 for stats in steps["variants"].values())
    assert {"package/hand-written", "package +host_rng/hand-written", "hand-written/none", "package/none"} <= set(
        steps["ratios"]
    )
    assert all(_sane_summary(stats) for stats in steps["ratios"].values())


def test_memory_orders_the_variants_and_matches_the_analytical_figures(tiny: tuple[dict[str, Any], str]) -> None:
    mem = tiny[0]["memory"]
    assert mem["save_ops"] == ["aten.addmm", "aten.bmm"]
    variants = mem["variants"]
    held = {name: entry["held_bytes_per_block"] for name, entry in variants.items()}
    save_ops = "save_ops=aten.addmm,aten.bmm"
    assert held["none"] > held["every_n=2"] > held["full"] > 0
    assert held["full"] < held[save_ops] < held["none"]
    assert held["hand-written full"] == held["full"]
    # The example GPT has the paper's layout, so the counted bytes equal the converted formula exactly.
    assert all(entry["held_bytes_per_block"] == entry["analytical_bytes_per_block"] for entry in variants.values())
    # The selective-checkpointing cache bypasses saved-tensor hooks: only the held column sees it.
    assert variants[save_ops]["saved_bytes_per_block"] == held["full"]
    assert all(variants[name]["saved_bytes_per_block"] == held[name] for name in held if name != save_ops)
    assert mem["element_bytes"] == 4 and mem["mask_element_bytes"] == 4
    assert mem["korthikanti_16bit_bytes_per_layer"] == {"none": 8 * 2 * 16 * (34 + 5 * 2 * 8 / 16), "full": 512}


def test_check_cost_memory_and_lightning_throughput_are_reported(tiny: tuple[dict[str, Any], str]) -> None:
    result = tiny[0]
    cost, run, peaks = result["check_cost"], result["lightning"], result["check_memory"]
    timed = ["step", "checked step", "checked step, reference_regions=1", "two-pass check"]
    for name in [*timed, "two-pass check with attribution", "two-pass/step", "two-pass attribution/step"]:
        assert _sane_summary(cost[name]), name
    # Extra time over a step: finite, and positive at the median (a checked step runs a reference pass more).
    assert all(math.isfinite(cost[key]["median"]) for key in ("check/step", "check regions=1/step"))
    assert cost["max_grad_divergence"] == 0.0
    assert list(peaks["peak_bytes"]) == ["step", "checked step", "checked step, reference_regions=1"]
    assert all(_finite_positive(value) for value in peaks["peak_bytes"].values())
    assert peaks["peak/step"]["step"] == 1.0
    assert run["monitor_defaults"]["attribution"] == "on_divergence"
    assert run["monitor_defaults"]["reference_regions"] == "auto"
    assert run["monitor_defaults"]["sentinel"] == "light"
    assert list(run["runs"]) == ["without monitor", "monitor", "monitor attribution='always'"]
    for runs in run["runs"].values():
        assert _sane_summary(runs["median"]) and _sane_summary(runs["wall"])
    # No check diverges: the default monitor runs the live-step check, 'always' the two-pass check with attribution.
    check_cost = {"monitor": "check/step", "monitor attribution='always'": "two-pass attribution/step"}
    assert list(run["ratios"]) == list(check_cost)
    for name, ratio in run["ratios"].items():
        assert all(_sane_summary(ratio[kind]) for kind in ("median", "wall", "in_run"))
        assert ratio["expected"] == pytest.approx(1 / (1 + cost[check_cost[name]]["median"] / 2))
    assert run["ratios"]["monitor"]["monitor_kwargs"] == {"every_n_steps": 2}
    assert run["ratios"]["monitor attribution='always'"]["monitor_kwargs"] == {
        "every_n_steps": 2,
        "attribution": "always",
    }
    assert (run["every_n_steps"], run["warmup_steps"], run["measured_steps"]) == (2, 2, 4)
    assert run["checks_per_run"] == 3  # steps 0, 2 and 4
    assert run["max_grad_divergence"] == 0.0


def test_the_sentinel_is_measured_in_whole_fits_with_its_breakdown(tiny: tuple[dict[str, Any], str]) -> None:
    result, printed = tiny
    found = result["sentinel"]
    # Two widths (the model's and the wide one), each with and without dropout.
    assert list(found["configs"]) == [
        "width 16, dropout 0.1",
        "width 16, no dropout",
        "width 32, dropout 0.1",
        "width 32, no dropout",
    ]
    for config in found["configs"].values():
        assert list(config["fit_s"]) == ["off", "off again", *TIERS]
        assert all(_sane_summary(stats) and stats["n"] == 1 for stats in config["fit_s"].values())
        assert list(config["ratios"]) == ["off again/off", *(f"{tier}/off" for tier in TIERS)]
        assert all(math.isfinite(stats["median"]) for stats in config["ratios"].values())
        assert config["mismatches"] == 0
    assert set(found["peak/step"]) == {"light, its first step", *TIERS}
    assert all(value > 0 for value in found["peak/step"].values())
    breakdown = found["breakdown"]
    assert all(
        _sane_summary(breakdown[name])
        for name in ("step", *TIERS, "light hooks only", "light, step unwatched", "step again")
    )
    assert math.isfinite(breakdown["step again/step"]["median"])
    digests = breakdown["digests_per_step"]
    assert 0 < digests["light"] < digests["sampled"] == digests["exact"]
    assert found["threads"] == 2
    assert "4. Sentinel" in printed


def test_the_sentinel_under_ddp_is_measured_on_two_processes(tiny: tuple[dict[str, Any], str]) -> None:
    result, printed = tiny
    ddp = result["sentinel_ddp"]
    assert ddp["world_size"] == 2
    names = [*TIERS, "light, read every step"]
    assert all(_sane_summary(ddp[name]) and ddp[name]["n"] == 3 for name in ["off", *names])
    assert list(ddp["ratios"]) == [f"{name}/off" for name in names]
    assert "4b. Sentinel under DDP" in printed


def test_the_ddp_check_cost_is_measured_on_two_processes(tiny: tuple[dict[str, Any], str]) -> None:
    result, printed = tiny
    ddp = result["check_cost_ddp"]
    assert ddp["world_size"] == 2
    for name in ("step", "checked step", "checked step, reference without all-reduce", "state capture"):
        assert _sane_summary(ddp[name]) and ddp[name]["n"] == 3, name
    assert all(math.isfinite(ddp[key]["median"]) for key in ("check/step", "check without all-reduce/step"))
    assert _sane_summary(ddp["capture/step"])
    assert ddp["max_grad_divergence"] == 0.0
    assert "DDP check cost, in steps" in printed


def test_checked_step_peak_memory_grows_with_the_plain_regions() -> None:
    size = ModelSize(layers=4, dim=32, heads=2, seq_len=16, batch_size=4, vocab_size=32)
    peaks = monitor.run_check_memory(size, torch.device("cpu"))["peak_bytes"]
    # The reference pass keeps the activations of the regions it runs plainly: all of them, or one of four.
    assert peaks["checked step"] > peaks["checked step, reference_regions=1"] > peaks["step"]


def test_goals_and_table(tiny: tuple[dict[str, Any], str]) -> None:
    result, printed = tiny
    assert [goal["goal"] for goal in result["goals"]] == [
        "<= 1.03",
        "<= 1.03",
        "<= 0.75",
        "<= 0.8",
        "<= 1.02",
        "<= 1.02",
        "<= 1.02",
        "<= 1.02",
        "<= 1.01",
        *["<= 0.7", "<= 1.0", "<= 1.0"] * 2,
        ">= 0.985",
    ]
    assert result["goals"][3]["name"] == "check cost under DDP in steps"
    assert result["goals"][-1]["name"] == "throughput monitor/without"
    always = result["lightning"]["ratios"]["monitor attribution='always'"]["in_run"]["median"]
    assert f"throughput monitor attribution='always'/without: {always:.3f} (no goal)" in printed
    # A timing figure may take any sign on a loaded machine (a check cost is a difference of times): only its shape
    # is asserted here, never its value.
    assert all(isinstance(goal["met"], bool) and math.isfinite(goal["value"]) for goal in result["goals"])
    for heading in ("1. Step time", "2. Activation memory", "3. Recomputation check", "Goals:", "Notes:"):
        assert heading in printed
    assert result["machine"]["cpu"] in printed
    assert "JSON written to" in printed


def test_the_memory_budget_plans_both_granularities_within_the_budget_and_the_model_keeps_what_they_plan(
    tiny: tuple[dict[str, Any], str],
) -> None:
    result, printed = tiny
    found = result["memory_budget"]
    assert list(found) == ["GPT", "conv net (4 channels, 4x4)"]
    names = [f"{granularity} {share:.0%}" for granularity in budget.GRANULARITIES for share in budget.SHARES]
    for architecture in found.values():
        plans = architecture["plans"]
        assert list(plans) == names
        assert 0 < architecture["plain_bytes"] <= architecture["candidates_plain_bytes"]
        for plan in plans.values():
            assert plan["budget_bytes"] == math.floor(plan["share"] * architecture["candidates_plain_bytes"])
            assert 0 < plan["planned_bytes"] <= plan["budget_bytes"]
            # Measured independently of the plan: what it planned, less the kept block outputs that the next block
            # (or the final norm) keeps anyway and the plan counts twice. (With two blocks, no two plain blocks are
            # adjacent here, whose shared storage the meter also counts twice: docs/memory-budget.md.)
            assert plan["measured_bytes"] == plan["planned_bytes"] - plan["kept_output_bytes"]
            assert 0.0 <= plan["recompute_share"] <= 1.0
        for share in budget.SHARES:
            module, op = plans[f"module {share:.0%}"], plans[f"op {share:.0%}"]
            assert module["kept_ops"] == [] and module["kept_output_bytes"] == 0
            # "Checkpointed keeping nothing" is among the op plan's choices: it never recomputes more.
            assert op["recompute_share"] <= module["recompute_share"]
        for granularity in budget.GRANULARITIES:
            shares = [plans[f"{granularity} {share:.0%}"]["recompute_share"] for share in budget.SHARES]
            assert shares == sorted(shares, reverse=True)
        block = architecture["block"]
        assert block["arithmetic"]["calls"] > 0 and block["memory"]["calls"] > 0
        assert block["arithmetic"]["calls"] + block["memory"]["calls"] <= block["block"]["calls"]
        variants = [*names, budget.EVERY_BLOCK, budget.PLAIN, "planning, module", "planning, op"]
        assert list(architecture["variants"]) == variants
        assert all(_sane_summary(stats) and stats["n"] == 3 for stats in architecture["variants"].values())
        assert all(_sane_summary(stats) for stats in architecture["ratios"].values())
        assert {"op/module 50%", "planning, op/step", f"op 50%/{budget.EVERY_BLOCK}"} <= set(architecture["ratios"])
    assert [goal["name"] for goal in result["goals"] if goal["name"].startswith("budget ")] == [
        f"budget 50% {what}, {name}"
        for name in found
        for what in ("op/module recompute cost", "op/module step time", "op planning cost in steps")
    ]
    assert "5. Memory budget over the blocks, module against op granularity" in printed


def test_analytical_figures_reproduce_the_paper() -> None:
    size = ModelSize(layers=1, dim=64, heads=4, seq_len=32, batch_size=2, vocab_size=8)
    s, b, h, a = 32, 2, 64, 4
    assert memory.bytes_without_recomputation(size, 2, 1) == s * b * h * (34 + 5 * a * s / h)
    assert memory.bytes_with_full_recomputation(size, 2) == 2 * s * b * h
    assert memory.bytes_without_recomputation(size, 4, 4) == 4 * s * b * h * 18 + 4 * 3 * a * s * s * b
    assert memory.layout_extra_bytes(size) == 16 * s * b + s * s


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dim", "10", "--heads", "3"], "`--dim` must be divisible by `--heads`"),
        (["--layers", "1"], "`--layers` must be at least 2, got 1"),
        (["--device", "tpu"], "`--device` must be 'cpu' or 'cuda'"),
    ],
)
def test_invalid_arguments_are_rejected(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no CUDA GPU is present")
def test_cuda_without_gpu_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        main(["--device", "cuda"])
    assert "`--device cuda` needs a CUDA GPU" in capsys.readouterr().err


def test_script_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "--size {default,tiny}" in done.stdout
    assert "--json PATH" in done.stdout


def test_compiled_step_time_runs_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "compiled.json"
    assert compiled.main(["--size", "tiny", "--backend", "aot_eager", "--rounds", "2", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(path.read_text())
    assert result["backend"] == "aot_eager"
    assert list(result["variants"]) == [variant.name for variant in compiled.VARIANTS]
    assert all(_sane_summary(stats) for stats in [*result["variants"].values(), *result["ratios"].values()])
    assert result["goal"]["value"] == result["ratios"]["compiled, package/compiled, hand-written"]["median"]
    assert f"Goal: package/hand-written {result['goal']['value']:.3f} (<= 1.03)" in printed


def test_the_moe_benchmark_holds_the_routing_outputs_more_with_the_guard_and_no_more() -> None:
    result = moe.run(moe.SIZES["tiny"])
    held = result["held_bytes"]
    assert held[moe.NONE] > held[moe.KEPT] > held[moe.RECOMPUTED]
    assert held[moe.KEPT] - held[moe.RECOMPUTED] == result["routing_bytes"]
    assert all(_sane_summary(stats) for stats in result["variants"].values())


def test_one_saved_tensor_is_timed_on_every_path_and_each_tier_reads_what_it_promises() -> None:
    found = saved_tensors.per_tensor(rounds=1, short=4, long=12)
    assert list(found) == list(saved_tensors.PATHS)
    assert all(math.isfinite(row[key]) for row in found.values() for key in ("us", "over none", "once"))
    assert found["torch none"]["over none"] == 0.0
    assert found["torch default"]["once"] == 0.0
    # Per step of the longer region: the light tier three of its 12 tensors at most, the others every one.
    assert 0 < found["light, not digested"]["compared"] <= 3
    assert found["sampled"]["compared"] == found["exact"]["compared"] == 12
    assert "| light, not digested |" in saved_tensors.table(found)


def test_the_extractor_alone_is_timed_at_the_pack_and_the_comparison_of_each_path() -> None:
    found = saved_tensors.extractor_ns(rounds=1, repeats=10)
    assert list(found) == [
        "torch default",
        "package, sentinel off",
        "package extractor, nothing observes",
        "light, not digested",
    ]
    assert all(set(row) == {"pack", "comparison"} for row in found.values())
    assert all(math.isfinite(value) and value > 0 for row in found.values() for value in row.values())
    assert "| light, not digested |" in saved_tensors.extractor_table(found)


def test_the_wrapper_overhead_variants_compute_what_their_hand_written_twins_compute() -> None:
    made = wrapper_overhead.variants()
    for name, (call, module) in made.items():
        hand_call, hand_module = made[name.split(" ")[0] + " hand"]
        x = torch.randn((1, 4, 16) if name.startswith("block") else (4, 16), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(1)
        out = call(x.requires_grad_())
        torch.manual_seed(1)
        hand_x = x.detach().requires_grad_()
        hand_out = hand_call(hand_x)
        hand_out.sum().backward()
        out.sum().backward()
        assert torch.equal(out, hand_out), name
        assert torch.equal(x.grad, hand_x.grad), name
        assert all(
            torch.equal(p.grad, q.grad) for p, q in zip(module.parameters(), hand_module.parameters(), strict=True)
        ), name
        for parameter in (*module.parameters(), *hand_module.parameters()):
            parameter.grad = None
    times = wrapper_overhead.measure(rounds=2, warmup=1)
    assert set(times) == set(made)
    assert all(len(samples) == 2 and min(samples) > 0 for parts in times.values() for samples in parts.values())


@pytest.mark.parametrize("tier", ["light", "exact"])
def test_the_sentinels_host_time_is_clocked_at_each_place_its_code_runs_and_the_hooks_put_back(tier: str) -> None:
    hooks = (RegionCall.save, KeptTensor.__ne__)
    size = ModelSize(layers=2, dim=16, heads=2, seq_len=8, batch_size=2, vocab_size=32)
    found = sentinel_host.host_time(size, torch.device("cpu"), tier, steps=2, warmup=1)  # type: ignore[arg-type]
    assert set(found) == {*sentinel_host.POINTS, "total", "step ms"}
    # Every place is reached in a step: each region call's contexts, its packs and comparisons, the step's own work.
    assert all(_finite_positive(found[point]) for point in sentinel_host.POINTS)
    assert found["total"] == pytest.approx(sum(found[point] for point in sentinel_host.POINTS))
    assert _finite_positive(found["step ms"])
    assert (RegionCall.save, KeptTensor.__ne__) == hooks
    assert "| 16 |" in sentinel_host.table({16: found}, tier)


@pytest.mark.parametrize(
    ("tier", "compared", "downstream", "by_sums"),
    # The light tier's rule over the block's layout: each block's last saved tensor (dropout's noise), the computed one
    # before it and one in turn, which never fell on those two here. Sampled and exact: every activation of each block
    # (20 a call). Downstream of the first MLP weight, block 0 saves two activations: GELU's input and output. Last,
    # every read weighed from its row and column sums, as the exact tier weighs reads too large for one pass.
    [("light", 6.0, 1, False), ("sampled", 40.0, 2, False), ("exact", 40.0, 2, False), ("exact", 40.0, 2, True)],
)
def test_the_digest_floor_compares_what_its_tier_compares_and_sees_a_recomputation_that_differs(
    tier: DigestTier, compared: float, downstream: int, by_sums: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if by_sums:
        monkeypatch.setattr(digest, "ONE_PASS_WORDS", 0)
    size = ModelSize(layers=2, dim=32, heads=2, seq_len=16, batch_size=2, vocab_size=32)
    cpu = torch.device("cpu")
    found = digest_floor.measure(size, cpu, rounds=4, warmup=1, tier=tier)
    # As many saved tensors a step as the sentinel of the same tier, nothing differing on this model.
    assert found["floor compared"] == found["sentinel compared"] == compared
    assert found["floor mismatches"] == 0
    assert all(_finite_positive(found[f"{a}/{b}"]) for a, b in digest_floor.RATIOS)
    # It compares values: a weight written between the forward and the recomputation changes what block 0 recomputes
    # after it, and the floor's digests differ there (torch's own check compares shapes only): at the saved tensors
    # downstream of that weight that the tier digests (the light tier's noise and rotating target, layer norm's mean,
    # are not; block 1 is recomputed from its saved input).
    model = digest_floor.floor_model(size, cpu, tier)
    model.floor.next_step()
    loss = lm_loss(model, *make_batch(size, cpu))
    with torch.no_grad():
        model.blocks[0].mlp[0].weight.add_(1.0)
    loss.backward()
    assert model.floor.end_step() == downstream
    model.floor.next_step()
    lm_loss(model, *make_batch(size, cpu)).backward()
    assert model.floor.end_step() == 0


def test_the_digest_floor_learns_the_layout_the_light_tier_learns_under_autocast() -> None:
    # Under autocast each linear layer saves its weight's bf16 cast, computed from parameters alone: the light tier
    # never makes it a fixed target, and the floor, timed as that tier's cost, must not either.
    size = ModelSize(layers=2, dim=32, heads=2, seq_len=16, batch_size=2, vocab_size=32)
    cpu = torch.device("cpu")
    batch = make_batch(size, cpu)
    floor = digest_floor.floor_model(size, cpu, "light")
    floor.floor.layout = None
    floor.floor.watch(floor)
    package = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(floor, *batch).backward()
        with recomputation_sentinel(package, mode="light") as sentinel:
            lm_loss(package, *batch).backward()
    floor.floor.end_step()
    learned = sentinel._layouts["blocks.0"]
    assert floor.floor.layout is not None and learned.weights  # the casts are there to be told apart
    assert floor.floor.layout.targets(DigestMode("light")) == learned.targets(DigestMode("light"))
    assert floor.floor.layout == learned


def test_the_sentinel_benchmarks_hooks_only_variant_keeps_the_light_tiers_bookkeeping_with_constant_digests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "light hooks only" must run the light tier's whole path per saved tensor with its digests replaced, not fail in
    # it: a sentinel that cannot read a tensor leaves it out (a warning) and skips the bookkeeping it is meant to time.
    size = ModelSize(layers=2, dim=32, heads=2, seq_len=16, batch_size=2, vocab_size=32)
    cpu = torch.device("cpu")
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), cpu)
    regions = Regions(model)
    lm_loss(model, *make_batch(size, cpu)).backward()  # the regions' profiles: both sentinels learn alike after it
    real, constant = RecomputationSentinel(model, mode="light"), RecomputationSentinel(model, mode="light")

    def step(watching: RecomputationSentinel) -> None:
        with regions.observed_by(watching):
            lm_loss(model, *make_batch(size, cpu)).backward()
        watching.settle()
        watching.next_step()

    read = DigestPlans.read
    for _ in range(3):
        step(real)
        with sentinel._constant_digests(cpu):
            step(constant)
    assert DigestPlans.read is read  # put back
    assert caplog.records == []
    # Each block: its learning step's two fixed targets, then three a step (the rotating one besides).
    assert constant.report().compared == real.report().compared == 2 * (2 + 3 + 3)
    assert constant.report().not_compared == real.report().not_compared == 0
    assert constant.report().mismatches == 0


def test_interleaved_rounds_run_each_variant_once_a_round_after_every_other_and_alike_in_every_process() -> None:
    calls: list[str] = []
    functions = {name: partial(calls.append, name) for name in "abcd"}
    times = interleaved_times(functions, rounds=30, warmup=2, device=torch.device("cpu"))
    assert {name: len(found) for name, found in times.items()} == dict.fromkeys("abcd", 30)
    rounds = [calls[at : at + 4] for at in range(0, len(calls), 4)]
    assert all(sorted(order) == list("abcd") for order in rounds)
    # Every variant runs right after every other one in some round (a rotation keeps each after the same one).
    followed = {(order[at - 1], order[at]) for order in rounds for at in range(1, 4)}
    assert followed == {(a, b) for a in "abcd" for b in "abcd" if a != b}
    # Seeded: a second run (another process of a distributed benchmark) takes the same orders.
    again: list[str] = []
    interleaved_times({name: partial(again.append, name) for name in "abcd"}, 30, 2, torch.device("cpu"))
    assert again == calls


def test_the_probe_benchmark_counts_the_probes_of_varying_paths_and_times_a_probed_step() -> None:
    result = probes.run(steps=20, rounds=2, widths=(16,))
    # The LayerDrop region learns its skipping path at its first call and its layer's path at its fourth (the probe
    # after the layer's first call took the skipping path): three probes, none after.
    assert result["layer_drop_probes"] == 3
    assert all(isinstance(count, int) and 1 <= count <= 40 for count in result["expert_probes"].values())
    assert _finite_positive(result["probed_step"][16])


def test_the_budget_search_benchmark_times_a_choice_as_many_as_a_brute_force_checkpoints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = budget_search.distinct_figures(8)
    need = sum(entry.plain_bytes for entry in figures) - sum(entry.plain_bytes for entry in figures) // 2
    least = min(
        (sum(entry.cost for entry in chosen), len(chosen))
        for count in range(9)
        for chosen in itertools.combinations(figures, count)
        if sum(entry.saving for entry in chosen) >= need
    )
    seconds, checkpointed = budget_search.seconds_to_choose(lightning_ckpt_determinism, 8)
    assert seconds > 0 and checkpointed == least[1]
    assert budget_search.main(["--counts", "4,8"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["package", "candidates", "seconds", "checkpointed"]
    assert [row.split()[:2] for row in rows[1:]] == [["now", "4"], ["now", "8"]]
