"""Expert-parallel checkpoints: a debug MoE run saved at dp_shard = 4 x ep = 2 resumes at
dp_shard = 2 x ep = 2 (the same EP degree, the experts sharded over other ranks), at ep = 1, at
ep = 4, at ep = 2 x cp = 2 x tp = 2 (ep from the CP ranks) and in two pipeline stages, and
continues the uninterrupted run's losses (which needs the experts' weights and optimizer state back
as saved), with the same routing biases. The resumed runs' own last checkpoints, saved on those
meshes, hold the same global experts within round-off; its TensorBoard holds the balancing scalars."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TINY, one_rank, tiny_manager
from harness import ROOT, run_train, tensorboard_scalars

from trainer.checkpoint.model_entry import read_dcp_model
from trainer.metrics.dashboard import Tag
from trainer.model.moe import MoEArgs
from trainer.runtime.errors import CheckpointError
from trainer.step.expert_balance import BALANCE_LOSS

STEPS, SAVED = 3, 2
TOLERANCE = 5e-5
WEIGHTS_TOLERANCE = 1e-6  # relative; measured at most 1.2e-7 (with TP), 9.1e-8 without
LOSS_TAGS = (Tag.LOSS_AVG, Tag.GRAD_NORM)
MOE_TAGS = (BALANCE_LOSS.tag, *(f"moe/load_max_over_mean/layer_{layer}" for layer in (1, 2, 3)))
ARGV = [
    "--config",
    str(ROOT / "train_configs" / "debug_moe.toml"),
    "--training.dataset",
    "shakespeare_dialogue",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.decay_ratio",
    "0",
    "--moe.bias_update_rate",
    "0.01",
    "--validation.enable=false",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "3",
    "--checkpoint.enable",
    "--checkpoint.interval",
    str(SAVED),
    "--comm.init_timeout_seconds",
    "60",
]


def argv(dump: Path, local_batch: int, mesh: str, *extra: str) -> list[str]:
    return [
        *ARGV,
        "--job.dump_folder",
        str(dump),
        "--training.local_batch_size",
        str(local_batch),
        "--mesh",
        mesh,
        *extra,
    ]


def resumed_from(saved: Path) -> list[str]:
    return ["--checkpoint.initial_load_path", str(saved), "--checkpoint.initial_load_model_only=false"]


SAVER = "shard4_ep2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``shard4_ep2`` saves at step 2 and runs on to step 3; the others resume its step 2
    (``pp2_ep2``: the MoE layers in two pipeline stages, the experts over ep = 2 in each)."""
    root = tmp_path_factory.mktemp("moe_checkpoint")
    saved = root / SAVER / "checkpoint" / f"step-{SAVED}"
    for world, name, local_batch, mesh, extra in (
        (4, SAVER, 2, "dp_shard=4,ep=2", []),
        (2, "ep2", 4, "dp_shard=2,ep=2", resumed_from(saved)),
        (2, "ep1", 4, "dp_shard=2", resumed_from(saved)),
        (4, "ep4", 2, "dp_shard=4,ep=4", resumed_from(saved)),
        (4, "ep2_cp2_tp2", 2, "cp=2,tp=2,ep=2", resumed_from(saved)),
        (4, "pp2_ep2", 1, "pp=2,dp_shard=2,ep=2", resumed_from(saved)),
    ):
        proc = run_train(world, argv(root / name, local_batch, mesh, *extra))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.launcher
@pytest.mark.parametrize("resumed", ["ep2", "ep1", "ep4", "ep2_cp2_tp2", "pp2_ep2"])
def test_a_run_saved_on_one_ep_mesh_continues_the_same_curve_on_another(runs, resumed):
    """The losses, and the balancing loss and expert loads of the whole model (under PP gathered
    over the stages), continue the straight run's."""
    straight = tensorboard_scalars(runs / SAVER, LOSS_TAGS + MOE_TAGS)
    continued = tensorboard_scalars(runs / resumed, LOSS_TAGS + MOE_TAGS)
    for tag in LOSS_TAGS + MOE_TAGS:
        assert sorted(continued[tag]) == list(range(SAVED + 1, STEPS + 1)), tag
        for step, value in continued[tag].items():
            assert abs(value - straight[tag][step]) <= TOLERANCE * max(1.0, abs(value)), (tag, step)
    # The last checkpoints, each saved on its own EP degree: the routing biases equal exactly
    # (they move in steps of +-rate, so a bias loaded wrong would stay wrong), every weight within
    # round-off of the straight run's.
    final = read_dcp_model(runs / resumed / "checkpoint" / f"step-{STEPS}")
    expected = read_dcp_model(runs / SAVER / "checkpoint" / f"step-{STEPS}")
    biases = [name for name in expected if name.endswith("expert_bias")]
    assert len(biases) == 3 and all(expected[name].abs().sum() > 0 for name in biases)
    for name in biases:
        assert torch.equal(final[name], expected[name]), name
    experts = [name for name in expected if ".experts." in name]
    assert len(experts) == 9 and all(expected[name].shape[0] == 8 for name in experts)
    # Every weight, not only the experts: one replicated over TP but fed other heads or tokens on
    # each TP rank (the QK-norms, the router) drifts by the learning rate if its gradient is not
    # summed over TP.
    for name, weight in expected.items():
        if weight.is_floating_point():
            assert (final[name] - weight).norm() <= WEIGHTS_TOLERANCE * weight.norm(), name


@pytest.mark.launcher
def test_a_moe_runs_tensorboard_holds_the_balancing_scalars(runs):
    scalars = tensorboard_scalars(runs / SAVER, MOE_TAGS)
    for tag in MOE_TAGS:
        assert sorted(scalars[tag]) == list(range(1, STEPS + 1)), tag
    assert all(value > 0 for value in scalars[BALANCE_LOSS.tag].values())
    assert all(value >= 1 for tag in MOE_TAGS[1:] for value in scalars[tag].values())


__all__ = ["one_rank"]  # the fixture, used by name

TINY_MOE = MoEArgs(**{**vars(TINY), "n_experts": 4, "top_k": 2, "moe_hidden_dim": 16})


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"n_experts": 8}, "n_experts: 4 there, 8 here"),
        ({"top_k": 1}, "top_k: 2 there, 1 here"),
        ({"moe_hidden_dim": 32}, "moe_hidden_dim: 16 there, 32 here"),
    ],
)
def test_resuming_with_other_experts_is_one_line(tmp_path: Path, one_rank: None, changed: dict, message: str):
    """Other experts than the checkpoint's: a one-line ``CheckpointError`` naming the setting and
    both values, not DCP's shape error (``top_k`` changes no shape: DCP would load it silently)."""
    saving = tiny_manager(tmp_path, TINY_MOE, step=2)
    saving.model.init_weights(0)
    saving.save(2)
    with pytest.raises(CheckpointError, match=f"holds another model .*{message}") as caught:
        tiny_manager(tmp_path, replace(TINY_MOE, **changed)).load()
    assert "\n" not in str(caught.value)
    with pytest.raises(CheckpointError, match="model.name: moe there, llama3 here"):
        tiny_manager(tmp_path, TINY).load()
