"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): exact resume on any mesh, crash-safe.

A checkpoint is the folder ``{job.dump_folder}/{checkpoint.folder}/step-N`` (torchtitan's
layout) holding the model, optimizer, LR scheduler, data-loader position and train state
(step, skipped-step count, RNG). DCP stores global tensors, so a checkpoint saved on one mesh
loads on any other: FSDP, HSDP, TP, CP, another world size. Because the global batch of a step
depends only on the step (see ``trainer/data/loader.py``), training then continues with the same
data, and in float32 on CPU with the same losses as a run that never stopped.

Crash safety: every rank writes into ``step-N.partial``; DCP writes its metadata after all
ranks have written, then the checksum manifest, then rank 0 renames the folder to ``step-N``
(one atomic rename). A kill during a save leaves a ``.partial`` folder, which is never loaded
and is removed when the next job starts on the folder (the dump-folder lock guarantees that no
live job is writing it). Loading checks every ``step-N`` before trusting it: metadata readable,
every file present, as long as recorded and matching its checksum (each rank verifies a share
of the files). A failing checkpoint is skipped with a warning naming it and the file, and the
next older one is tried; checkpoints passed over that way, and those after a rollback with
``load_step``, are moved aside into a new timeline (``timeline.py``), so that the next resume
continues the run that trains now. A checkpoint that cannot serve this run (a ``load_step`` that
is missing or damaged, another model, other data, an unusable ``initial_load_path``) raises
``CheckpointError``, a ``JobError``: one line, exit 1, nothing deleted.

Nothing non-finite is published: before a save every rank checks its weights and optimizer
state, and a NaN or infinity fails the job with the older checkpoints left alone. A save the
disk refuses (full, read-only) says so in one line, removes its partial folder and keeps the
older checkpoints too (``save_failures.py``); rotation (``keep_latest_k``) never deletes the
save just written. The folder itself (layout, the whole-or-not check, ``model_args.json``) is
``trainer/checkpoint/folders.py``'s; writing a save is ``writer.py``'s; checksums and the finite
check are ``integrity.py``'s; what
DCP saves of the model and optimizer is ``states.py``'s; starting weights from a Hugging Face
folder are ``hf_load.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint.agreement import agree
from trainer.checkpoint.folders import checkpoint_problem, is_model_only, remove_partial_folders
from trainer.checkpoint.hf_load import load_hf_weights
from trainer.checkpoint.integrity import (
    LAYOUT_DEPENDENT,
    MANIFEST_FILE,
    checksum_problem,
    read_manifest,
    written_layout_invariant,
)
from trainer.checkpoint.location import Location, dcp_reader, display, location
from trainer.checkpoint.resume_fit import check_same_model, data_changes, other_data, schedule_line
from trainer.checkpoint.states import (
    Checkpointed,
    ModelState,
    OptimizerState,
    optimizer_groups_flattened,
    optimizer_name,
)
from trainer.checkpoint.timeline import Timeline, candidates, follow, reasons, start_over
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import Checkpoint
from trainer.muon import Muon
from trainer.runtime.errors import CheckpointError, UserError
from trainer.runtime.weights_fence import WeightsFence

logger = logging.getLogger("meshtrain")


class CheckpointManager:
    """Saves on schedule, resumes at start; one object for the training loop to call."""

    def __init__(
        self,
        config: Checkpoint,
        dump_folder: str,
        run: Checkpointed,
        *,
        timeout_s: float = 1800.0,
        layout_invariant: bool = False,
        fence: WeightsFence | None = None,
    ):
        self.config = config
        self.layout_invariant = layout_invariant
        self.folder = location(config.folder, base=dump_folder)
        self.run = run
        self.model, self.model_args, self.train_state = run.model, run.model_args, run.train_state
        self.schedule = run.lr_scheduler.settings()
        self.optimizer_state = OptimizerState(run.model, run.optimizer)
        self.states: dict[str, Stateful] = {
            "model": ModelState(run.model),
            "optimizer": self.optimizer_state,
            "lr_scheduler": run.lr_scheduler,
            "dataloader": run.dataloader,
            "train_state": run.train_state,
        }
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Checkpoint collectives get a CPU group of their own: async saves run them from a
        # background thread, where they must not interleave with the training's collectives,
        # and a save may take far longer than a training step, so it keeps its own timeout
        # (`comm.init_timeout_seconds`) when the training groups get a shorter one.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.writer = CheckpointWriter(config, self.folder, run, self.states, self.group, layout_invariant, fence)

    # ----------------------------------------------------------------------------------- load

    def load(self) -> int:
        """Restore the newest checkpoint of the current timeline (or ``load_step``'s); return the
        step to resume after.

        With no checkpoint that loads (or with checkpoints disabled), ``initial_load_path`` (if
        set) provides the starting weights. Returns 0 when training starts from scratch or from
        weights only. Raises ``CheckpointError`` for a checkpoint that cannot serve this run.
        """
        if not self.config.enable:
            return self._initial_load(location(self.config.initial_load_path)) if self.config.initial_load_path else 0
        choice, rejected = self._choose_checkpoint()
        if choice is None:
            self._start_over(rejected)
            return self._initial_load(location(self.config.initial_load_path)) if self.config.initial_load_path else 0
        path = location(choice)
        self._check_same_model(path, "checkpoint")  # another model is never a matter of its data
        if is_model_only(path):
            self._load(path, keys=("model",))
            timeline = self._follow(path, rejected)
            logger.info("loading weights from %s (model-only checkpoint; %s)", display(path), timeline.describe())
            return 0
        keys = tuple(k for k in self.states if k not in self.config.exclude_from_loading)
        if "dataloader" in keys:
            self._check_same_data(path)
        self._load(path, keys=keys)
        self._warn_if_layout_dependent(path)
        timeline = self._follow(path, rejected)
        logger.info("resuming from %s (%s): %s", display(path), timeline.describe(), ", ".join(keys))
        self._say_schedule_change(path, keys)
        return self.train_state.step

    def _choose_checkpoint(self) -> tuple[str | None, dict[str, str]]:
        """The newest checkpoint of the timeline that passes every check (or ``load_step``'s),
        the same on every rank, and the newer ones that failed (folder -> why)."""
        paths, continuing = self._agree(self._candidates)
        rejected: dict[str, str] = {}
        for path in map(location, paths):
            problem = self._problem(path)
            if problem is None:
                return str(path), rejected
            if self.config.load_step >= 0 and not continuing:
                raise CheckpointError(f"`checkpoint.load_step`: {display(path)} cannot be loaded: {problem}.")
            if self.rank == 0:
                logger.warning("skipping checkpoint %s: %s", display(path), problem)
            rejected[str(path)] = problem
        if continuing:
            raise CheckpointError(
                f"`checkpoint.load_step` = {self.config.load_step} began the current timeline of {display(self.folder)}, "
                f"but none of its checkpoints can be loaded ({reasons(rejected)}); pass an older `load_step`."
            )
        return None, rejected

    def _candidates(self) -> tuple[list[str], bool]:
        """Rank 0: remove what dead jobs left half-written, then list the checkpoints to try."""
        for stale in remove_partial_folders(self.folder):
            logger.warning("removed %s, left by a save that never finished", display(stale))
        paths, continuing = candidates(self.folder, self.config.load_step)
        return [str(p) for p in paths], continuing

    def _follow(self, path: Location, rejected: dict[str, str]) -> Timeline:
        """The timeline this run trains, decided by rank 0 once ``path`` has loaded."""
        return self._agree(lambda: follow(self.folder, path, self.config.load_step, rejected))

    def _start_over(self, rejected: dict[str, str]) -> None:
        """Checkpoints exist but none loads: rank 0 says so loudly and moves them aside."""
        if rejected:
            start = "from `checkpoint.initial_load_path`" if self.config.initial_load_path else "FROM SCRATCH"
            self._agree(lambda: start_over(self.folder, rejected, start))

    def _problem(self, path: Location) -> str | None:
        """Why ``path`` must not be loaded, agreed by every rank: rank 0 checks its structure,
        then each rank verifies the checksums of its share of the files."""
        problem = self._agree(lambda: checkpoint_problem(path))
        if problem is not None:
            return problem
        found: list[str | None] = [None] * self.world_size
        dist.all_gather_object(found, checksum_problem(path, self.rank, self.world_size), group=self.group)
        problem = next((p for p in found if p is not None), None)
        if problem is None and self.rank == 0 and read_manifest(path) is None:
            logger.warning(
                "%s has no %s (written by a version without checksums): its contents are not verified",
                display(path),
                MANIFEST_FILE,
            )
        return problem

    def _check_same_data(self, path: Location) -> None:
        """Refuse to continue a checkpoint's data stream on other data, unless allowed."""
        differ = self._agree(lambda: data_changes(path, self.run.data_identity))
        if not differ:
            return
        if not self.config.allow_data_change:
            raise other_data(path, differ)
        if self.rank == 0:
            logger.warning(
                "resuming %s on changed data (`checkpoint.allow_data_change`): %s", display(path), "; ".join(differ)
            )

    def _agree(self, decide: Callable[[], Any]) -> Any:
        return agree(decide, self.group)

    def _load(self, path: Location, keys: tuple[str, ...]) -> None:
        """Load ``keys`` of ``path``, whose model :meth:`_check_same_model` has found this run's."""
        if "optimizer" in keys:
            self._check_same_optimizer(path)
            self.optimizer_state.flatten = optimizer_groups_flattened(path)
        try:
            dcp.load({k: self.states[k] for k in keys}, storage_reader=dcp_reader(path), process_group=self.group)
        finally:
            self.optimizer_state.flatten = True  # what this run saves

    def _check_same_optimizer(self, path: Location) -> None:
        """Refuse to load one optimizer's state into the other: DCP would stop at the first
        missing moment with every rank's traceback."""
        ours = "Muon" if isinstance(self.run.optimizer, Muon) else "AdamW"
        theirs = self._agree(lambda: optimizer_name(path))
        if theirs not in (None, ours):
            raise CheckpointError(
                f"{display(path)} holds {theirs}'s optimizer state, and this run's `optimizer.name` is {ours}: set "
                f'`optimizer.name` = "{theirs}" to resume it, or add `optimizer` to `checkpoint.exclude_from_loading` '
                f"to start {ours} afresh from its weights."
            )

    def _check_same_model(self, path: Location, what: str) -> None:
        """Refuse another model's checkpoint in one line (``resume_fit.check_same_model``)."""
        self._agree(lambda: check_same_model(path, self.model_args, what))

    def _say_schedule_change(self, path: Location, keys: tuple[str, ...]) -> None:
        """A resume keeps this run's LR schedule (``LRSchedule``): say so where it is another."""
        if "lr_scheduler" not in keys or self.rank != 0:
            return
        change = schedule_line(path, self.schedule, self.train_state.step)
        if change is not None:
            logger.warning("resuming %s: %s", display(path), change)

    def _warn_if_layout_dependent(self, path: Location) -> None:
        """A ``debug.layout_invariant`` run resuming a default-mode state is allowed (runs resumed
        from the same checkpoint still agree bit for bit) but its promise is narrower: say so."""
        if self.layout_invariant and self.rank == 0 and not written_layout_invariant(path):
            logger.warning(LAYOUT_DEPENDENT, display(path))

    def _initial_load(self, path: Location) -> int:
        what = "`checkpoint.initial_load_path`:"
        if self.config.initial_load_in_hf:
            try:
                load_hf_weights(self.model, self.model_args, Path(str(path)))  # local: the plan refuses a URL
            except UserError as error:
                raise CheckpointError(f"{what} {error}") from error
            return 0
        problem = self._problem(path)
        if problem:
            raise CheckpointError(f"{what} {display(path)} cannot be loaded: {problem}.")
        self._check_same_model(path, what)
        if self.config.initial_load_model_only or is_model_only(path):
            logger.info("loading weights from %s", display(path))
            self._load(path, keys=("model",))
            return 0
        logger.info("starting from the full state of %s", display(path))
        self._load(path, keys=tuple(self.states))
        self._warn_if_layout_dependent(path)
        self._say_schedule_change(path, tuple(self.states))
        return self.train_state.step

    # ----------------------------------------------------------------------------------- save

    def maybe_save(self, step: int, *, stopping: bool = False) -> bool:
        """Save every ``interval`` steps, at the last step, and when the job is stopping
        (SIGTERM, Ctrl-C); publish a finished async save. Whether it saved (or began to)."""
        if not self.config.enable:
            return False
        self.writer.finish_pending(wait=False)
        last = step == self.run.total_steps
        if step % self.config.interval and not last and not stopping:
            return False
        self.save(step, model_only=last and self.config.last_save_model_only)
        return True

    def save(self, step: int, *, model_only: bool = False) -> None:
        self.writer.save(step, model_only=model_only)

    def close(self) -> None:
        """Wait for an async save still in flight."""
        self.writer.close()
