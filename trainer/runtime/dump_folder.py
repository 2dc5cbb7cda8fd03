"""The dump folder: checked before any process group exists, and held by one job at a time.

Everything a job writes (resolved config, TensorBoard logs, checkpoints) goes into
``job.dump_folder``. Two jobs writing into one folder overwrite each other's checkpoints and
mix their logs, and both would exit 0, so the job's rank 0 takes an exclusive lock on the
folder before the process group is created: the file ``.meshtrain.lock``, created with
``O_EXCL`` (atomic on local file systems and on NFSv3+, unlike ``flock``), holding the owner's
host, pid and start time. A heartbeat thread touches it every ``HEARTBEAT_S`` seconds.

A lock left behind by a job that died (``kill -9``, a lost node) must not block the folder
forever. It is *stale*, and taken over with a warning, when

* its owner ran on this host and that process no longer exists (checked at once, with the
  process start time guarding against a recycled pid), or
* its owner ran on another host and its heartbeat is older than ``STALE_AFTER_S`` seconds
  (another host's processes cannot be asked; clocks are assumed to agree within a minute).

A job stopped with ``kill -STOP`` on the same host keeps its lock: it can still be continued.

Under ``./run_train.sh`` the launcher takes the lock when it checks the folder and holds it for
the whole job, so of two jobs started at the same instant the second is refused before its
torchrun starts. The launcher hands the lock to its workers with a token (:data:`TOKEN_ENV`):
a rank 0 whose token matches the lock's inherits it instead of finding it busy, on its first
start and after every torchrun restart. Every worker also records itself beside the lock
(:func:`join`): the lock is not stale while a worker of its job lives on this host, even with its
launcher gone (``kill -9``), and the launcher releases it only once its workers have ended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.runtime.errors import BusyFolderError, ConfigError

logger = logging.getLogger("meshtrain")

LOCK_FILE = ".meshtrain.lock"
MEMBERS = ".meshtrain.lock.members"
"""Beside the lock: a file per live worker of the job holding it."""
TOKEN_ENV = "MESHTRAIN_LOCK_TOKEN"
"""Set by the launcher for its workers: the token of the lock it holds for them."""
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


def check_dump_folder(path: str) -> None:
    """Raise :class:`ConfigError` unless ``path`` is, or can be made, a writable folder.

    Runs on every rank before any process group exists, so a folder that is a file or not
    writable fails in seconds instead of after the model is built.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"`job.dump_folder` = {path!r} is a file, not a folder; point it at a folder.")
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"`job.dump_folder` = {path!r} is not a writable folder ({e.strerror or e}); "
            "point it at a folder this job can write to."
        ) from None


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to tell a live
    owner from an unrelated process that got its recycled pid; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) holds nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def describe_holder(holder: dict[str, Any], heartbeat_age_s: float) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} (started {started}, "
        f"last heartbeat {heartbeat_age_s:.0f} s ago)"
    )


def read_lock(folder: str | Path) -> tuple[dict[str, Any], float] | None:
    """``(owner, heartbeat age in seconds)`` of the lock on ``folder``, or None without one."""
    path = Path(folder) / LOCK_FILE
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = {}  # being written right now, or damaged: judged by its age alone
    return holder, age


def _lives(process: dict[str, Any]) -> bool:
    """Whether a process recorded on this host as ``{pid, pid_start}`` still runs (not a recycled pid)."""
    pid = process.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return False
    recorded, current = process.get("pid_start"), _process_start(pid)
    return recorded is None or current is None or recorded == current


def join(folder: str | Path, token: str) -> Path:
    """Record this worker of the job whose lock holds ``token``; remove the file it returns when
    the worker ends (one left by a killed worker is judged by its pid)."""
    members = Path(folder) / MEMBERS
    members.mkdir(exist_ok=True)
    me = members / f"{socket.gethostname()}-{os.getpid()}.json"
    me.write_text(
        json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()), "token": token}
        )
    )
    return me


def leave(member: Path) -> None:
    """Remove a worker's record; on a folder that broke mid-run one left behind is judged by its
    pid, so the error the job ends with stays the folder's, not this cleanup's."""
    with contextlib.suppress(OSError):
        member.unlink(missing_ok=True)


def live_members(folder: str | Path, token: str | None) -> list[int]:
    """The pids of this host's live workers of the job whose lock holds ``token``."""
    if not token:
        return []
    pids = []
    for path in sorted((Path(folder) / MEMBERS).glob(f"{socket.gethostname()}-*.json")):
        try:
            member = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if member.get("token") == token and _lives(member):
            pids.append(member["pid"])
    return pids


def is_stale(holder: dict[str, Any], heartbeat_age_s: float, folder: str | Path | None = None) -> bool:
    """Whether the lock's owner is gone, and with it every worker of its job on this host (see the
    module docstring)."""
    if folder is not None and live_members(folder, holder.get("token")):
        return False
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not _lives(holder)
    return heartbeat_age_s > STALE_AFTER_S


def busy_message(folder: str | Path, holder: dict[str, Any], heartbeat_age_s: float) -> str:
    workers = live_members(folder, holder.get("token"))
    if workers and not (holder.get("host") == socket.gethostname() and _lives(holder)):
        return (
            f"`job.dump_folder` = {str(folder)!r} is in use by the training processes {workers} of a job whose "
            f"launcher is gone ({describe_holder(holder, heartbeat_age_s)}): they are stopping after their step; "
            "wait for them to end (or kill them), or give this job another `--job.dump_folder`."
        )
    return (
        f"`job.dump_folder` = {str(folder)!r} is in use by another job: {describe_holder(holder, heartbeat_age_s)}. "
        "Wait for it or stop it, or give this job another `--job.dump_folder`. A lock left by a job "
        f"that died ({Path(folder) / LOCK_FILE}) is taken over automatically: at once on the same "
        f"host, after {STALE_AFTER_S:.0f} s without a heartbeat from another host."
    )


class DumpFolderLock:
    """The exclusive claim of one job on its dump folder; ``acquire`` before the process group."""

    def __init__(self, folder: str | Path, token: str | None = None):
        """``token``: a job's shared secret; a lock holding the same one is this job's already
        (taken by its launcher), and is inherited rather than refused."""
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "started": time.time(),
            "command": " ".join(sys.argv),
            "token": token,
        }
        self.token = token
        self.inherited = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock (or inherit it, see ``token``), or raise :class:`BusyFolderError` naming
        the job that holds it."""
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                found = read_lock(self.folder)
                if self.token and found is not None and found[0].get("token") == self.token:
                    self.inherited = True  # its holder, this job's launcher, keeps the heartbeat
                    return
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(self._owner, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self._heartbeat = threading.Thread(target=self._beat, name="dump-folder-lock", daemon=True)
            self._heartbeat.start()
            return
        raise BusyFolderError(f"could not take the lock {self.path}: other jobs keep claiming it; try again.")

    def _take_over_if_stale(self) -> None:
        found = read_lock(self.folder)
        if found is None:
            return  # released meanwhile: try again
        holder, age = found
        if not is_stale(holder, age, self.folder):
            raise BusyFolderError(busy_message(self.folder, holder, age))
        # Move the stale lock aside, then check that what moved is what was judged stale: a job
        # racing for the same stale lock may have replaced it with its own live one.
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (OSError, json.JSONDecodeError):
            moved = {}
        if moved != holder:
            os.rename(aside, self.path)
            raise BusyFolderError(busy_message(self.folder, moved, 0.0))
        aside.unlink(missing_ok=True)
        logger.warning(
            "took over the lock on %s from a job that is gone: %s", self.folder, describe_holder(holder, age)
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError as e:
                logger.error("cannot refresh the dump-folder lock %s (%s)", self.path, e.strerror or e)

    def release(self) -> None:
        """Remove the lock if this process took it and it is still this job's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self.inherited:
            return
        try:
            found = read_lock(self.folder)
            if (
                found is not None
                and found[0].get("pid") == self._owner["pid"]
                and found[0].get("host") == self._owner["host"]
            ):
                self.path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning(
                "could not remove the dump-folder lock %s (%s); the next job on this folder takes it over",
                self.path,
                e.strerror or e,
            )
