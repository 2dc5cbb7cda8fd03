"""Checkpoints: exact resume on another mesh and after SIGTERM, crash safety, corrupt checkpoints
skipped, non-finite states never published, async saves, seed checkpoints, model-only exports."""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from checkpoint_helpers import (
    COMMON,
    TINY,
    one_rank,
    overwrite,
    resume_worker,
    small_argv,
    tiny_manager,
    train_worker,
)
from harness import Launched, run_ranks, run_train, tensorboard_scalars, train_as_a_worker
from torch.distributed.checkpoint import FileSystemReader

from trainer.checkpoint.folders import checkpoint_problem, step_folders
from trainer.checkpoint.model_entry import read_dcp_model
from trainer.config import load_config
from trainer.model.llama3 import Transformer
from trainer.model.moe import MoEArgs
from trainer.planning.job_plan import resolve_job
from trainer.runtime.errors import CheckpointError, UserError

__all__ = ["one_rank"]  # the fixture, used by name


def newest_scalars(dump: Path, first_step: int) -> dict[str, list[float]]:
    out = {}  # steps first_step..8 of the job's TensorBoard run, which a resumed job continues
    for tag, values in tensorboard_scalars(dump, ("loss_metrics/global_avg_loss", "grad_norm")).items():
        assert list(values) == list(range(1, 9))
        out[tag] = [values[step] for step in range(first_step, 9)]
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, list[float]]:
    """Steps 1-8 of a run that was never interrupted."""
    dump = tmp_path_factory.mktemp("straight")
    proc = run_train(
        4, COMMON + ["--training.local_batch_size", "2", "--training.steps", "8", "--job.dump_folder", str(dump)]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return newest_scalars(dump, 1)


@pytest.mark.launcher
def test_sigterm_saves_and_the_resume_continues_the_same_curve(straight, tmp_path):
    """What SLURM or Kubernetes do before killing a job: the step finishes, a checkpoint is
    saved, the exit is clean, and the next run, on another mesh (FSDP 4 -> dp_shard 2 x tp 2),
    logs the losses of a run never interrupted."""
    args = COMMON + [
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
        "--training.steps",
        "8",
        "--job.dump_folder",
        str(tmp_path),
    ]
    job = Launched(4, args, tmp_path / "first.log")
    job.wait_for("step: 2/8")
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    out = job.output()
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "stopped by SIGTERM" in out and "rerun the same command to resume" in out
    saved = [step for step, _ in step_folders(tmp_path / "checkpoint")]
    assert len(saved) == 1 and 2 <= saved[0] < 8, saved
    proc = run_train(4, args + ["--mesh", "dp_shard=2,tp=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = newest_scalars(tmp_path, saved[0] + 1)
    for tag, expected in straight.items():
        assert resumed[tag] == pytest.approx(expected[saved[0] :], rel=1e-5), tag


@pytest.mark.slow
def test_a_kill_during_save_and_corrupt_checkpoints_leave_the_last_intact_one_loadable(tmp_path):
    """A rank killed while it writes step 6: the save is never published and the resume removes
    what it left, with a warning, and starts from step 5 with the data loader's position (or
    from the start of the data, the loader excluded). Then each newer checkpoint is damaged
    differently; the load falls back to the one intact."""
    argv = small_argv(tmp_path, "--checkpoint.interval", "1")
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(train_worker, 2, argv, 1, 6)
    folder = tmp_path / "checkpoint"
    assert [step for step, _ in step_folders(folder)] == [1, 2, 3, 4, 5]
    assert not (folder / "step-6").exists() and (folder / "step-6.partial").exists()
    resumed = run_ranks(resume_worker, 2, argv)[0]
    assert resumed["start"] == 5
    assert resumed["loader"]["step"] == 5
    assert not (folder / "step-6.partial").exists() and "step-6.partial" in "\n".join(resumed["warnings"])
    excluded = run_ranks(resume_worker, 2, argv + ["--checkpoint.exclude_from_loading", "dataloader"])[0]
    assert excluded["start"] == 5
    assert excluded["loader"]["step"] == 0  # not restored: the data position starts over

    largest = {step: max((folder / f"step-{step}").glob("*.distcp"), key=lambda f: f.stat().st_size) for step in (4, 5)}
    overwrite(largest[5], largest[5].stat().st_size // 2, 8)  # 8 bytes in the middle of a tensor
    overwrite(largest[4], largest[4].stat().st_size // 3, 64 * 1024)
    data = sorted((folder / "step-3").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert "truncated" in checkpoint_problem(folder / "step-3")
    (folder / "step-2" / ".metadata").write_bytes(b"not a checkpoint")
    assert "metadata" in checkpoint_problem(folder / "step-2")
    resumed = run_ranks(resume_worker, 2, argv)[0]
    assert resumed["start"] == 1
    warned = "\n".join(resumed["warnings"])
    for step, problem in (
        (5, f"{largest[5].name} does not match its checksum"),
        (4, f"{largest[4].name} does not match its checksum"),
        (3, "truncated"),
        (2, "metadata"),
    ):
        assert f"step-{step}:" in warned and problem in warned, (step, warned)


@pytest.mark.slow
def test_a_non_finite_state_is_never_published(tmp_path):
    """A NaN that reaches one rank's shard of the weights: every rank refuses the save, nothing is
    written, and the older checkpoints stay."""
    argv = small_argv(tmp_path, "--checkpoint.interval", "1")
    with pytest.raises(
        Exception,
        match="not saving checkpoint step-3: the weight layers.1.feed_forward.w2.weight is not finite on rank 1",
    ):
        run_ranks(poisoned_worker, 2, argv, 3)
    folder = tmp_path / "checkpoint"
    assert [step for step, _ in step_folders(folder)] == [1, 2]
    assert not (folder / "step-3.partial").exists()
    for step in (1, 2):
        weights = read_dcp_model(str(folder / f"step-{step}"))
        assert all(torch.isfinite(w).all() for w in weights.values())


def poisoned_worker(argv: list[str], poison_step: int) -> None:
    """Train; after optimizer step ``poison_step``, a NaN appears in one weight on rank 1 only."""
    import trainer.train
    from trainer.step.optimizer_step import OptimizerStep

    build, calls = trainer.train.build_training, []

    def poisoned(*args, **kwargs):
        training = build(*args, **kwargs)
        (optimizer_step,) = [p for p in training.step.parts.parts if isinstance(p, OptimizerStep)]
        finish = optimizer_step.finish

        def poisoning_finish(result):
            finish(result)
            calls.append(1)
            if len(calls) == poison_step and int(os.environ["RANK"]) == 1:
                weight = dict(training.model.named_parameters())["layers.1.feed_forward.w2.weight"]
                with torch.no_grad():
                    weight.to_local().view(-1)[0] = float("nan")

        optimizer_step.finish = poisoning_finish
        return training

    trainer.train.build_training = poisoned
    train_as_a_worker(argv)


@pytest.mark.slow
def test_async_save_writes_the_state_at_save_time(tmp_path):
    sync_dump, async_dump = tmp_path / "sync", tmp_path / "async"
    run_ranks(train_worker, 2, small_argv(sync_dump))
    run_ranks(train_worker, 2, small_argv(async_dump, "--checkpoint.async_mode", "async"))
    for step in (2, 4, 6):
        expected = read_dcp_model(str(sync_dump / "checkpoint" / f"step-{step}"))
        got = read_dcp_model(str(async_dump / "checkpoint" / f"step-{step}"))
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), (step, name)
    assert run_ranks(resume_worker, 2, small_argv(async_dump, "--training.steps", "8"))[0]["start"] == 6


@pytest.mark.slow
def test_keep_latest_k_and_model_only_export(tmp_path):
    argv = small_argv(
        tmp_path,
        "--checkpoint.keep_latest_k",
        "2",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    run_ranks(train_worker, 2, argv)
    folder = tmp_path / "checkpoint"
    assert [step for step, _ in step_folders(folder)] == [4, 6]
    metadata = FileSystemReader(str(folder / "step-6")).read_metadata().state_dict_metadata
    assert all(key.startswith("model.") for key in metadata)
    assert all(meta.properties.dtype == torch.bfloat16 for meta in metadata.values())


@pytest.mark.slow
def test_seed_checkpoint_gives_every_mesh_the_same_start(tmp_path):
    seed_argv = small_argv(tmp_path, "--checkpoint.create_seed_checkpoint", "--debug.seed", "11")
    run_ranks(train_worker, 1, seed_argv)
    seed = read_dcp_model(str(tmp_path / "checkpoint" / "step-0"))
    p = resolve_job(load_config(small_argv(tmp_path, "--debug.seed", "11")), 1)
    reference = Transformer(p.model_args)
    reference.init_weights(11)
    for name, param in reference.named_parameters():
        assert torch.equal(seed[name], param.detach()), name
    resumed = run_ranks(resume_worker, 2, small_argv(tmp_path, "--debug.seed", "12"))[0]  # another seed: no own init
    assert resumed["start"] == 0
    for name, weight in resumed["weights"].items():
        assert torch.equal(weight, seed[name]), name


@pytest.mark.slow
def test_load_step_that_does_not_exist_fails_on_every_rank(tmp_path):
    argv = small_argv(tmp_path, "--checkpoint.load_step", "3")
    with pytest.raises(Exception) as error:
        run_ranks(resume_worker, 2, argv)
    assert "checkpoint.load_step" in str(error.value)


@pytest.mark.slow
def test_initial_load_from_hugging_face_folder(tmp_path):
    from trainer.checkpoint.hf_folders import save_hf_folder

    p = resolve_job(load_config(small_argv(tmp_path)), 1)
    source = Transformer(p.model_args)
    source.init_weights(99)
    weights = {name: param.detach().clone() for name, param in source.named_parameters()}
    save_hf_folder(str(tmp_path / "hf"), weights, p.model_args, torch.float32)
    argv = small_argv(
        tmp_path, "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"
    )
    resumed = run_ranks(resume_worker, 2, argv)[0]
    assert resumed["start"] == 0
    for name, weight in resumed["weights"].items():
        assert torch.equal(weight, weights[name]), name
    config_file = tmp_path / "hf" / "config.json"
    config_file.write_text(config_file.read_text().replace('"rope_theta": 500000.0', '"rope_theta": 10000.0'))
    with pytest.raises(Exception, match="different model.*rope_theta"):
        run_ranks(resume_worker, 1, argv)


def test_seed_checkpoint_on_several_processes_is_refused_before_any_process_group(tmp_path):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="create_seed_checkpoint.*NGPU=1"):
        resolve_job(load_config(small_argv(tmp_path, "--checkpoint.create_seed_checkpoint")), 2)


def test_a_checkpoint_that_cannot_serve_the_run_is_a_checkpoint_error(tmp_path: Path, one_rank: None):
    """Every way a checkpoint or ``initial_load_path`` can fail this run raises ``CheckpointError``
    (a ``JobError``: one line, exit 1), not DCP's multi-rank traceback or a bare ``ValueError``;
    and nothing in the folder is deleted."""
    run = tmp_path / "run"
    tiny_manager(run, step=2).save(2)
    folder = run / "checkpoint"
    shutil.copytree(folder / "step-2", folder / "step-3")
    (folder / "step-3" / ".metadata").write_bytes(b"damaged")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"args": replace(TINY, n_layers=3)}, r"checkpoint .*step-2 holds another model .*n_layers: 2 there, 3 here"),
        ({"args": replace(TINY, dim=64, n_heads=8)}, r"another model .*dim: 32 there, 64 here; n_heads: 4 there"),
        ({"data": "b"}, r"step-2 was trained on other data .*checkpoint.allow_data_change"),
        ({"load_step": 5}, r"`checkpoint.load_step` = 5: no folder step-5 .*found \['step-2', 'step-3'\]"),
        ({"load_step": 3}, r"`checkpoint.load_step`: .*step-3 cannot be loaded: its metadata \(\.metadata\) cannot"),
        (
            {"enable": False, "initial_load_path": str(folder / "step-2"), "args": replace(TINY, vocab_size=128)},
            r"`checkpoint.initial_load_path`: .*step-2 holds another model .*vocab_size: 64 there, 128 here",
        ),
        (
            {"enable": False, "initial_load_path": str(tmp_path / "absent")},
            r"`checkpoint.initial_load_path`: .*absent cannot be loaded",
        ),
        (
            {"enable": False, "initial_load_path": str(tmp_path / "hf"), "initial_load_in_hf": True},
            r"`checkpoint.initial_load_path`: .*config.json is not valid JSON",
        ),
        (
            {"enable": False, "initial_load_path": str(run), "initial_load_in_hf": True},
            r"`checkpoint.initial_load_path`: .*run has no config.json",
        ),
    ]
    for settings, message in cases:
        with pytest.raises(CheckpointError, match=message):
            tiny_manager(run, **settings).load()
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]
    assert tiny_manager(run).load() == 2  # the run that fits resumes, skipping the damaged step-3


def test_a_bug_while_loading_is_not_taken_for_a_user_error(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
):
    """A ``ValueError`` from inside torch keeps its type and traceback: it is not a checkpoint
    that does not fit, and an entry point must not print it as one."""
    tiny_manager(tmp_path).save(2)

    def broken_load(*args: Any, **kwargs: Any) -> None:
        raise ValueError("a bug deep inside torch")

    monkeypatch.setattr(dcp, "load", broken_load)
    with pytest.raises(ValueError, match="a bug deep inside torch") as error:
        tiny_manager(tmp_path).load()
    assert not isinstance(error.value, UserError)


TINY_MOE = MoEArgs(**{f.name: getattr(TINY, f.name) for f in fields(TINY)}, n_experts=4, top_k=2, moe_hidden_dim=16)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_buffer_is_never_published(tmp_path: Path, one_rank: None, bad: float):
    """The buffers a checkpoint holds beside the weights (an MoE layer's routing bias) are
    checked as the weights are: a NaN or an infinity there writes nothing and names the buffer
    and the key that moves it. A finite one saves."""
    manager = tiny_manager(tmp_path, TINY_MOE, step=1)
    manager.model.init_weights(seed=0)
    held = dict(manager.model.named_buffers())
    assert "layers.1.feed_forward.expert_bias" in held  # what the check must cover
    manager.save(1)
    held["layers.1.feed_forward.expert_bias"][2] = bad
    with pytest.raises(UserError, match=r"step-2: the buffer layers\.1\.feed_forward\.expert_bias is not finite") as e:
        manager.save(2)
    assert "`moe.bias_update_rate`" in str(e.value) and "\n" not in str(e.value)
    assert [step for step, _ in step_folders(tmp_path / "checkpoint")] == [1]


@pytest.mark.slow
def test_a_routing_bias_move_that_is_not_finite_skips_the_step(tmp_path):
    """A bias update that would overflow float32 (a rate past the config's limit, forced here)
    is refused like a non-finite gradient: the optimizer step is skipped, weights and biases stay
    those of the last good step, the log says why, and every checkpoint stays finite."""
    argv = [
        *small_argv(tmp_path, "--checkpoint.interval", "1", "--training.max_consecutive_skipped_steps", "0"),
        *["--model.name", "moe", "--model.flavor", "debugmoe", "--training.steps", "2"],
    ]
    logged = run_ranks(overflowing_bias_worker, 1, argv)[0]
    assert any("non-finite routing bias" in line for line in logged), logged
    folder = tmp_path / "checkpoint"
    assert [step for step, _ in step_folders(folder)] == [1, 2]
    saved = {name: dcp_tensor(folder / "step-2", f"model.{name}") for name in ("layers.1.feed_forward.expert_bias",)}
    assert all(torch.equal(t, torch.zeros_like(t)) for t in saved.values()), saved
    first, last = read_dcp_model(str(folder / "step-1")), read_dcp_model(str(folder / "step-2"))
    assert all(torch.equal(first[name], last[name]) for name in first)  # no step moved a weight


def overflowing_bias_worker(argv: list[str]) -> list[str]:
    import dataclasses
    import logging

    import trainer.step.expert_balance as balance

    original = balance.ExpertBalance.__init__

    def overflowing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.settings = dataclasses.replace(self.settings, bias_update_rate=1e300)  # float32's 3.4e38 is far below

    balance.ExpertBalance.__init__ = overflowing
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("meshtrain").addHandler(handler)
    train_as_a_worker(argv)
    return records


def dcp_tensor(folder: Path, key: str) -> torch.Tensor:
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata[key]
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state[key]
