"""``--simulate``: the whole job, one rank per role, in this process; will it fit, how fast.

``./run_train.sh --config X.toml --simulate --target-gpu h100`` with ``NGPU x NNODES`` ranks plans
the job for that world size, then runs one rank of every pipeline stage (the ranks of a stage
differ only in which data and which shard they hold) through the trainer's real build and two
real steps on fake tensors (``fake_job.py``), and reports each role's measured memory and
estimated step time (``report.py``). Compile is off in the trace (it changes no memory the tracker
can see and would trace for minutes); a job compiled by Inductor is timed with the bytes its fusion
leaves (``cost_model.py``); the data are synthetic samples of the training shape (the job's data are not read: they may be
on the cluster; ``--dry-run`` where they are checks them); context
parallelism runs its ``allgather_kv`` attention, the one with a CPU path. The last line printed
is the path of ``simulation.json``. Exit 0 when every role fits the target, 2 when one does not.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from trainer.config import JobConfig, load_config
from trainer.entry.job import Request, holding_as, parse_request, prepare_plan
from trainer.planning.job_plan import JobPlan, check_torch, compiles_blocks, resolve_job
from trainer.runtime.dump_folder import DumpFolderLock, check_dump_folder
from trainer.runtime.stop_requests import Stopped, stopped_by_signals
from trainer.simulation.fake_job import RoleRun
from trainer.simulation.microbatches import schedule_count, shortened_args, traced_count
from trainer.simulation.report import build_report, fit_advice, render, write
from trainer.simulation.roles import run_roles, start_fork_server
from trainer.simulation.targets import Target, target_named


def simulate(argv: list[str] | Request, nproc: int, nnodes: int) -> int:
    """Simulate the job ``argv`` describes on ``nproc x nnodes`` ranks; the exit code.

    The simulation holds its dump folder as a job does, so that two of them (or a simulation and
    a training job) never overwrite each other's ``simulation.json``. SIGTERM or Ctrl-C ends it
    at once, with its processes, and 128 + the signal's number: there is no step to finish.
    """
    request = argv if isinstance(argv, Request) else parse_request(["--simulate", *argv])
    target = target_named(request.target_gpu, request.target_overrides, nproc)
    config = load_config(request.argv)
    folder = config.job.dump_folder
    check_dump_folder(folder)
    lock = DumpFolderLock(folder)
    lock.acquire()
    try:
        with stopped_by_signals():
            job_plan, runs = simulate_roles(request.argv, nproc, nnodes, target)
            # aot_eager runs the compiled graphs by eager kernels: nothing fused.
            compiled = compiles_blocks(config) and config.compile.backend == "inductor"
            report = build_report(job_plan, target, runs, compiled)
            print(render(report))
            if not report["fits"]:
                print(fit_advice(job_plan, target, report))
            print(write(report, job_plan.config.job.dump_folder))
    except Stopped as stop:
        print(
            f"meshtrain: --simulate stopped by {stop}: its processes are ended; nothing was written.", file=sys.stderr
        )
        return 128 + stop.signum
    finally:
        lock.release()
    return 0 if report["fits"] else 2


def simulate_roles(
    argv: list[str], nproc: int, nnodes: int, target: Target, shorten: bool = True
) -> tuple[JobPlan, list[RoleRun]]:
    """The job's plan and one simulated rank of each role. ``shorten``: trace a few of the
    step's micro-batches (``microbatches.py``); off only to check that doing so changes nothing."""
    check_torch(("fake", "fsdp", "pipelining"))
    start_fork_server()
    args = [*argv, "--compile.enable=false", "--training.num_workers", "0"]
    figures = {"routing_imbalance": target.routing_imbalance}
    # ``auto`` settings resolve as on the target: bf16, the fused AdamW, and the loss chunked
    # only where the whole logits would not fit the target's memory.
    job_plan = prepare_plan(args, nproc * nnodes, target.name, figures=figures, limit=target.memory_bytes)
    real = schedule_count(job_plan)
    traced = traced_count(job_plan) if shorten else real
    # The traced plan differs from the job's only in settings.
    chunking = ["--training.loss_chunk_tokens", str(job_plan.loss_chunking.tokens)]
    traced_args = [*args, *_as_on_target(job_plan.config, target), *shortened_args(job_plan, traced), *chunking]
    traced_plan = resolve_job(load_config(traced_args), nproc * nnodes, figures=figures, limit=target.memory_bytes)
    if traced_plan.parallel.float8 is not None and target.name != "cpu":
        # The target's float8 matmuls, not this CPU's emulation of them: their FLOPs run at the float8 peak.
        traced_plan.parallel = replace(traced_plan.parallel, float8=replace(traced_plan.parallel.float8, emulate=False))
    # What the job holds for speed where it fits was decided for the target's GPU: the traced
    # plan's own estimate would be this CPU's.
    traced_plan = holding_as(traced_plan, job_plan.workload)
    # A compiled job's ops as it runs them, traced eagerly (compile's fusion is modelled).
    traced_plan.parallel = replace(traced_plan.parallel, fused_moe_combine=compiles_blocks(load_config(argv)))
    print(
        f"simulating {job_plan.dims.pp} role(s) of {job_plan.dims.world_size} ranks on fake tensors, "
        f"at most {traced} of the step's {real} micro-batches traced ...",
        file=sys.stderr,
        flush=True,
    )
    return job_plan, run_roles(traced_plan, nproc, real, shorten)


def _as_on_target(config: JobConfig, target: Target) -> list[str]:
    """Settings whose ``auto`` resolves by the device, as the target's GPU resolves them (this
    process runs on the CPU): bfloat16 parameters, and the fused AdamW, which makes no temporaries."""
    if target.name == "cpu":
        return []
    settings = []
    if config.training.mixed_precision_param == "auto":
        settings += ["--training.mixed_precision_param", "bfloat16"]
    if config.optimizer.implementation == "auto" and not config.debug.layout_invariant:
        settings += ["--optimizer.implementation", "fused"]
    return settings
