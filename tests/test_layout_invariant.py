"""``debug.layout_invariant``: the same bits on every data-parallel layout.

Through ``./run_train.sh``, 4 steps of ``shakespeare_dialogue`` (masked prompts and padding:
uneven valid tokens per micro-batch and rank) with clipping active, a global batch of 8
micro-batches of 1: one process accumulating 8, FSDP on 4 ranks accumulating 2, HSDP 2 x 2
accumulating 2, and the 4-rank run's step-2 checkpoint resumed on 2 ranks accumulating 4. Every
step's exact loss, valid-token count and grad norm (the mode's console line, in hexadecimal)
and every tensor of the step-4 checkpoints (weights, AdamW moments, step counters) must be
bit-identical. The mutation: the same single process with the mode off, which adds the
micro-batch gradients in autograd's order instead of the canonical tree, must differ by its step-2
checkpoint, so the comparison can fail; that checkpoint resumed with the mode on is named as one
whose bits cannot match. The pieces the promise rests on are checked alone: the pairwise sums' trees,
AdamW's and the clip scale's independence of where an element lies in its shard, the refusals,
and ``scripts/compare_checkpoints.py``.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import ROOT, run_train

from trainer.config import ConfigError, load_config
from trainer.planning.job_plan import resolve_job
from trainer.step.ordered_sums import PairwiseSum, pairwise_rows

sys.path.insert(0, str(ROOT / "scripts"))
import compare_checkpoints

STEPS = 4
SAVED = 2
"""The step of the checkpoint the resume starts from and the mode-off run stops at."""
COMMON = [
    "--training.dataset",
    "shakespeare_dialogue",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "8",
    "--training.max_norm",
    "0.5",  # below the debug model's grad norm (about 1.2 to 1.5 here): every step clips
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "5",
    "--metrics.enable_tensorboard=false",
    "--metrics.disable_color_printing",
    "--validation.enable=false",
    "--debug.seed",
    "5",
    "--checkpoint.enable",
    "--checkpoint.interval",
    str(SAVED),
]
ON = ["--debug.layout_invariant"]
EXACT = re.compile(r"exact step values: (loss \S+, tokens \d+, grad norm \S+)")

# name: (NGPU, extra args); the mode-off run stops at its first checkpoint, all it is compared by.
LAYOUTS = {
    "1x8": (1, ON),
    "fsdp4x2": (4, ON),
    "hsdp2x2x2": (4, [*ON, "--mesh", "dp_replicate=2,dp_shard=2"]),
    "off_1x8": (1, ["--training.steps", str(SAVED)]),
}


class Run(NamedTuple):
    dump: Path
    exact: list[str]  # the exact step values the mode logs, one per step run
    log: str


def launch(ngpu: int, dump: Path, extra: list[str]) -> Run:
    done = run_train(ngpu, [*COMMON, "--job.dump_folder", str(dump), *extra], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return Run(dump, EXACT.findall(done.stderr + done.stdout), done.stderr)


def resume(ngpu: int, checkpoint: Path, dump: Path, extra: list[str]) -> Run:
    """Resume ``checkpoint`` (a ``step-N`` folder) as the last checkpoint of a fresh dump folder."""
    shutil.copytree(checkpoint, dump / "checkpoint" / checkpoint.name)
    return launch(ngpu, dump, extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("layouts")
    out = {name: launch(ngpu, root / name, extra) for name, (ngpu, extra) in LAYOUTS.items()}
    out["resumed"] = resume(2, root / "fsdp4x2" / "checkpoint" / f"step-{SAVED}", root / "fsdp4_resumed_on_2", ON)
    return out


def final_tensors(dump: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The tensors of the last checkpoint (or ``step``'s): weights, optimizer state, step counters, the RNG state."""
    return compare_checkpoints.read_tensors(dump / "checkpoint" / f"step-{step}")


@pytest.mark.launcher
def test_every_layout_and_a_resume_give_the_same_bits(runs):
    reference_dump, reference, _ = runs["1x8"]
    assert len(reference) == STEPS and len(set(reference)) == STEPS
    expected = final_tensors(reference_dump)
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in expected)
    assert "train_state.rng_cpu" in expected
    for name in ("fsdp4x2", "hsdp2x2x2", "resumed"):
        dump, logged, _ = runs[name]
        steps = reference[SAVED:] if name == "resumed" else reference
        assert logged == steps, f"{name}: per-step exact values differ from 1 process x 8"
        result = compare_checkpoints.compare(expected, final_tensors(dump))
        assert result.compared == len(expected) and not result.differing, (name, result.differing[:3])


@pytest.mark.launcher
def test_another_summation_order_changes_the_bits(runs):
    """The mode off on the same single process: autograd adds the 8 micro-batch gradients one
    after the other, not as the canonical tree, and the first checkpoint's state differs."""
    result = compare_checkpoints.compare(
        final_tensors(runs["1x8"].dump, SAVED), final_tensors(runs["off_1x8"].dump, SAVED)
    )
    assert result.differing and all(not k.endswith(".step") for k in result.differing)
    assert list(result.differing_kinds()) == ["model weights", "optimizer state"]


@pytest.mark.launcher
def test_a_resume_saves_the_state_of_a_run_never_interrupted_and_a_default_mode_one_is_named(runs, tmp_path, capsys):
    """Every entry of the checkpoints, the CPU RNG state and the data loader's position included:
    nothing draws from the RNG a resume restored that an uninterrupted run would not (the resume
    on 2 ranks against the single process). Resuming a checkpoint written with the mode off says
    that the bits cannot match an uninterrupted run's; resuming one written with it on does not."""
    final = [str(runs[name].dump / "checkpoint" / f"step-{STEPS}") for name in ("1x8", "resumed")]
    assert compare_checkpoints.main(final) == 0, capsys.readouterr().out
    assert "RNG state" in capsys.readouterr().out
    assert "layout_invariant` off" not in runs["resumed"].log, runs["resumed"].log[-3000:]

    off = runs["off_1x8"].dump / "checkpoint" / f"step-{SAVED}"
    done = resume(1, off, tmp_path / "default", [*ON, "--training.steps", str(SAVED + 1)])
    warned = [line for line in done.log.splitlines() if "written with `debug.layout_invariant` off" in line]
    assert len(warned) == 1 and f"step-{SAVED}" in warned[0], done.log[-3000:]


# --------------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------------


def _tree(values: list[torch.Tensor]) -> torch.Tensor:
    """The pairwise tree PairwiseSum promises, written recursively: the largest power-of-two
    prefix as a balanced tree, plus the rest."""
    if len(values) == 1:
        return values[0].clone()
    size = 1 << (len(values).bit_length() - 1)
    if size == len(values):
        return _tree(values[: size // 2]) + _tree(values[size // 2 :])
    return _tree(values[:size]) + _tree(values[size:])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8, 13])
def test_pairwise_sum_is_the_tree_of_the_stream(n):
    torch.manual_seed(n)
    values = [torch.randn(37) * 10.0 ** torch.randint(-4, 5, (37,)) for _ in range(n)]
    copies = [v.clone() for v in values]
    acc = PairwiseSum()
    for v in values:
        acc.add(v)
    assert torch.equal(acc.total(), _tree(copies))
    assert all(torch.equal(v, c) for v, c in zip(values, copies)), "add must not modify the values it is given"


def test_pairwise_sum_order_matters_where_sequential_differs():
    """Float addition is not associative: the tree and a left-to-right sum give different bits here."""
    values = [torch.tensor([x], dtype=torch.float32) for x in (1e8, 1.0, -1e8, 1.0)]
    acc = PairwiseSum()
    for v in values:
        acc.add(v)
    sequential = ((values[0] + values[1]) + values[2]) + values[3]
    assert acc.total().item() == 0.0 and sequential.item() == 1.0


def test_a_rows_sum_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    x = torch.randn(67, 1001) * 10.0 ** torch.randint(-3, 4, (67, 1001))
    whole = pairwise_rows(x)
    for start, end in [(0, 1), (5, 6), (3, 40), (33, 67)]:
        assert torch.equal(pairwise_rows(x[start:end].clone()), whole[start:end])
    assert torch.allclose(whole.double(), x.double().sum(dim=1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_adamw_and_the_clip_scale_update_an_element_the_same_in_any_shard(implementation):
    """What lets the optimizer step on shards of any size: the update of an element does not
    depend on the length of the tensor it lies in, nor its position in it (vectorised body or
    scalar tail), for every split of a tensor into two shards."""
    torch.manual_seed(1)
    weights, grads = torch.randn(4099), torch.randn(4099) * 1e-2

    def train(cut: int | None) -> list[torch.Tensor]:
        pieces = [slice(0, None)] if cut is None else [slice(0, cut), slice(cut, None)]
        params = [torch.nn.Parameter(weights[s].clone()) for s in pieces]
        optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=implementation == "foreach")
        for step in range(3):
            for p, s in zip(params, pieces):
                p.grad = grads[s].clone()
                torch._foreach_mul_([p.grad], 0.3 + step)
            optimizer.step()
        state = [torch.cat([optimizer.state[p][k] for p in params]) for k in ("exp_avg", "exp_avg_sq")]
        return [torch.cat([p.detach() for p in params]), *state]

    expected = train(None)
    for cut in [*range(1, 33), 2048]:  # every tail length of a 16-float (AVX-512) body twice over
        for got, want in zip(train(cut), expected):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"split at {cut}"


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--mesh", "dp_shard=2,tp=2"], "parallelism.tensor_parallel_degree"),
        (["--mesh", "dp_shard=2,cp=2"], "parallelism.context_parallel_degree"),
        (["--mesh", "pp=2,dp_shard=2"], "parallelism.pipeline_parallel_degree"),
        (["--config", "debug_moe.toml", "--mesh", "dp_shard=4,ep=2"], "parallelism.expert_parallel_degree"),
        (["--compile.enable"], "compile.enable"),
        (["--training.mixed_precision_reduce", "bfloat16"], "training.mixed_precision_reduce"),
        (["--training.defer_gradient_reduction"], "training.defer_gradient_reduction"),
        (["--optimizer.implementation", "fused"], "optimizer.implementation"),
        (
            ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather"],
            "float8.enable_fsdp_float8_all_gather",
        ),
    ],
)
def test_what_breaks_the_bits_is_refused_naming_both_keys(extra, key):
    with pytest.raises(ConfigError, match=rf"`debug.layout_invariant`.*`{re.escape(key)}`"):
        resolve_job(load_config(["--debug.layout_invariant", *extra]), 4)
    resolve_job(load_config(extra), 4, device="cuda")  # accepted with the mode off (float8's gather needs NCCL)


def _save(folder: Path, entries: dict[str, Any]) -> Path:
    dcp.save(
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()},
        checkpoint_id=str(folder),
        no_dist=True,
    )
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_compare_checkpoints(tmp_path: Path, capsys):
    torch.manual_seed(0)
    base = {"model.w": torch.randn(8, 4), "model.b": torch.zeros(4), "optimizer.state.w.step": torch.tensor(3.0)}
    a = _save(tmp_path / "a", base)
    assert compare_checkpoints.main([str(a), str(_save(tmp_path / "same", base))]) == 0
    assert "identical: 3 tensors" in capsys.readouterr().out

    one_ulp = dict(base, **{"model.w": base["model.w"].clone()})
    one_ulp["model.w"][2, 1] = torch.nextafter(one_ulp["model.w"][2, 1], torch.tensor(1e9))
    assert compare_checkpoints.main([str(a), str(_save(tmp_path / "ulp", one_ulp))]) == 1
    out = capsys.readouterr().out
    assert "first differing entry: model.w" in out and "largest relative difference: " in out

    negative_zero = dict(base, **{"model.b": -torch.zeros(4)})  # equal as numbers, not as bits
    assert compare_checkpoints.main([str(a), str(_save(tmp_path / "neg0", negative_zero))]) == 1
    assert "first differing entry: model.b" in capsys.readouterr().out

    missing = {k: v for k, v in base.items() if k != "model.b"}
    assert compare_checkpoints.main([str(a), str(_save(tmp_path / "missing", missing))]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "first differing entry: model.b: only in A" in out, out
    # A Hugging Face round trip keeps the weights and drops the rest: what is identical is said.
    assert out[1] == "differ: model weights (1 of 2 entries, 1 only in A)", out
    assert out[2] == "identical: model weights (1 of 2 entries), optimizer state", out

    rng, position = torch.get_rng_state(), {"dataloader.step": 4}
    state = _save(tmp_path / "state", {**base, "train_state.rng_cpu": rng, **position})
    torch.rand(1)
    moved = _save(tmp_path / "moved", {**base, "train_state.rng_cpu": torch.get_rng_state(), **position})
    assert compare_checkpoints.main([str(state), str(moved)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "differ: RNG state (1 of 1 entries)", out
    assert out[2] == "identical: model weights, optimizer state, data loader position", out
    later = _save(tmp_path / "later", {**base, "train_state.rng_cpu": rng, "dataloader.step": 5})
    assert compare_checkpoints.main([str(state), str(later)]) == 1
    out = capsys.readouterr().out
    assert "differ: data loader position (1 of 1 entries)" in out and "dataloader.step: 4 in A, 5 in B" in out

    assert compare_checkpoints.main([str(a), str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "checkpoint/step-N" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("damage", ["truncated", "missing", "metadata", "corrupted"])
def test_compare_checkpoints_names_a_damaged_checkpoint_in_one_line(tmp_path: Path, capsys, damage: str):
    """Exit 3, not the "they differ" 1 after a traceback: a damaged checkpoint is no divergence."""
    from trainer.checkpoint.integrity import ChecksummingWriter

    entries = {"model.w": torch.randn(64, 64), "optimizer.state.w.step": torch.tensor(3.0)}
    good = _save(tmp_path / "good", entries)
    bad = tmp_path / "bad"
    dcp.save({k: v.clone() for k, v in entries.items()}, storage_writer=ChecksummingWriter(str(bad)), no_dist=True)
    data = next(bad.glob("*.distcp"))
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:1000])
    elif damage == "missing":
        data.unlink()
    elif damage == "metadata":
        (bad / ".metadata").write_bytes(b"damaged")
    else:
        content = bytearray(data.read_bytes())
        content[-100] ^= 0xFF
        data.write_bytes(bytes(content))
    assert compare_checkpoints.main([str(good), str(bad)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("compare_checkpoints: damaged checkpoint: "), err
    assert str(bad) in err and "Traceback" not in err
