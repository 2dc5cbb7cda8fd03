"""Which ranks ``--simulate`` runs, each in a process of its own, several at a time.

The ranks of one pipeline stage differ only in which data and which shard they hold, so one
rank per stage stands for all of them. Each runs in a process of its own, so that no mesh,
process group or DTensor cache of one outlives it (a mesh equals any mesh of the same shape,
and torch caches by mesh), and several run at once, up to the cores this process may use. They
are forked from a fork server, a process that has imported the trainer and started no thread:
forked from a caller with threads (a test session, a notebook), a child can inherit a lock some
other thread held and wait for it forever.
Stage 0 starts first: the other stages learn their input shapes from the metadata it sends
before its first forward (``fake_job.PipelineMetadata``), so they start once it has.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from multiprocessing import forkserver
from multiprocessing.connection import wait
from multiprocessing.pool import AsyncResult
from multiprocessing.queues import SimpleQueue

from trainer.planning.job_plan import JobPlan
from trainer.runtime.stop_requests import stops_held, wait_result
from trainer.simulation.fake_job import PipelineMetadata, RoleRun, run_rank

MAX_PROCESSES = 4
"""At most this many simulated ranks at once: each holds a third of a GiB (405B's stages)."""


def start_fork_server() -> multiprocessing.context.BaseContext:
    """Start the fork server now (it imports the trainer, a few seconds), so that it can do so
    while the caller plans the job; the context to fork the ranks with."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    forkserver.ensure_running()
    return context


def rank_of_stage(plan: JobPlan, pp_rank: int) -> int:
    """The first global rank of pipeline rank ``pp_rank`` (pp is the mesh's outermost dimension)."""
    return pp_rank * (plan.dims.world_size // plan.dims.pp)


def run_roles(plan: JobPlan, gpus_per_node: int, real_microbatches: int, shorten: bool = True) -> list[RoleRun]:
    """One rank of every pipeline stage of ``plan``, simulated (see the module docstring);
    ``shorten``: a pipeline rank may trace fewer of ``plan``'s micro-batches (``microbatches.py``)."""
    context = start_fork_server()
    pp = plan.dims.pp
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = max(1, min(pp, MAX_PROCESSES, cores))
    start = time.monotonic()
    published = context.SimpleQueue()
    with contextlib.ExitStack() as ending:
        with stops_held():
            pool = ending.enter_context(context.Pool(processes, _worker_start, (published,), maxtasksperchild=1))
        first = pool.apply_async(_run_child, (plan, 0, gpus_per_node, real_microbatches, shorten, None, True))
        results: list[AsyncResult] = [first]
        if pp > 1:
            forward = _first_forward_metadata(published, first)
            results += [
                pool.apply_async(_run_child, (plan, stage, gpus_per_node, real_microbatches, shorten, forward, False))
                for stage in range(1, pp)
            ]
        runs = []
        for stage, result in enumerate(results):
            runs.append(wait_result(result))
            if pp > 1:
                print(f"  stage {stage} done ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    return runs


def _first_forward_metadata(published: SimpleQueue, first: AsyncResult) -> object:
    while published.empty():
        if first.ready():
            first.get()  # raises the stage's error
            raise RuntimeError("pipeline stage 0 finished without sending its forward metadata")
        time.sleep(0.2)
    return published.get()


_PUBLISHED: SimpleQueue | None = None
"""In a role's process: where stage 0 publishes its forward metadata."""


def _worker_start(published: SimpleQueue) -> None:
    """Each role process, as it starts: keep the queue, and end when the simulation's process
    does. The fork server and its children outlive a killed simulation otherwise: each holds the
    fork server's "a client is alive" pipe, so none of them sees it go; a role would trace on for
    minutes. Only SIGKILL needs this: SIGTERM and Ctrl-C end the pool (``trainer/entry/simulate.py``)."""
    global _PUBLISHED
    _PUBLISHED = published
    simulation = multiprocessing.parent_process()
    if simulation is not None:
        threading.Thread(target=_end_with, args=(simulation.sentinel,), daemon=True).start()


def _end_with(sentinel: int) -> None:
    wait([sentinel])
    os._exit(1)


def _run_child(
    plan: JobPlan,
    pp_rank: int,
    gpus_per_node: int,
    real_microbatches: int,
    shorten: bool,
    forward: object | None,
    publishes: bool,
) -> RoleRun:
    publish = _PUBLISHED.put if publishes and _PUBLISHED is not None else None
    metadata = PipelineMetadata(forward, publish)
    return run_rank(plan, rank_of_stage(plan, pp_rank), gpus_per_node, metadata, real_microbatches, shorten)
