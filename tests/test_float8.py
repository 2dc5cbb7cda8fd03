"""Float8 training (``parallelisms/float8.py``): which linear layers convert, that checkpoints keep a
bf16 run's keys, what is refused before launch, and the exactness each recipe promises on the
harness's data-parallel layouts and accumulation counts (docs/float8.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import GLOBAL_BATCH, TOLERANCE, argv_for, max_relative_error, run_by_world, step_worker
from torch import nn

from parallelisms.float8 import Float8Settings, convert_to_float8, convertible
from trainer.config import ConfigError, load_config
from trainer.planning import float8_plan
from trainer.planning.job_plan import resolve_job

pytest.importorskip("torchao.float8", reason="float8 training needs torchao (the `float8` extra)")

FLOAT8 = ["--model.converters", "float8"]


def recipe(name: str) -> list[str]:
    return [*FLOAT8, "--float8.recipe_name", name]


def test_the_output_layer_the_router_odd_dimensions_and_filtered_names_stay_high_precision():
    assert convertible("layers.0.attention.wq", nn.Linear(64, 32))
    assert convertible("layers.3.feed_forward.shared_experts.w1", nn.Linear(64, 32))
    assert not convertible("layers.3.feed_forward.router.gate", nn.Linear(64, 32))
    assert not convertible("output", nn.Linear(64, 32))
    assert not convertible("layers.0.attention.wq", nn.Linear(64, 24))  # 24 is not a multiple of 16
    assert not convertible("layers.0.attention.wq", nn.Linear(40, 32))
    assert not convertible("layers.0.attention.wk", nn.Linear(64, 32), ("attention.wk",))
    assert convertible("layers.0.attention.wq", nn.Linear(64, 32), ("attention.wk",))


def test_the_debug_model_converts_its_block_linears_and_keeps_a_bf16_runs_state_dict(debug_model):
    model = copy.deepcopy(debug_model)
    conversion = convert_to_float8(model, Float8Settings(recipe="rowwise", emulate=True))
    converted = conversion.converted
    linears = [n for n, m in debug_model.named_modules() if isinstance(m, nn.Linear) and n != "output"]
    assert sorted(converted) == sorted(linears)
    assert "output" not in converted
    assert conversion.describe().startswith(f"{len(linears)} of {len(linears) + 1} linear layers in float8 (")
    assert conversion.describe().endswith("kept in high precision: output")
    # A float8 run's checkpoint is a bf16 run's: the same keys, loadable both ways.
    assert model.state_dict().keys() == debug_model.state_dict().keys()
    model.load_state_dict(debug_model.state_dict())
    copy.deepcopy(debug_model).load_state_dict(model.state_dict())
    tokens = torch.randint(0, 100, (2, 32))
    close = torch.nn.functional.cosine_similarity(model(tokens).flatten(), debug_model(tokens).flatten(), dim=0)
    assert 0.99 < close < 1.0  # float8 rounding: close to the high-precision logits, not equal


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"], "float8.recipe_name"),
        (["--float8.precompute_float8_dynamic_scale_for_fsdp"], "float8.enable_fsdp_float8_all_gather"),
        (["--float8.moe_experts"], "model.name"),
        (["--float8.moe_experts", "--model.name", "moe", "--model.flavor", "debugmoe"], "float8.moe_experts"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as error:
        resolve_job(load_config([*FLOAT8, *extra]), world_size=1)
    message = str(error.value)
    assert f"`{key}`" in message and "\n" not in message


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--float8.enable_fsdp_float8_all_gather"], "`float8.enable_fsdp_float8_all_gather`"),
        (["--mesh", "tp=2"], "`parallelism.tensor_parallel_degree`"),
    ],
)
def test_what_gloo_cannot_move_is_refused_on_a_cpu_and_planned_for_a_gpu(extra, key):
    """The float8 all-gather and tensorwise's float8 sequence-parallel gathers: a job on this CPU
    machine runs on gloo and is refused while planned (``--dry-run`` and the launcher alike), one
    planned for a GPU gathers over NCCL and plans; rowwise under TP gathers in high precision."""
    with pytest.raises(ConfigError, match="gloo") as error:
        resolve_job(load_config([*FLOAT8, *extra]), world_size=2)
    assert key in str(error.value) and "\n" not in str(error.value)
    planned = resolve_job(load_config([*FLOAT8, *extra]), world_size=2, device="cuda")
    float8_plan.check_float8_backend(planned.parallel, planned.dims, "nccl")
    with pytest.raises(ConfigError, match="gloo"):
        float8_plan.check_float8_backend(planned.parallel, planned.dims, "gloo")
    resolve_job(load_config([*recipe("rowwise"), "--mesh", "tp=2"]), world_size=2)


def test_the_experts_on_a_machine_without_the_kernel_name_the_versions():
    with pytest.raises(ConfigError) as error:
        resolve_job(
            load_config([*FLOAT8, "--float8.moe_experts", "--model.name", "moe", "--model.flavor", "debugmoe"]),
            world_size=1,
        )
    assert "torchao 0." in str(error.value) and f"torch {torch.__version__}" in str(error.value)


def test_without_torchao_the_converter_asks_for_the_extra(monkeypatch):
    monkeypatch.setattr("parallelisms.float8.torchao_version", lambda: None)
    with pytest.raises(ConfigError, match=r"\.\[float8\]"):
        resolve_job(load_config(FLOAT8), world_size=1)


def test_the_float8_keys_without_the_converter_are_refused():
    """Each ``[float8]`` key without ``model.converters = ["float8"]`` would change nothing
    (every key: ``tests/test_config_dependent.py``)."""
    with pytest.raises(ConfigError, match=r"^`float8.recipe_name` = 'rowwise' would change nothing: `model.conv"):
        load_config(["--float8.recipe_name", "rowwise"])
    assert float8_plan.float8_settings(load_config(recipe("rowwise")), "cpu") == Float8Settings(
        recipe="rowwise", emulate=True
    )


# name: (world size, local batch size, extra argv); accumulation = 8 / (local x dp), as in test_grad_accumulator
LAYOUTS = {
    "1 rank x 4 micro-batches": (1, 2, []),
    "FSDP 4 x 1": (4, 2, []),
    "HSDP (2,2) x 2": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2"]),
}
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@pytest.fixture(scope="module")
def layouts() -> dict[str, list]:
    """Each recipe's step on one process with the whole batch (the reference) and on each layout."""
    cases = {}
    for name in RECIPES:
        cases[f"{name} reference"] = (1, (step_worker, argv_for(GLOBAL_BATCH, recipe(name))))
        for layout, (world, local_batch, extra) in LAYOUTS.items():
            cases[f"{name} {layout}"] = (world, (step_worker, argv_for(local_batch, recipe(name) + extra)))
    return run_by_world(cases)


def differences(result: dict, ref: dict) -> tuple[float, float]:
    """Relative differences of the loss and of the gradients."""
    return abs(result["loss"] - ref["loss"]) / ref["loss"], max_relative_error(result["grads"], ref["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rowwise_loss_and_gradients_do_not_depend_on_the_layout(layouts, name, layout):
    ref = layouts[f"{name} reference"][0]
    result = layouts[f"{name} {layout}"][0]
    assert result["n"] == ref["n"]
    loss, grads = differences(result, ref)
    assert loss < TOLERANCE and grads < TOLERANCE, (loss, grads)


@pytest.mark.slow
def test_tensorwise_depends_on_the_micro_batch_size_not_on_the_layout(layouts):
    """The docs say so: each micro-batch's activations get the scale of their own amax. Every
    layout that splits the batch differs from the whole batch by far more than round-off, and
    two layouts of the same micro-batches (2 sequences each) agree to round-off."""
    ref = layouts["tensorwise reference"][0]
    for layout in LAYOUTS:
        loss, grads = differences(layouts[f"tensorwise {layout}"][0], ref)
        assert loss > 10 * TOLERANCE or grads > 100 * TOLERANCE, (layout, loss, grads)
    one, fsdp = layouts["tensorwise 1 rank x 4 micro-batches"][0], layouts["tensorwise FSDP 4 x 1"][0]
    loss, grads = differences(fsdp, one)
    assert loss < TOLERANCE and grads < TOLERANCE, (loss, grads)


def test_the_simulator_times_float8_matmuls_at_the_float8_peak_where_the_gpu_has_one():
    from trainer.simulation.cost_model import TracedCost
    from trainer.simulation.step_time import step_time
    from trainer.simulation.targets import GPUS

    h100, a100 = GPUS["h100"], GPUS["a100"]
    assert h100.fp8_flops == 1979e12 and GPUS["h200"].fp8_flops == 1979e12
    bf16_only, half_float8 = TracedCost(flops=2 * 10**12), TracedCost(flops=2 * 10**12, fp8_flops=10**12)
    compute = step_time(half_float8, h100, 1, "1F1B", 1, 1).compute_s
    assert compute == pytest.approx((1e12 / 989e12 + 1e12 / 1979e12) / h100.efficiency)
    assert compute < step_time(bf16_only, h100, 1, "1F1B", 1, 1).compute_s
    # Without float8 tensor cores (A100) the float8 matmuls run at the bf16 peak.
    assert (
        step_time(half_float8, a100, 1, "1F1B", 1, 1).compute_s == step_time(bf16_only, a100, 1, "1F1B", 1, 1).compute_s
    )


def test_the_memory_plan_gathers_float8_weights_in_one_byte():
    def buffers(extra: list[str]) -> int:
        argv = ["--config", "llama3_8b.toml", "--model.n_layers", "2", *FLOAT8, *extra]
        return resolve_job(load_config(argv), world_size=8, device="cuda").memory.fsdp_buffers

    bf16_gather, float8_gather = buffers([]), buffers(["--float8.enable_fsdp_float8_all_gather"])
    assert 0.6 * bf16_gather < float8_gather < 0.9 * bf16_gather
