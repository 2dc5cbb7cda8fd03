"""``./run_train.sh``: check the job once, start one training process per device, stop them well.

1. **Check before launching.** The config, the mesh for the world size about to be launched
   (``NGPU x NNODES``), the memory estimate, the tokenizer, the data and the dump folder
   (writable, not held by a running job) are checked in this one process. A mistake prints one
   message and exits 2 in seconds, before torchrun starts any worker. The dataset is tokenized
   here, so the workers find it in the token cache. ``--dry-run`` prints the plan and the
   memory estimate and exits.
2. **Launch.** torchrun (``python -m torch.distributed.run`` of this interpreter) runs in a
   session of its own, so Ctrl-C in the terminal reaches this launcher only.
3. **Stop well.** On SIGTERM or SIGINT the launcher writes the request into a stop file that
   every training process reads at its start and after every step (never signalling them, so
   none is killed while importing and restarted by torchrun): they finish the step, save a
   checkpoint (when checkpointing is on) and exit 0, and the launcher exits with 128 + the
   signal's number after one line saying how to resume. A request before any process exists
   holds for all of them, restarts included. A second signal stops torchrun, and so the job, at
   once. A stop that fails (its checkpoint cannot be written) exits with the job's error code
   and its cause, never the code of a successful stop.
4. **Say what failed.** The dump folder's lock is taken in step 1 and held until the job ends
   (rank 0 inherits it). torchrun keeps every rank's output in a private folder; when the job
   fails, the error of each rank whose output ``LOG_RANK`` hides is printed.

Environment (all optional): ``NGPU`` (processes on this node; the GPUs present, or 4 without
one), ``NNODES``, ``RDZV_ENDPOINT`` and ``RDZV_ID`` (multi-node), ``LOG_RANK`` (local ranks whose
output is shown), ``MAX_RESTARTS`` (torchrun restarts after a failure), ``CONFIG_FILE`` (like
``--config``, as torchtitan's launcher takes it), ``OMP_NUM_THREADS`` (CPU threads per process;
unset, each process gets an equal share of the idle cores: ``trainer/runtime/cpu_threads.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.config import help_text, load_config
from trainer.entry.job import Request, describe_job, parse_request, prepare
from trainer.entry.simulate import simulate
from trainer.metrics import CONSOLE_TTY_ENV
from trainer.replica_groups import check_lighthouse
from trainer.runtime.cpu_threads import thread_env
from trainer.runtime.dump_folder import TOKEN_ENV, DumpFolderLock, busy_message, is_stale, live_members, read_lock
from trainer.runtime.errors import BusyFolderError, ConfigError, UserError, report
from trainer.runtime.stop_requests import STOP_FILE_ENV, die_with_parent, wait_process
from trainer.simulation.targets import HELP as TARGET_HELP

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be a whole number.") from None
    if number < (0 if name == "MAX_RESTARTS" else 1):
        raise ConfigError(f"environment variable {name}={value} is out of range.")
    return number


def local_device_count() -> int:
    """GPUs on this node, or 4 CPU processes on a machine without one."""
    return listed_gpus() or 4


def listed_gpus() -> int:
    """GPUs on this node, as ``nvidia-smi -L`` lists them (0 without it)."""
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = sum(line.startswith("GPU") for line in listed.stdout.splitlines())
        if listed.returncode == 0:
            return gpus
    return 0


def planned_world(request: Request) -> tuple[int, int]:
    """``(processes per node, nodes)`` to plan or launch for: NGPU and NNODES when set; for
    ``--dry-run`` and ``--simulate`` on a machine without GPUs, the machine the config is sized
    for (``machine.*``), whose GPU then becomes the target unless ``--target-gpu`` names one."""
    nproc, nnodes = _env_int("NGPU", 0), _env_int("NNODES", 0)
    if request.mode in ("dry_run", "simulate") and not (nproc or nnodes or listed_gpus()):
        machine = load_config(request.argv).machine
        if machine.gpus_per_node:
            nproc, nnodes = machine.gpus_per_node, max(machine.nodes, 1)
            request.target_gpu = request.target_gpu or machine.gpu or None
            print(
                f"planning for the machine the config is sized for: {nnodes} node(s) x {nproc} "
                f"{(request.target or 'GPU').upper()} (`machine.*`); set NGPU and NNODES to plan for another.",
                file=sys.stderr,
                flush=True,
            )
    return nproc or local_device_count(), nnodes or 1


def training_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``CONFIG_FILE`` turned into ``--config`` (both at once is refused)."""
    config_file = os.environ.get("CONFIG_FILE", "")
    if not config_file:
        return argv
    if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        raise ConfigError(f"both CONFIG_FILE={config_file} and --config are given; give one of them.")
    return ["--config", config_file, *argv]


def log_ranks(nproc: int) -> str:
    """``LOG_RANK`` checked against this node's local ranks (torchrun would print nothing, or a
    traceback, for a rank that does not exist)."""
    value = os.environ.get("LOG_RANK", "0")
    fix = (
        f"NGPU={nproc} starts local ranks 0..{nproc - 1}; give comma-separated numbers in that range (e.g. LOG_RANK=0)."
    )
    try:
        ranks = [int(part) for part in value.split(",")]
    except ValueError:
        raise ConfigError(f"environment variable LOG_RANK={value} is not a list of local ranks: {fix}") from None
    if not all(0 <= rank < nproc for rank in ranks):
        raise ConfigError(f"environment variable LOG_RANK={value} names a local rank this node does not have: {fix}")
    return ",".join(map(str, ranks))


def hold_dump_folder(folder: str, nnodes: int) -> DumpFolderLock | None:
    """Take the dump folder's lock for the whole job (one node), so that of two jobs started
    together the second is refused here, before its torchrun; the workers inherit it. With
    several nodes each node's launcher only checks it: the job's rank 0 takes it."""
    if nnodes > 1:
        found = read_lock(folder)
        if found is not None and not is_stale(*found, folder):
            raise BusyFolderError(busy_message(folder, *found))
        return None
    lock = DumpFolderLock(folder, token=secrets.token_hex(16))
    lock.acquire()
    return lock


def torchrun_command(argv: list[str], nproc: int, nnodes: int, log_dir: Path, shown: str) -> list[str]:
    endpoint = os.environ.get("RDZV_ENDPOINT", "")
    if nnodes > 1 and not endpoint:
        raise ConfigError(
            f"NNODES={nnodes} needs RDZV_ENDPOINT=host:port of one node (and the same RDZV_ID on every node)."
        )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint or 'localhost:0'}",
        f"--rdzv_id={os.environ.get('RDZV_ID', 'meshtrain')}",
        f"--max-restarts={_env_int('MAX_RESTARTS', 0)}",
        f"--local-ranks-filter={shown}",
        f"--log-dir={log_dir}",
        "--role=rank",
        "--tee=3",
        "-m",
        "trainer.entry.worker",
        *argv,
    ]


class _StoppedBeforeLaunch(Exception):
    """A signal while the job was still being checked: nothing has started."""


def run(argv: list[str]) -> int:
    """Launch and wait; the exit code of the job (see the module docstring)."""
    request = parse_request(argv)
    if request.mode == "help":
        print(help_text(request.argv) + "\n\n" + TARGET_HELP)
        return 0
    nproc, nnodes = planned_world(request)
    if request.mode == "dry_run":
        describe_job(request, nproc * nnodes, nproc)
        return 0
    if request.mode == "simulate":  # one process on fake tensors: no torchrun, no rendezvous
        return simulate(request, nproc, nnodes)
    shown = log_ranks(nproc)
    received: list[int] = []
    torchrun: subprocess.Popen | None = None
    private = Path(tempfile.mkdtemp(prefix="meshtrain-"))
    stop_file = private / "stop"

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            # Read by every worker at start and after every step: workers not started yet, still
            # importing or restarted by torchrun find it too.
            stop_file.write_text(name)
            if torchrun is None and not launching:
                raise _StoppedBeforeLaunch(name)
            print(
                f"meshtrain: {name}: the training processes finish their step and stop"
                f"{' with a checkpoint' if checkpointing else ''}; send it again to stop at once.",
                file=sys.stderr,
                flush=True,
            )
        elif torchrun is not None:
            # At once: torchrun would wait 30 s for workers blocked in a collective or a save.
            kill_job(torchrun, lock)

    launching, checkpointing = False, True
    lock = None
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        command = torchrun_command(request.argv, nproc, nnodes, private / "logs", shown)
        threads = thread_env(os.environ, nproc)  # before checking: the check's own work is no load
        # Everything the workers would check, once, here (raises a UserError).
        job = prepare(request.argv, nproc * nnodes, local_ranks=nproc)
        job.resume_lines()  # a checkpoint of another model or other data, refused before any worker starts
        if job.plan.config.fault_tolerance.enable:
            check_lighthouse(job.plan.config.fault_tolerance)
        checkpointing = job.plan.config.checkpoint.enable
        lock = hold_dump_folder(job.plan.config.job.dump_folder, nnodes)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            # Workers write into torchrun's --tee files; their lines reach this process's stderr.
            CONSOLE_TTY_ENV: "1" if sys.stderr.isatty() else "0",
            STOP_FILE_ENV: str(stop_file),
            **threads,
            **({TOKEN_ENV: str(lock.token)} if lock is not None else {}),
        }
        launching = True
        torchrun = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)
        code = wait_process(torchrun)
    except _StoppedBeforeLaunch as stopped:
        shutil.rmtree(private, ignore_errors=True)
        print(f"meshtrain: stopped by {stopped} before any training process started.", file=sys.stderr)
        return 128 + received[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lock is not None:
            outlive_workers(lock, received, stop_file)
            lock.release()
    return outcome(code, received, checkpointing, private, shown)


def kill_job(torchrun: subprocess.Popen, lock: DumpFolderLock | None) -> None:
    """SIGKILL torchrun and every training process of the job (each in a session of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(torchrun.pid, signal.SIGKILL)
    for pid in live_members(lock.folder, lock.token) if lock is not None else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def outlive_workers(lock: DumpFolderLock, received: list[int], stop_file: Path) -> None:
    """Hold the lock until every training process of the job has ended: after torchrun died
    (``kill -9``) its workers stop after their step (``die_with_parent``, and the stop file for
    one not that far yet), still writing into the folder; a signal meanwhile kills them."""
    said, signals = False, len(received)
    while pids := live_members(lock.folder, lock.token):
        if not said:
            if not stop_file.exists():
                stop_file.write_text("the end of torchrun")
            print(
                f"meshtrain: torchrun has ended; waiting for the training processes {pids} to finish their step "
                "and stop (send a signal to kill them now).",
                file=sys.stderr,
                flush=True,
            )
            said = True
        if len(received) > signals:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def outcome(code: int, received: list[int], checkpointing: bool, private: Path, shown: str) -> int:
    """Say how the job ended and return the launcher's exit code: 128 + the signal's number for
    a stop that went as asked, the job's own code otherwise."""
    failures = failed_ranks(private / "logs")
    hidden = {rank: cause for rank, cause in failures.items() if str(rank) not in shown.split(",")}
    for rank, cause in hidden.items():
        print(f"meshtrain: local rank {rank} (not shown: LOG_RANK={shown}) failed: {cause}", file=sys.stderr)
    resume = (
        "rerun the same command to resume from the newest checkpoint."
        if checkpointing
        else "checkpointing is off (`checkpoint.enable`), so there is no checkpoint to resume from."
    )
    if received:
        name = signal.Signals(received[0]).name
        if len(received) > 1:
            print(
                f"meshtrain: stopped at once by a second {name}; the step in flight is lost; {resume}", file=sys.stderr
            )
            shutil.rmtree(private, ignore_errors=True)
            return 128 + received[0]
        if code != 0:
            cause = next(iter(failures.values()), "see the error above")
            print(
                f"meshtrain: {name} received, but the job failed while stopping (exit {code}): {cause} "
                f"Checkpoints written before are kept; the logs of every rank are in {private / 'logs'}.",
                file=sys.stderr,
            )
            return code if code > 0 else 1
        print(f"meshtrain: stopped by {name}; {resume}", file=sys.stderr)
    elif code != 0:
        # torchrun's own report (a ChildFailedError traceback) hides the cause: say it last.
        first = next((f"local rank {rank}: {cause}" for rank, cause in failures.items()), "see the output above.")
        print(
            f"meshtrain: the job failed (exit {code}): {first} The logs of every rank are in {private / 'logs'}.",
            file=sys.stderr,
        )
    if code == 0:
        shutil.rmtree(private, ignore_errors=True)
    return 128 + received[0] if received else code


def failed_ranks(log_dir: Path) -> dict[int, str]:
    """Local rank -> the error it ended with, from torchrun's logs of the newest attempt: the
    exception ``@record`` wrote, or the one-line error the worker printed."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: int(p.name.removeprefix("attempt_")))
    if not attempts:
        return {}
    failures: dict[int, str] = {}
    for folder in sorted((p for p in attempts[-1].iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        cause = _recorded_error(folder / "error.json") or _printed_error(folder / "stderr.log")
        if cause:
            failures[int(folder.name)] = cause
    return failures


def _recorded_error(path: Path) -> str | None:
    try:
        message = json.loads(path.read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    return f"{text.strip().splitlines()[-1] if text.strip() else 'an exception'} (traceback: {path})"


def _printed_error(path: Path) -> str | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines[-50:]):
        if line.startswith("meshtrain: ") and "error" in line.split(":", 2)[1]:
            return line.removeprefix("meshtrain: ")
    return None


def main(argv: list[str]) -> int:
    try:
        return run(training_argv(argv))
    except UserError as e:
        return report(e)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
