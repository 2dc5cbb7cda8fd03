"""``--simulate``: the whole job, one rank per role, in this process; will it fit, how fast.

``./run_train.sh --config X.toml --simulate --target-gpu h100`` with ``NGPU x NNODES`` ranks plans
the job for that world size, then runs one rank of every pipeline stage (the ranks of a stage
differ only in which data and which shard they hold) through the trainer's real build and two
real steps on fake tensors (``fake_job.py``), and reports each role's measured memory and
estimated step time (``report.py``). Compile is off (it changes no memory the tracker can see
and would trace for minutes); the data are synthetic samples of the training shape; context
parallelism runs its ``allgather_kv`` attention, the one with a CPU path. The last line printed
is the path of ``simulation.json``. Exit 0 when every role fits the target, 2 when one does not.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from trainer.runtime.job import Request, parse_request, prepare
from trainer.simulation.fake_job import PipelineMetadata, rank_of_stage, run_isolated
from trainer.simulation.report import build_report, fit_advice, render, write
from trainer.simulation.targets import target_named


def simulate(argv: list[str] | Request, nproc: int, nnodes: int) -> int:
    """Simulate the job ``argv`` describes on ``nproc x nnodes`` ranks; the exit code."""
    request = argv if isinstance(argv, Request) else parse_request(["--simulate", *argv])
    target = target_named(request.target_gpu, request.target_overrides, nproc)
    job = prepare(
        [*request.argv, "--compile.enable=false", "--training.num_workers", "0"],
        nproc * nnodes,
        local_ranks=nproc,
        memory=False,
    )
    job_plan, config = job.plan, job.plan.config
    if target.name != "cpu" and config.training.mixed_precision_param == "auto":
        job_plan.parallel = replace(job_plan.parallel, param_dtype=torch.bfloat16)
    print(
        f"simulating {job_plan.dims.pp} role(s) of {job_plan.dims.world_size} ranks on fake tensors ...",
        file=sys.stderr,
        flush=True,
    )
    metadata = PipelineMetadata()
    runs = [
        run_isolated(job_plan, rank_of_stage(job_plan, stage), nproc, metadata) for stage in range(job_plan.dims.pp)
    ]
    report = build_report(job_plan, target, runs)
    print(render(report))
    if not report["fits"]:
        print(fit_advice(job_plan, target, report))
    print(write(report, config.job.dump_folder))
    return 0 if report["fits"] else 2
