"""Qwen3-MoE folders at size: each rank reads only the experts (and, of those, the FSDP rows) it
holds and the dense boxes it holds, bit for bit what the whole folder gives, with expert
parallelism under FSDP, HSDP, TP and CP; the export writes
one tensor at a time and transformers loads what it wrote, tokenizer and generation config too."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import BASE_ARGV, ROOT, run_by_world
from hf_helpers import assert_same_tensors, one_at_a_time
from hf_tokenizer import build

from trainer.build import build_training
from trainer.checkpoint import hf_load
from trainer.checkpoint.hf_folders import HFFolder, export_hf_folder, load_hf_folder, save_hf_folder
from trainer.checkpoint.model_entry import write_dcp_model
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.data.tokenizer import load_tokenizer
from trainer.model import hf_qwen3_moe
from trainer.model.hf_qwen3_moe import from_hf_state_dict
from trainer.model.llama3 import Transformer
from trainer.model.moe import MoEArgs
from trainer.model.tiled_init import local_box, stacked_box
from trainer.planning.job_plan import JobPlan, resolve_job

sys.path.insert(0, str(ROOT / "scripts"))
import convert_to_hf

ARGV = [*BASE_ARGV, "--model.name", "moe", "--model.flavor", "debugmoe", "--training.local_batch_size", "2"]


def qwen3_plan(argv: list[str], world: int) -> JobPlan:
    """The debug MoE as a ``Qwen3MoeForCausalLM`` can hold it: no shared expert, no dense layer."""
    plan = resolve_job(load_config(argv), world)
    assert isinstance(plan.model_args, MoEArgs)
    return replace(plan, model_args=replace(plan.model_args, n_shared_experts=0, n_dense_layers=0))


def qwen3_args() -> MoEArgs:
    args = qwen3_plan(ARGV, 1).model_args
    assert isinstance(args, MoEArgs)
    return args


def _params(model: Transformer) -> dict[str, torch.Tensor]:
    """What a Hugging Face folder holds of our model: the parameters (the routing bias is ours)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def _write_folder(path: Path) -> None:
    """The tiny model with random weights, as a bf16 folder of several shards."""
    source = Transformer(qwen3_args())
    source.init_weights(5)
    save_hf_folder(path, _params(source), source.args, torch.bfloat16, max_shard_bytes=400_000)


def import_worker(argv: list[str], folder: str, bug: str = "") -> dict:
    """Import ``folder`` into the trainer's model on this mesh, counting what is read; the
    parameters whose shard differs from the whole folder's conversion, sliced, the experts read
    and the bytes read and held."""
    plan = qwen3_plan(argv, int(os.environ["WORLD_SIZE"]))
    training = build_training(plan, load_dataset(plan.config, plan.tokenizer, plan.global_batch_size))
    model, args = training.model, plan.model_args
    experts: set[int] = set()
    read_bytes = 0
    original = HFFolder.read

    def counted(self: HFFolder, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        nonlocal read_bytes
        whole = bug == "reads whole tensors"
        out = original(self, name, (slice(None),) * len(self.shapes[name]) if whole else box)
        read_bytes += out.nbytes
        if ".experts." in name:
            experts.add(int(name.split(".experts.")[1].split(".")[0]))
        return out[box] if whole else out

    right_box = hf_load.stacked_box
    HFFolder.read = counted  # type: ignore[method-assign]
    if bug == "first expert ignored":
        hf_load.stacked_box = lambda owner, param: (*local_box(param), tuple(param.shape))  # type: ignore[assignment]
    try:
        hf_load.load_hf_weights(model, args, Path(folder))
    finally:
        HFFolder.read, hf_load.stacked_box = original, right_box  # type: ignore[method-assign]
    whole, _ = load_hf_folder(folder)
    want = from_hf_state_dict(whole, args)
    wrong, held_bytes = [], 0
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        offset, shape, _ = stacked_box(model.get_submodule(name.rpartition(".")[0]), param)
        expected = want[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(local.dtype)
        if not torch.equal(local.detach(), expected):
            wrong.append(name)
        held_bytes += local.numel() * torch.bfloat16.itemsize
    return {"wrong": wrong, "experts": sorted(experts), "read": read_bytes, "held": held_bytes}


MESHES = {
    "ep=2": (2, "dp_shard=2,ep=2"),
    "dp_shard=4 x ep=2": (4, "dp_shard=4,ep=2"),
    "HSDP x ep=2": (4, "dp_replicate=2,dp_shard=2,ep=2"),
    "dp_shard=2 x ep=2 x tp=2": (4, "dp_shard=2,ep=2,tp=2"),
    "cp=2 x ep=2": (2, "cp=2,ep=2"),
    "pp=2 x dp_shard=2 x ep=2": (4, "pp=2,dp_shard=2,ep=2"),
}
BUGS = {
    "first expert ignored": ("first expert ignored", "ep=2"),
    "reads whole tensors": ("reads whole tensors", "ep=2"),
    "first expert ignored, tp=2": ("first expert ignored", "dp_shard=2 x ep=2 x tp=2"),
    "first expert ignored, cp=2": ("first expert ignored", "cp=2 x ep=2"),
    "first expert ignored, pp=2": ("first expert ignored", "pp=2 x dp_shard=2 x ep=2"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    _write_folder(folder)
    cases = {
        name: (world, (import_worker, ARGV + ["--mesh", mesh], str(folder))) for name, (world, mesh) in MESHES.items()
    }
    for name, (bug, mesh) in BUGS.items():
        world, spec = MESHES[mesh]
        cases[name] = (world, (import_worker, ARGV + ["--mesh", spec], str(folder), bug))
    return run_by_world(cases)


def _problems(ranks: list[dict], replica_ranks: int, n_experts: int) -> list[str]:
    """What is wrong with an import: a shard unlike the whole folder's, a rank reading experts
    it does not hold (each of a replica's ``dp_shard x cp x tp`` ranks holds ``n_experts`` over
    that many of them, EP x FSDP, the experts' FSDP spanning ``tp``, and together they hold each
    once), or reading more than 1% beyond what it holds (the q/k norms, one head wide, are read
    whole)."""
    out = [f"rank {r}: {ranks[r]['wrong'][0]} differs" for r in range(len(ranks)) if ranks[r]["wrong"]]
    for r, rank in enumerate(ranks):
        if len(rank["experts"]) != n_experts // replica_ranks:
            out.append(f"rank {r} read experts {rank['experts']}")
        if rank["read"] > 1.01 * rank["held"]:
            out.append(f"rank {r} read {rank['read']} bytes, holds {rank['held']}")
    replica = sorted(e for rank in ranks[:replica_ranks] for e in rank["experts"])
    if replica != list(range(n_experts)):
        out.append(f"the first replica's ranks read experts {replica}")
    return out


def _replica_ranks(mesh: str) -> int:
    degrees = dict(part.split("=") for part in MESHES[mesh][1].split(","))
    return math.prod(int(degrees.get(dim, 1)) for dim in ("dp_shard", "cp", "tp"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_rank_reads_only_its_boxes_and_equals_the_whole_import(mesh: str, launched):
    assert _problems(launched[mesh], _replica_ranks(mesh), qwen3_args().n_experts) == []


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_the_checks_catch_a_wrong_box_and_reading_everything(bug: str, launched):
    problems = _problems(launched[bug], _replica_ranks(BUGS[bug][1]), qwen3_args().n_experts)
    print(bug, problems)
    assert problems


def test_export_streams_one_tensor_at_a_time(tmp_path: Path):
    """Each of our tensors is read once (an expert stack gives its experts' tensors one after
    the other), none is held when the next is read, and the folder converts back bit for bit."""
    args = qwen3_args()
    model = Transformer(args)
    model.init_weights(3)
    sd = _params(model)
    read, order = one_at_a_time(sd)
    export_hf_folder(tmp_path, read, args, torch.float32, max_shard_bytes=400_000)
    assert order == list(sd)
    whole, _ = load_hf_folder(tmp_path)
    assert_same_tensors(from_hf_state_dict(whole, args), sd)


def test_export_folder_loads_in_transformers_with_its_tokenizer(tmp_path: Path):
    """The converter's sharded bf16 export of an MoE checkpoint: shards, index, config, generation
    config and tokenizer; transformers loads all of them, and its weights are ours in bf16."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3MoeForCausalLM

    args = qwen3_args()
    model = Transformer(args)
    model.init_weights(3)
    tokenizer = build(tmp_path / "tok")
    write_dcp_model(tmp_path / "ckpt", _params(model), args)
    convert_to_hf.main(
        [str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--tokenizer", str(tokenizer), "--max-shard-bytes", "400000"]
    )
    out = tmp_path / "hf"
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert set(names) == {
        *shards,
        "model.safetensors.index.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    hf = Qwen3MoeForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    ours = _params(model)
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    assert torch.equal(
        gate_up[5],
        torch.cat(
            [ours["layers.1.feed_forward.experts.w1"][5], ours["layers.1.feed_forward.experts.w3"][5]]
        ).bfloat16(),
    )
    loaded = load_tokenizer(str(tokenizer))
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (loaded.bos_id, loaded.eos_id)
    assert AutoTokenizer.from_pretrained(out).encode("To be", add_special_tokens=False) == loaded.encode(
        "To be", bos=False, eos=False
    )


def test_export_warns_that_a_learned_routing_bias_stays_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """A training checkpoint holds each MoE layer's ``expert_bias``; a nonzero one moves the
    top-k choice, which a ``Qwen3MoeForCausalLM`` cannot, so the export says so (and not for zeros)."""
    args = qwen3_args()
    model = Transformer(args)
    model.init_weights(3)
    monkeypatch.setattr(hf_qwen3_moe, "check_state_dict", lambda sd, args: None)  # a trainer checkpoint's keys
    warned = {}
    for bias in (0.0, 0.01):
        biases = {name: torch.full_like(b, bias) for name, b in model.named_buffers() if name.endswith("expert_bias")}
        write_dcp_model(tmp_path / f"ckpt{bias}", {**_params(model), **biases}, args)
        convert_to_hf.main([str(tmp_path / f"ckpt{bias}"), str(tmp_path / f"hf{bias}")])
        warned[bias] = "routes with a learned expert bias" in capsys.readouterr().err
    assert warned == {0.0: False, 0.01: True}
