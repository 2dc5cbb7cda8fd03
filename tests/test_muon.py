"""Muon: torch.optim.Muon's update on one process, the same update bit for bit on every mesh.

One process against ``torch.optim.Muon`` (the blocks' matrices, each routed expert's its own) plus
``torch.optim.AdamW`` (the rest). On the meshes, every rank is handed the same gradients (drawn
per parameter and step as whole tensors, then sharded as the parameter is), so the weights after
three steps must equal one process's bit for bit: only the optimizer's distribution is under
test. Two classic bugs of distributed Muon are injected and must fail: orthogonalising each
rank's shard instead of the whole matrix, and the learning-rate adjustment taken from a shard's
shape. With real gradients and ``debug.layout_invariant``, FSDP and HSDP train the same bits as
one process; a Muon run resumes on another mesh with the same losses.
"""

from __future__ import annotations

import copy
import re
import zlib
from dataclasses import replace

import pytest
import torch
from checkpoint_helpers import COMMON, assert_resumes_on_another_mesh, one_rank, tiny_manager
from harness import BASE_ARGV, full, run_by_world
from step_helpers import fetch_step, forward_backward, optimizer_step, trainer_for
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.checkpoint.expert_shards import ExpertShards
from trainer.config import Optimizer
from trainer.model.llama3 import FLAVORS, Transformer
from trainer.model.moe import FLAVORS as MOE_FLAVORS
from trainer.muon import orthogonalised, takes_muon
from trainer.optimizer import build_optimizer
from trainer.runtime.errors import CheckpointError

__all__ = ["one_rank"]  # the fixture, used by name

STEPS = 3
ARGV = [*BASE_ARGV, "--optimizer.name", "Muon", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "0"]
ARGV += ["--training.local_batch_size", "1"]
MOE = ["--config", "debug_moe.toml"]


def _clean(name: str) -> str:
    return re.sub(r"(_checkpoint_wrapped_module|_orig_mod)\.", "", name)


def given_gradients(model: torch.nn.Module, step: int) -> None:
    """Every parameter's gradient drawn whole from its name and the step, then sharded as the
    parameter is (an expert-parallel stack: its rank's experts of the whole stack)."""
    experts = ExpertShards(model)
    for name, param in model.named_parameters():
        view = experts.to_global({_clean(name): param}, lambda key: key)[_clean(name)]
        seed = zlib.crc32(f"{_clean(name)}/{step}".encode())
        whole = torch.randn(view.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2
        if not isinstance(view, DTensor):
            param.grad = whole
            continue
        local = distribute_tensor(whole, view.device_mesh, view.placements, src_data_rank=None).to_local()
        param.grad = DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {_clean(name): param for name, param in model.named_parameters()}
    return {name: full(t).detach().clone() for name, t in ExpertShards(model).to_global(state, lambda k: k).items()}


MUTATIONS = {
    # what a careless distributed Muon does -> (the function of trainer/muon.py it replaces, by what)
    "orthogonalise the shard": (
        "distributed_orthogonalised",
        lambda params, updates, settings: orthogonalised(updates, settings),
    ),
    "lr from the shard's shape": ("matrix_shape", lambda param: tuple(param.to_local().shape[-2:])),
}


def steps_worker(argv: list[str], given: bool, mutation: str | None = None) -> dict:
    """``STEPS`` steps of the trainer on this mesh; the whole weights (of this rank's stages)."""
    with pytest.MonkeyPatch.context() as patch:
        if mutation:
            patch.setattr(f"trainer.muon.{MUTATIONS[mutation][0]}", MUTATIONS[mutation][1])
        _, training = trainer_for(argv)
        losses = []
        for step in range(STEPS):
            result = forward_backward(training, fetch_step(training))
            if given:
                given_gradients(training.model, step)
            optimizer_step(training, result)
            losses.append(result.loss_avg)
    return {"losses": losses, "weights": whole_weights(training.model)}


def merged(ranks: list[dict]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for out in ranks:
        weights.update(out["weights"])
    return weights


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [name for name in want if not torch.equal(got[name], want[name])]


MESHES = {
    # name: (world, model argv, mesh). CP 2 shards the parameters as FSDP 2 does, and an MoE under
    # PP exchanges as each stage's dense part and experts do here: the suite's time keeps them out.
    "FSDP 2 x TP 2": (4, [], "dp_shard=2,tp=2"),
    "HSDP 2 x 2": (4, [], "dp_replicate=2,dp_shard=2"),
    "PP 2": (2, [], "pp=2"),
    "FSDP 2, float8 linears, full AC": (
        2,
        ["--model.converters", "float8", "--activation_checkpoint.mode", "full"],
        "dp_shard=2",
    ),
    "MoE FSDP 2 x TP 2 x EP 2": (4, MOE, "dp_shard=2,tp=2,ep=2"),
    "MoE FSDP 2 x CP 2 x EP 4": (4, MOE, "dp_shard=2,cp=2,ep=4"),
}


@pytest.fixture(scope="module")
def given_runs() -> dict[str, list[dict]]:
    cases: dict[str, tuple[int, tuple]] = {
        "one process": (1, (steps_worker, ARGV, True)),
        "one process MoE": (1, (steps_worker, MOE + ARGV, True)),
    }
    for name, (world, model, mesh) in MESHES.items():
        cases[name] = (world, (steps_worker, model + ARGV + ["--mesh", mesh], True))
    for mutation in MUTATIONS:
        cases[mutation] = (2, (steps_worker, ARGV + ["--mesh", "dp_shard=2"], True, mutation))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_takes_the_one_process_update_bit_for_bit(given_runs, mesh: str) -> None:
    reference = merged(given_runs["one process MoE" if MESHES[mesh][1][:1] == MOE[:1] else "one process"])
    assert differing(merged(given_runs[mesh]), reference) == []


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_classic_bugs_of_a_distributed_muon_are_caught(given_runs, mutation: str) -> None:
    wrong = differing(merged(given_runs[mutation]), merged(given_runs["one process"]))
    assert wrong and all(takes_muon(name) for name in wrong), wrong


@pytest.mark.slow
def test_with_layout_invariance_fsdp_and_hsdp_train_the_bits_of_one_process() -> None:
    """Real gradients, accumulated over 8, 4 and 2 micro-batches: the same bits after three steps."""
    argv = [*ARGV, "--debug.layout_invariant"]
    runs = run_by_world(
        {
            "one process": (1, (steps_worker, argv, False)),
            "FSDP 4": (4, (steps_worker, argv + ["--mesh", "dp_shard=4"], False)),
            "HSDP 2 x 2": (4, (steps_worker, argv + ["--mesh", "dp_replicate=2,dp_shard=2"], False)),
        }
    )
    reference = merged(runs["one process"])
    for name in ("FSDP 4", "HSDP 2 x 2"):
        assert runs[name][0]["losses"] == runs["one process"][0]["losses"], name
        assert differing(merged(runs[name]), reference) == [], name


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmoe"])
def test_one_process_is_torch_muon_and_adamw(flavor: str) -> None:
    """Three steps on drawn gradients against torch.optim.Muon on every block matrix (a routed
    expert's matrix as a parameter of its own) and torch.optim.AdamW on the rest."""
    flavors = MOE_FLAVORS if flavor == "debugmoe" else FLAVORS
    model = Transformer(replace(flavors[flavor], vocab_size=256))
    model.init_weights(1)
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, Optimizer(name="Muon", lr=3e-3, weight_decay=0.1), "cpu")
    matrices, experts, decay, no_decay = [], [], [], []
    for name, param in reference.named_parameters():
        if takes_muon(name) and param.ndim == 3:
            experts += [(param, e, torch.nn.Parameter(param.detach()[e].clone())) for e in range(param.shape[0])]
        elif takes_muon(name):
            matrices.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    assert matrices and (experts or flavor == "debugmodel")
    muon = torch.optim.Muon(
        matrices + [copy for _, _, copy in experts], lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        for (_, a), b in zip(model.named_parameters(), reference.parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        for stack, e, copy_ in experts:
            copy_.grad = stack.grad[e].clone()
        ours.step()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for stack, e, copy_ in experts:
                stack[e].copy_(copy_)
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (step, name)


@pytest.mark.launcher
def test_a_muon_run_resumes_on_another_mesh_with_the_same_losses(tmp_path) -> None:
    """FSDP 2 trains 4 steps, saving at 2; TP 2 resumes step-2 and logs the losses of steps 3-4."""
    job = [*COMMON, "--optimizer.name", "Muon", "--training.local_batch_size", "2", "--training.steps", "4"]
    job += ["--checkpoint.enable", "--checkpoint.interval", "2"]
    assert_resumes_on_another_mesh(tmp_path, job, [], ["--mesh", "tp=2"])


@pytest.mark.parametrize(("saved", "resumed"), [("AdamW", "Muon"), ("Muon", "AdamW")])
def test_another_optimizer_on_resume_is_one_line_naming_both(tmp_path, one_rank: None, saved: str, resumed: str):
    writer = tiny_manager(tmp_path, optimizer_name=saved, step=2)
    writer.save(2)
    with pytest.raises(CheckpointError) as refused:
        tiny_manager(tmp_path, optimizer_name=resumed).load()
    message = str(refused.value)
    assert f"holds {saved}'s optimizer state" in message and f"`optimizer.name` is {resumed}" in message
    assert "\n" not in message and "exclude_from_loading" in message
    fresh = tiny_manager(tmp_path, optimizer_name=resumed, exclude_from_loading=("optimizer",))
    assert fresh.load() == 2


def test_the_memory_plan_counts_one_buffer_per_matrix_and_the_exchange() -> None:
    """The 8B on its 8 H100s: Muon's state is AdamW's less one fp32 buffer of every block matrix,
    and its exchange is counted at the optimizer step."""
    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job

    plans = {
        name: resolve_job(load_config(["--config", "llama3_8b.toml", "--optimizer.name", name]), 8, device="cuda")
        for name in ("AdamW", "Muon")
    }
    adamw, muon = (plans[name].memory for name in ("AdamW", "Muon"))
    w = plans["Muon"].workload
    saved = 4 * w.n_layers * w.matrix_params / (w.dp_shard * w.cp * w.tp)
    assert adamw.model_state - muon.model_state == pytest.approx(saved, rel=1e-6)
    assert adamw.optimizer == 0 < muon.optimizer < muon.total
    assert "Muon's optimizer step holds" in muon.line() and "Muon" not in adamw.line()
