"""The MoE time split: the router, dispatch, expert and combine ranges in a profiler trace (the
all-to-alls inside dispatch and combine under expert parallelism), timed only while measuring,
and the start report's line for an MoE run, absent for a dense one."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import BASE_ARGV, run_ranks, train_as_a_worker

from parallelisms.moe_split import PARTS, SPLIT
from trainer.metrics.reports import moe_split_line
from trainer.model import routed_experts
from trainer.model.llama3 import Transformer
from trainer.model.moe import FLAVORS, moe_layers
from trainer.model.routed_experts import GroupedExperts, has_grouped_mm

TINY = replace(FLAVORS["debugmoe"], dim=64, vocab_size=256)


def _events(trace: Path) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_each_part_of_each_layer_is_a_trace_range(tmp_path: Path):
    model = Transformer(TINY)
    model.init_weights(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(tokens).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    names = [e["name"] for e in _events(tmp_path / "trace.json")]
    layers = len(moe_layers(model))
    assert layers == TINY.n_layers - TINY.n_dense_layers
    assert {part: names.count(f"moe/{part}") for part in PARTS} == dict.fromkeys(PARTS, layers)


def test_parts_are_timed_only_while_measuring():
    model = Transformer(TINY)
    model.init_weights(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    SPLIT.start(torch.device("cpu"))
    with torch.no_grad():
        model(tokens)
    measured = SPLIT.stop()
    assert all(measured[part] > 0 for part in PARTS), measured
    with torch.no_grad():
        model(tokens)
    assert SPLIT.seconds == measured


def test_the_line_gives_each_part_per_step_and_its_share():
    line = moe_split_line({"router": 0.002, "dispatch": 0.004, "experts": 0.03, "combine": 0.004}, 0.2, 2, 3)
    assert line.startswith("MoE time split, steps 2-3")
    assert "router 1.0 ms (1%), dispatch 2.0 ms (2%), experts 15.0 ms (15%), combine 2.0 ms (2%)" in line
    assert "20.0 ms of the 100.0 ms step (20%)" in line


def test_a_split_that_measured_nothing_says_why():
    """Compiled blocks open no part (compile fuses across them), and a pipeline rank may hold no
    MoE layer: the line says which, not 0 ms a part."""
    compiled = moe_split_line(dict.fromkeys(PARTS, 0.0), 0.2, 2, 3, compiled=True)
    assert compiled.startswith("MoE time split, steps 2-3: none; the MoE layers are compiled")
    assert moe_split_line(dict.fromkeys(PARTS, 0.0), 0.2, 2, 3) == (
        "MoE time split, steps 2-3: none; this rank holds no MoE layer"
    )


def test_the_experts_range_runs_the_grouped_matmul_where_chosen(monkeypatch: pytest.MonkeyPatch):
    """Only CUDA bf16 at sm90+ picks ``torch._grouped_mm``; where picked, the experts go through it
    (one kernel per weight) and give the loop's bf16 result bit for bit (CPU's forward here; the
    GPU's is for the device check)."""
    experts = GroupedExperts(5, 32, 16).to(torch.bfloat16)
    torch.nn.init.normal_(experts.w1), torch.nn.init.normal_(experts.w2), torch.nn.init.normal_(experts.w3)
    x, counts = torch.randn(20, 32, dtype=torch.bfloat16), torch.tensor([5, 0, 9, 0, 6])
    assert not has_grouped_mm(x)
    looped = experts.swiglu(x, counts)
    calls: list[int] = []
    grouped_mm = experts.grouped_mm  # kernels.grouped_mm, or float8's where converted
    monkeypatch.setattr(experts, "grouped_mm", lambda *args, **kw: calls.append(1) or grouped_mm(*args, **kw))
    monkeypatch.setattr(routed_experts, "has_grouped_mm", lambda x: True)
    with torch.no_grad():
        assert torch.equal(experts.swiglu(x, counts), looped.detach())
    assert len(calls) == 3


def run_worker(argv: list[str], dump: str) -> dict:
    """Train as a worker does; the start report's lines this rank logged and its trace's events."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshtrain").addHandler(handler)
    logging.getLogger("meshtrain").setLevel(logging.INFO)  # the worker's main sets it; this is a bare process
    try:
        train_as_a_worker([*argv, "--job.dump_folder", dump])
    finally:
        logging.getLogger("meshtrain").removeHandler(handler)
    traces = list(Path(dump).rglob(f"rank{os.environ['RANK']}_trace.json"))
    return {"split": [line for line in lines if line.startswith("MoE time split")], "events": _events(traces[0])}


PROFILED = ["--training.steps", "3", "--profiling.enable_profiling", "--profiling.profile_freq", "3"]
MOE = ["--model.name", "moe", "--model.flavor", "debugmoe", "--training.local_batch_size", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """One launch per run: a process trains once (its process group ends with the run)."""
    moe = [*BASE_ARGV, *PROFILED, *MOE, "--mesh", "dp_shard=2,ep=2"]
    dense = [*BASE_ARGV, *PROFILED, "--training.local_batch_size", "8"]
    return {
        "moe ep=2": run_ranks(run_worker, 2, moe, str(tmp_path_factory.mktemp("moe"))),
        "dense": run_ranks(run_worker, 1, dense, str(tmp_path_factory.mktemp("dense"))),
    }


def _inside(events: list[dict], outer: str, inner: str) -> bool:
    """An ``inner`` event that the thread running an ``outer`` range ran inside it (gloo runs an
    exchange on a thread of its own, which may overlap the experts: that is the point)."""
    spans = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == outer]
    return any(
        tid == e["tid"] and a <= e["ts"] and e["ts"] + e["dur"] <= b
        for e in events
        if inner in e["name"]
        for tid, a, b in spans
    )


@pytest.mark.slow
def test_an_moe_run_reports_its_split_and_traces_the_all_to_alls(runs):
    ranks = runs["moe ep=2"]
    print(ranks[0]["split"])
    assert len(ranks[0]["split"]) == 1 and "steps 2-3" in ranks[0]["split"][0], ranks[0]["split"]
    assert ranks[1]["split"] == []  # rank 0 reports
    for rank in ranks:
        names = {e["name"] for e in rank["events"]}
        assert {f"moe/{part}" for part in PARTS} <= names
        assert _inside(rank["events"], "moe/dispatch", "all_to_all")
        assert _inside(rank["events"], "moe/combine", "all_to_all")
        assert not _inside(rank["events"], "moe/experts", "all_to_all")


@pytest.mark.slow
def test_a_dense_run_has_no_moe_line_or_range(runs):
    for rank in runs["dense"]:
        assert rank["split"] == []
        assert not any(e["name"].startswith("moe/") for e in rank["events"])
