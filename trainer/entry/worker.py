"""A training process: ``python -m trainer.entry.worker [--config FILE] [--mesh ...] [--section.key VALUE ...]``.

The whole run is prepare -> build -> loop. Everything that can be wrong with the config, the mesh,
the tokenizer, the data or the dump folder is checked while preparing (``trainer/entry/job.py``),
before the process group exists, so a mistake exits in seconds instead of hanging a collective;
rank 0 then locks the dump folder. Parallelism is applied to the model once, while building; the loop
itself is the algorithm: fetch the step's micro-batches, forward and backward each, finalize
the gradient, step, log.

Exit codes: 0 when the run finished or stopped on request (SIGTERM, Ctrl-C: after the current
step, with a checkpoint), 2 for a configuration error or a busy dump folder (before any process
group), 1 for a failure while running (divergence, a stalled rank, a full disk; the message says
what was kept and what to do), 130 when aborted by a second Ctrl-C. Those are the
:class:`~trainer.runtime.errors.UserError` family's; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from trainer.config import help_text
from trainer.entry.job import describe_job, parse_request, prepare
from trainer.runtime.dump_folder import TOKEN_ENV, DumpFolderLock, join, leave
from trainer.runtime.errors import ConfigError, UserError, report
from trainer.runtime.stop_requests import StopRequests, die_with_parent
from trainer.train import train

logger = logging.getLogger("meshtrain")


@record
def main(argv: list[str]) -> int:
    """Run the job; a bug's traceback also goes to torchrun's error file (``@record``), so the
    launcher can show it whichever rank it happened on."""
    logging.basicConfig(
        level=logging.INFO, format="[%(name)s] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    try:
        request = parse_request(argv)
        if request.mode == "help":
            print(help_text(request.argv))
            return 0
        if request.mode == "dry_run":
            world_size = int(os.environ.get("WORLD_SIZE", 1))
            describe_job(request, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
            return 0
        if request.mode == "simulate":
            raise ConfigError("`--simulate` runs in one process, without torchrun: use `./run_train.sh --simulate`.")
        stop = StopRequests()
        with stop.installed():
            outlive_no_launcher()
            return _main(request.argv, stop)
    except UserError as e:
        return report(e)
    except KeyboardInterrupt:
        print("meshtrain: aborted (no checkpoint of the current step)", file=sys.stderr)
        return 130


def _main(argv: list[str], stop: StopRequests) -> int:
    job = prepare(
        argv,
        int(os.environ.get("WORLD_SIZE", 1)),
        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device_index=int(os.environ.get("LOCAL_RANK", 0)),
        started=True,
    )
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        logger.info("memory estimate: %s", job.plan.memory.line())
        logger.info("loss: %s", job.plan.loss_chunking.line())
    folder, token = job.plan.config.job.dump_folder, os.environ.get(TOKEN_ENV)
    lock = DumpFolderLock(folder, token) if rank0 else None
    if lock is not None:
        lock.acquire()
    member = join(folder, token) if token else None  # the lock stays held while this process lives
    try:
        train(job.plan, job.dataset, stop, job.validation_dataset)
    finally:
        if member is not None:
            leave(member)
        if lock is not None:
            lock.release()
    return 0


def outlive_no_launcher() -> None:
    """End with torchrun: its death (``kill -9``) sends this process SIGTERM, a stop after the
    step with a checkpoint, so that no orphan trains on beside a rerun."""
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
