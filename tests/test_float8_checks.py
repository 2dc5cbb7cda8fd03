"""What a float8 job is checked for before it starts, beyond torchao's own refusals: the shapes
``torch._scaled_mm`` takes on a GPU (a micro-batch's tokens on every layout, the tensor-parallel
shards), a ``float8.filter_fqns`` that keeps nothing, the start report's count under pipeline
parallelism, and torchao's import warnings kept out of the log (``parallelisms/float8.py``,
``parallelisms/float8_kernels.py``, ``trainer/planning/float8_plan.py``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from harness import ROOT

from parallelisms.float8 import Float8Settings, convert_to_float8
from parallelisms.float8_kernels import check_kernel_shapes
from parallelisms.parallel_dims import ParallelismError
from trainer.config import ConfigError, load_config
from trainer.entry.launch import main as launch_main
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.planning.job_plan import describe, resolve_job

pytest.importorskip("torchao.float8", reason="float8 training needs torchao (the `float8` extra)")

FLOAT8 = ["--model.converters", "float8"]
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# name: (world size, argv, the tokens a float8 weight gradient contracts on a rank, how the message names them)
TOKENS = {
    "one sequence of 40": (1, ["--training.seq_len", "40", "--training.local_batch_size", "1"], 40, "= 1)"),
    "two sequences of 40": (1, ["--training.seq_len", "40", "--training.local_batch_size", "2"], 80, ""),
    "cp=2 halves 72": (
        2,
        ["--mesh", "cp=2", "--training.seq_len", "72", "--training.local_batch_size", "1"],
        36,
        "`parallelism.context_parallel_degree` = 2",
    ),
    "pp=2 micro-batches of one 40": (
        2,
        ["--mesh", "pp=2", "--training.seq_len", "40", "--training.global_batch_size", "4"],
        40,
        "`parallelism.pipeline_parallel_microbatch_size` = 1",
    ),
    "the MoE layer's sequence shard under tp=2": (
        2,
        [
            "--config",
            "debug_moe.toml",
            "--mesh",
            "tp=2",
            "--training.seq_len",
            "48",
            "--training.local_batch_size",
            "1",
        ],
        24,
        "`parallelism.tensor_parallel_degree` = 2, the MoE layer",
    ),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", list(TOKENS))
def test_a_gpu_job_whose_float8_weight_gradients_contract_tokens_not_in_sixteens_is_refused(layout, recipe):
    """On a GPU the weight gradient of ``tensorwise`` and ``rowwise`` is a ``torch._scaled_mm``
    over the micro-batch's tokens on the rank (its sequence shard, the pipeline's micro-batch, the
    MoE layer's own shard under TP); ``rowwise_with_gw_hp`` computes it in high precision. On this
    CPU the matmuls are emulated and every shape runs."""
    world, argv, tokens, named = TOKENS[layout]
    config = load_config([*argv, *FLOAT8, "--float8.recipe_name", recipe])
    if recipe == "tensorwise" and "tp=2" in argv:  # its float8 gathers need NCCL
        with pytest.raises(ConfigError, match="gloo"):
            resolve_job(config, world)
    else:
        resolve_job(config, world)  # emulated
    if tokens % 16 == 0 or recipe == "rowwise_with_gw_hp":
        resolve_job(config, world, device="cuda")
        return
    with pytest.raises(ConfigError) as error:
        resolve_job(config, world, device="cuda")
    message = str(error.value)
    assert message.startswith(f"a micro-batch holds {tokens} tokens on a rank (`training.seq_len` = "), message
    assert named in message and f"`float8.recipe_name` = {recipe!r}" in message and "\n" not in message
    assert "'rowwise_with_gw_hp'" in message


def test_a_tensor_parallel_shard_the_kernel_cannot_take_names_the_layer_and_the_filter():
    """Each rank multiplies its shard of a split weight: wk's 32 outputs over 4 ranks are 8."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=64, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    gpu = Float8Settings(recipe="rowwise")
    check_kernel_shapes(model, gpu, 64, 2, "")
    check_kernel_shapes(model, Float8Settings(recipe="rowwise", emulate=True), 64, 4, "")
    with pytest.raises(ParallelismError, match=r"leaves each rank a 8 x 64 shard of layers.0.attention.wk's") as e:
        check_kernel_shapes(model, gpu, 64, 4, "")
    assert "['attention.wk']" in str(e.value)
    kept = Float8Settings(recipe="rowwise", filter_fqns=("attention.wk", "attention.wv"))
    check_kernel_shapes(model, kept, 64, 4, "")


@pytest.mark.parametrize("name", ["attention.wz", "output", "router.gate", "layers.99.attention.wq"])
def test_a_filter_that_keeps_nothing_in_high_precision_is_refused(name):
    with pytest.raises(ConfigError) as error:
        resolve_job(load_config([*FLOAT8, "--float8.filter_fqns", name]), 1)
    message = str(error.value)
    assert message.startswith(f"`float8.filter_fqns` names {name!r}, which neither is nor ends") and "\n" not in message
    assert "attention.wk" in message and "'layers.0.attention.wq'" in message


def test_a_filter_that_names_a_layer_keeps_it():
    for name in ("attention.wk", "wk", "layers.0.attention.wk"):
        resolve_job(load_config([*FLOAT8, "--float8.filter_fqns", name]), 1)


def test_the_count_is_the_whole_models_and_a_pipeline_stage_says_its_own(debug_model):
    """Under PP the start report said "42 of 21": the converted linears of the whole model over
    the linears of the rank's stages."""
    model = copy.deepcopy(debug_model)
    conversion = convert_to_float8(model, Float8Settings(recipe="rowwise", emulate=True))
    whole = conversion.describe()
    for name in list(model.layers)[3:]:
        del model.layers[name]
    model.output = None
    stage = conversion.describe(model)
    assert whole.startswith("42 of 43 linear layers in float8") and stage.startswith(whole)
    assert stage.endswith("; this rank's pipeline stages hold 21 of the converted")
    assert conversion.describe(copy.deepcopy(debug_model)) == whole


def test_torchaos_import_warnings_are_said_once_in_one_line():
    """Importing torchao on a CPU build of torch logs four warnings that read like failures (C++
    extensions not loaded, no Triton, a deprecation; its MoE prototype one more): none reaches the
    log; one line says what they were and that float8 training uses none of them."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from parallelisms.float8 import import_torchao\n"
        "print(import_torchao(experts=True))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr and "W1" not in done.stderr, done.stderr
    notices = done.stdout.strip()
    if notices != "()":  # a build of torch whose extensions all load says nothing at all
        assert "float8 training uses none of them" in notices and notices.count("reported") == 1, notices


def test_through_the_launcher_a_cpu_job_is_refused_and_a_gpu_plan_accepted(monkeypatch, tmp_path, capsys):
    """``--dry-run`` on this CPU machine plans a gloo job; with ``--target-gpu`` a GPU's."""
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.chdir(tmp_path)
    base = [*FLOAT8, "--float8.enable_fsdp_float8_all_gather", "--dry-run", "--job.dump_folder", str(tmp_path)]
    assert launch_main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`float8.enable_fsdp_float8_all_gather`" in err and "gloo" in err, err
    assert launch_main([*base, "--target-gpu", "h100"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    odd = [*FLOAT8, "--training.seq_len", "40", "--training.local_batch_size", "1", "--training.global_batch_size", "2"]
    assert launch_main([*odd, "--dry-run", "--job.dump_folder", str(tmp_path), "--target-gpu", "h100"]) == 2
    assert "a micro-batch holds 40 tokens" in capsys.readouterr().err


def test_the_dry_run_names_the_recipe_the_converted_layers_and_the_optimizer():
    """A job checked before renting GPUs shows how it trains: without float8 nothing is said of
    it; with it the recipe and what the run will convert (the start report's count, before any
    model is built), and the optimizer, with a filter keeping a layer in high precision."""
    plain = describe(resolve_job(load_config([]), 1), None, "")
    assert "float8" not in plain and "optimizer step, then the LR schedule: AdamW" in plain
    rowwise = [*FLOAT8, "--float8.recipe_name", "rowwise", "--float8.filter_fqns", "wk"]
    said = describe(resolve_job(load_config(rowwise), 1), None, "")
    (line,) = [line for line in said.splitlines() if line.startswith("float8: ")]
    assert line.startswith("float8: recipe rowwise, emulated") and "36 of 43 linear layers in float8" in line, line
    assert "kept in high precision: output, wk" in line and "optimizer step, then the LR schedule: AdamW" in said
