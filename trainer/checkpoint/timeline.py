"""Timelines: which ``step-N`` folders are the run's history, and where a rollback puts the rest.

The checkpoint folder holds one timeline at a time, so that "the newest checkpoint" always means
the newest save of the history being trained. A run that continues from anything but the newest
checkpoint (a rollback with ``checkpoint.load_step``, or a fall-back past checkpoints that cannot
be loaded) begins a new timeline: every ``step-N`` newer than its starting point is moved into
``abandoned-<UTC time>/`` beside them (never deleted, so a rollback can itself be undone by moving
them back), and ``timeline.json`` records the new timeline, what started it and what it set
aside. Without that, the abandoned ``step-60`` would stay the newest: a resume would return to
it, and rotation (``keep_latest_k``) would delete every new save as "older".

A timeline begun by ``checkpoint.load_step = N`` remembers ``N``: rerunning the same command
continues that timeline from its newest save instead of rolling back to step-N again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.location import Location, display, location, move, replace_file
from trainer.runtime.errors import CheckpointError

logger = logging.getLogger("meshtrain")

TIMELINE_FILE = "timeline.json"
ABANDONED_PREFIX = "abandoned-"


@dataclass(frozen=True)
class Timeline:
    """One history of the run: where it began and what it set aside when it did."""

    id: int = 1
    from_step: int | None = None
    """The step it continues from; None when it started from scratch."""
    load_step: int | None = None
    """The ``checkpoint.load_step`` that began it (or the timeline it continues after a fall-back)."""
    set_aside: dict[str, str] = field(default_factory=dict)
    """``step-N`` folder -> why it no longer belongs to the history."""
    abandoned_folder: str | None = None
    started: str = ""

    def describe(self) -> str:
        """``timeline 2, rolled back from step-60 to step-20 by `checkpoint.load_step```, and the like."""
        text = f"timeline {self.id}"
        if self.id == 1 and self.from_step is None:
            return text
        start = "scratch" if self.from_step is None else f"step-{self.from_step}"
        if self.load_step is not None and self.load_step == self.from_step:
            newest = max(self.set_aside, key=_step_of, default=None)
            source = f" from {newest}" if newest else ""
            text += f", rolled back{source} to {start} by `checkpoint.load_step`"
        elif self.set_aside:
            text += f", from {start} after {', '.join(sorted(self.set_aside, key=_step_of))} could not be loaded"
        else:
            text += f", from {start}"
        if self.abandoned_folder:
            text += f"; set aside in {self.abandoned_folder}/"
        return text


def _step_of(name: str) -> int:
    return int(name.rpartition("-")[2])


def read_timelines(folder: Location) -> list[Timeline]:
    """Every timeline of ``folder``, oldest first; one implicit timeline when none was recorded.

    A damaged ``timeline.json`` is an error: guessing would decide which checkpoints are newest.
    """
    file = folder / TIMELINE_FILE
    if not file.is_file():
        return [Timeline()]
    try:
        entries = json.loads(file.read_text())["timelines"]
        timelines = [Timeline(**entry) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{file} cannot be read ({type(e).__name__}: {e}); it records which checkpoints belong to the "
            "current history. Restore it, or move it away to treat every step-N folder there as one timeline."
        ) from e
    return timelines or [Timeline()]


def current_timeline(folder: Location) -> Timeline:
    return read_timelines(folder)[-1]


def begin_timeline(
    folder: Location, *, from_step: int | None, load_step: int | None, set_aside: dict[Location, str]
) -> Timeline:
    """Move ``set_aside`` into a new ``abandoned-*`` folder and record a new timeline (rank 0 only).

    Raises ``CheckpointError`` naming the folder when the moves or the record cannot be written
    (a read-only disk); whatever was moved stays where it is, intact.
    """
    past = read_timelines(folder)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    abandoned = None
    if set_aside:
        abandoned = folder / f"{ABANDONED_PREFIX}{stamp}"
        suffix = 1
        while abandoned.exists():
            suffix += 1
            abandoned = folder / f"{ABANDONED_PREFIX}{stamp}-{suffix}"
    timeline = Timeline(
        id=past[-1].id + 1,
        from_step=from_step,
        load_step=load_step,
        set_aside={path.name: why for path, why in sorted(set_aside.items(), key=lambda item: _step_of(item[0].name))},
        abandoned_folder=abandoned.name if abandoned else None,
        started=stamp,
    )
    try:
        if abandoned is not None:
            abandoned.mkdir(exist_ok=True)
            for path in set_aside:
                move(path, abandoned / path.name)
        record = json.dumps({"timelines": [dataclasses.asdict(t) for t in [*past, timeline]]}, indent=1)
        replace_file(folder / TIMELINE_FILE, record)
    except OSError as e:
        raise CheckpointError(
            f"cannot begin a new timeline in {display(folder)} ({type(e).__name__}: {e}): the checkpoints newer than the "
            "one loaded must be moved aside first, so that later resumes do not return to them. Make the "
            "folder writable, then rerun."
        ) from e
    return timeline


def reasons(rejected: dict[str, str]) -> str:
    """``step-60: why; step-40: why`` for checkpoint folders that cannot be loaded."""
    return "; ".join(f"{Path(path).name}: {why}" for path, why in rejected.items())


def candidates(folder: Location, load_step: int) -> tuple[list[Location], bool]:
    """The checkpoints to try, newest first, and whether ``load_step`` continues the timeline
    it began (then its newest save is wanted, not step-``load_step`` again)."""
    found = step_folders(folder)
    if load_step < 0:
        return [p for _, p in reversed(found)], False
    timeline = current_timeline(folder)
    ours = [p for step, p in reversed(found) if step >= load_step]
    if timeline.load_step == load_step and ours:
        logger.info(
            "`checkpoint.load_step` = %d began %s: continuing it from its newest checkpoint (to roll back to "
            "step-%d again, move the newer step-N folders out of %s)",
            load_step,
            timeline.describe(),
            load_step,
            display(folder),
        )
        return ours, True
    exact = [p for step, p in found if step == load_step]
    if not exact:
        raise CheckpointError(
            f"`checkpoint.load_step` = {load_step}: no folder step-{load_step} in {display(folder)}; found "
            f"{[p.name for _, p in found] or 'none'}."
        )
    return exact, False


def follow(folder: Location, loaded: Location, load_step: int, rejected: dict[str, str]) -> Timeline:
    """The timeline of a run that has loaded ``loaded``: the current one, or (after a rollback
    or a fall-back past ``rejected`` checkpoints) a new one, every newer checkpoint moved aside."""
    step = int(loaded.name.removeprefix("step-"))
    timeline = current_timeline(folder)
    rolling_back = load_step >= 0 and timeline.load_step != load_step
    newer = {
        p: rejected.get(str(p), f"newer than `checkpoint.load_step` = {load_step}")
        for s, p in step_folders(folder)
        if s > step
    }
    if not rolling_back and not newer:
        return timeline
    began = begin_timeline(
        folder, from_step=step, load_step=load_step if load_step >= 0 else timeline.load_step, set_aside=newer
    )
    if newer:
        logger.warning(
            "%s: moved %s into %s (nothing deleted; move them back to undo)",
            began.describe(),
            ", ".join(began.set_aside),
            display(folder / str(began.abandoned_folder)),
        )
    return began


def start_over(folder: Location, rejected: dict[str, str], start: str) -> Timeline:
    """No checkpoint loads: warn, naming each and why, and move them aside (a new timeline
    from scratch), so that rotation never deletes them and later resumes do not retry them."""
    began = begin_timeline(
        folder, from_step=None, load_step=None, set_aside={location(p): why for p, why in rejected.items()}
    )
    logger.warning(
        "no checkpoint in %s can be loaded (%s): starting %s as timeline %d; moved them into %s (nothing deleted)",
        display(folder),
        reasons(rejected),
        start,
        began.id,
        display(folder / str(began.abandoned_folder)),
    )
    return began
