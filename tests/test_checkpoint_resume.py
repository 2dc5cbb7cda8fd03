"""What a resume is checked for before it loads, and what it says (``trainer/checkpoint/resume_fit.py``):
another model is named as such, with the keys that build it, before any question of data; the
dry run and the launcher read the checkpoint the run would resume and refuse what the resume
would refuse; a resume with another LR schedule runs this run's and says so, in the dry run and
in the run's log alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_helpers import TINY, one_rank, tiny_manager
from harness import QUICK, ROOT, run_train

from trainer.checkpoint.folders import model_keys
from trainer.config import load_config
from trainer.entry.launch import main as launch_main
from trainer.model.deepseek_v3 import FLAVORS as DEEPSEEK_FLAVORS
from trainer.model.llama3 import FLAVORS, model_args
from trainer.model.moe import FLAVORS as MOE_FLAVORS
from trainer.model.moe import MoEArgs
from trainer.optimizer import schedule_change, schedule_settings
from trainer.runtime.errors import CheckpointError

__all__ = ["one_rank"]  # the fixture, used by name
TINY_MOE = MoEArgs(**{**vars(TINY), "n_experts": 4, "top_k": 2, "moe_hidden_dim": 16})


def test_another_model_kind_is_blamed_on_the_model_not_on_its_data(tmp_path: Path, one_rank: None):
    """A Mixture-of-Experts checkpoint resumed by a dense run on other data: the model is named
    (it used to be "trained on other data ... set `checkpoint.allow_data_change`")."""
    saving = tiny_manager(tmp_path, TINY_MOE, data="a", step=2)
    saving.model.init_weights(0)
    saving.save(2)
    with pytest.raises(CheckpointError) as caught:
        tiny_manager(tmp_path, TINY, data="b").load()
    message = str(caught.value)
    assert "holds another model" in message and "model.name: moe there, llama3 here" in message, message
    assert '`model.name` = "moe"' in message and "other data" not in message and "\n" not in message


@pytest.mark.parametrize(
    ("args", "keys"),
    [
        (model_args("debugmodel", 2048, 128), '`model.name` = "llama3", `model.flavor` = "debugmodel"'),
        (
            model_args("8B", 2048, 128, 2, FLAVORS),
            '`model.name` = "llama3", `model.flavor` = "8B", `model.n_layers` = 2',
        ),
        (model_args("debugmoe", 2048, 128, 0, MOE_FLAVORS), '`model.name` = "moe", `model.flavor` = "debugmoe"'),
        (
            model_args("qwen3_moe_debug", 2048, 128, 0, MOE_FLAVORS),
            '`model.name` = "moe", `model.flavor` = "qwen3_moe_debug"',
        ),
        (
            model_args("16B", 2048, 128, 3, DEEPSEEK_FLAVORS),
            '`model.name` = "deepseek_v3", `model.flavor` = "16B", `model.n_layers` = 3',
        ),
        (TINY, '`model.name` = "llama3" with no flavor of its shape (a converted or hand-made checkpoint)'),
    ],
)
def test_the_model_keys_of_a_checkpoint_name_its_flavor(args, keys):
    assert model_keys(args) == keys


def test_the_schedule_line_of_docs_checkpoints_is_the_debug_models():
    def settings(steps: str) -> dict:
        config = load_config(["--training.steps", steps])
        return schedule_settings(config.training.steps, config.optimizer.lr, config.lr_scheduler)

    said = schedule_change(settings("2"), settings("4"), 2)
    assert said is not None and said in " ".join((ROOT / "docs" / "checkpoints.md").read_text().split())


RUN = [*QUICK, "--training.steps", "2", "--checkpoint.enable", "--metrics.enable_tensorboard=false"]


def dry_run(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("NGPU", "1")
    code = launch_main([*argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.launcher
def test_the_dry_run_and_the_launcher_read_the_checkpoint_the_run_would_resume(tmp_path, monkeypatch, capsys):
    dump = ["--job.dump_folder", str(tmp_path)]
    assert run_train(1, [*RUN, *dump]).returncode == 0
    step = tmp_path / "checkpoint" / "step-2"

    code, out, _ = dry_run(monkeypatch, capsys, *RUN, *dump)
    assert code == 0 and f"resume: {step} (the model's as this run's)" in out.splitlines(), out
    assert not [line for line in out.splitlines() if line.startswith("resume: ") and "LR schedule" in line], out

    # Another model (the debug MoE on the same data): refused in one line naming it, also at launch.
    moe = ["--config", "debug_moe.toml", *RUN, *dump]
    code, _, err = dry_run(monkeypatch, capsys, *moe)
    assert code == 1 and err.count("\n") == 1 and "holds another model" in err, err
    assert '`model.flavor` = "debugmodel"' in err and "other data" not in err
    launched = run_train(1, moe)
    assert launched.returncode == 1 and "holds another model" in launched.stderr and "[rank" not in launched.stderr

    # Other data: refused as the resume refuses it; allowed, said.
    other = [*RUN, *dump, "--training.dataset", "shakespeare_dialogue"]
    code, _, err = dry_run(monkeypatch, capsys, *other)
    assert code == 1 and "was trained on other data" in err and "checkpoint.allow_data_change" in err, err
    code, out, _ = dry_run(monkeypatch, capsys, *other, "--checkpoint.allow_data_change")
    assert code == 0 and "resume: on changed data (`checkpoint.allow_data_change`)" in out, out

    # A longer run: this run's schedule, said by the dry run and by the run's log in the same words.
    longer = [*RUN, *dump, "--training.steps", "4"]
    code, out, _ = dry_run(monkeypatch, capsys, *longer)
    said = [
        line.removeprefix("resume: ")
        for line in out.splitlines()
        if line.startswith("resume: ") and "LR schedule" in line
    ]
    assert code == 0 and len(said) == 1 and "`training.steps` 2 there, 4 here" in said[0], out
    resumed = run_train(1, longer)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {step}: {said[0]}" in resumed.stderr, resumed.stderr[-3000:]
