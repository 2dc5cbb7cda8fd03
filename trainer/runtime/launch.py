"""``./run_train.sh``: check the job once, start one training process per device, stop them well.

1. **Check before launching.** The config, the mesh for the world size about to be launched
   (``NGPU x NNODES``), the memory estimate, the tokenizer, the data and the dump folder
   (writable, not held by a running job) are checked in this one process. A mistake prints one
   message and exits 2 in seconds, before torchrun starts any worker. The dataset is tokenized
   here, so the workers find it in the token cache. ``--dry-run`` prints the plan and the
   memory estimate and exits.
2. **Launch.** torchrun (``python -m torch.distributed.run`` of this interpreter) runs in a
   session of its own, so Ctrl-C in the terminal reaches this launcher only.
3. **Stop well.** On SIGTERM or SIGINT the launcher sends SIGTERM to the training processes
   (torchrun's children), never to torchrun itself: they finish the step, save a checkpoint and
   exit 0, torchrun ends without restarting anything, and the launcher exits with 128 + the
   signal's number after one line saying how to resume. A second signal stops torchrun, and so
   the job, at once.

Environment (all optional): ``NGPU`` (processes on this node; the GPUs present, or 4 without
one), ``NNODES``, ``RDZV_ENDPOINT`` and ``RDZV_ID`` (multi-node), ``LOG_RANK`` (local ranks whose
output is shown), ``MAX_RESTARTS`` (torchrun restarts after a failure), ``CONFIG_FILE`` (like
``--config``, as torchtitan's launcher takes it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from trainer.config import help_text
from trainer.metrics import CONSOLE_TTY_ENV
from trainer.runtime.dump_folder import busy_message, is_stale, read_lock
from trainer.runtime.errors import BusyFolderError, ConfigError, UserError, report
from trainer.runtime.job import Request, parse_request, prepare

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
    """GPUs on this node (``nvidia-smi -L``), or 4 CPU processes on a machine without one."""
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = sum(line.startswith("GPU") for line in listed.stdout.splitlines())
        if listed.returncode == 0 and gpus:
            return gpus
    return 4


def training_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``CONFIG_FILE`` turned into ``--config`` (both at once is refused)."""
    config_file = os.environ.get("CONFIG_FILE", "")
    if not config_file:
        return argv
    if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        raise ConfigError(f"both CONFIG_FILE={config_file} and --config are given; give one of them.")
    return ["--config", config_file, *argv]


def preflight(request: Request, nproc: int, nnodes: int) -> int:
    """Everything the workers would check, once, here (raises a UserError); with ``--dry-run``,
    print what the job would be and return its exit code."""
    if request.mode == "dry_run":
        lines: list[str] = []
        try:
            prepare(request.argv, nproc * nnodes, local_ranks=nproc, describe_to=lines)
        finally:
            print("\n".join(lines), flush=True)
        return 0
    job = prepare(request.argv, nproc * nnodes, local_ranks=nproc)
    found = read_lock(job.plan.config.job.dump_folder)
    if found is not None and not is_stale(*found):
        raise BusyFolderError(busy_message(job.plan.config.job.dump_folder, *found))
    return 0


def torchrun_command(argv: list[str], nproc: int, nnodes: int) -> list[str]:
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
        f"--local-ranks-filter={os.environ.get('LOG_RANK', '0')}",
        "--role=rank",
        "--tee=3",
        "-m",
        "trainer.train",
        *argv,
    ]


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the torchrun child: get SIGTERM if the launcher dies (Linux), so no job is orphaned."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        text = listed.stdout
    return [int(p) for p in text.split()]


def run(argv: list[str]) -> int:
    """Launch and wait; the exit code of the job (see the module docstring)."""
    request = parse_request(argv)
    if request.mode == "help":
        print(help_text(request.argv))
        return 0
    nproc, nnodes = _env_int("NGPU", 0) or local_device_count(), _env_int("NNODES", 1)
    if request.mode == "dry_run":
        return preflight(request, nproc, nnodes)
    command = torchrun_command(request.argv, nproc, nnodes)
    preflight(request, nproc, nnodes)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        # Workers write into torchrun's --tee files; their lines reach this process's stderr.
        CONSOLE_TTY_ENV: "1" if sys.stderr.isatty() else "0",
    }
    torchrun = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            print(
                f"meshtrain: {signal.Signals(signum).name}: the training processes finish their step "
                "and save a checkpoint (when checkpointing is on); send it again to stop at once.",
                file=sys.stderr,
                flush=True,
            )
            for pid in _children(torchrun.pid):
                os.kill(pid, signal.SIGTERM)
        else:
            os.killpg(torchrun.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = torchrun.wait()
    if received:
        print(
            f"meshtrain: stopped by {signal.Signals(received[0]).name}; rerun the same command to resume "
            "from the newest checkpoint.",
            file=sys.stderr,
        )
        return 128 + received[0]
    return code


def main(argv: list[str]) -> int:
    try:
        return run(training_argv(argv))
    except UserError as e:
        return report(e)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
