"""Weights & Biases as a destination of the logged scalars (``metrics.enable_wandb``, rank 0).

wandb's own environment decides where the run goes (``WANDB_MODE=offline`` writes it under the
dump folder for ``wandb sync``; ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_API_KEY``), so the
config holds no credentials. A resumed job continues the run it wrote (its id is kept in the
dump folder). The trainer's step is the chart's x-axis (``step``), not wandb's own counter:
steps a resumed job trains again are kept, as TensorBoard keeps them, instead of dropped as
out of order.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.runtime.errors import ConfigError, JobError

RUN_RECORD = "run-of-this-job.txt"
"""In ``<dump folder>/wandb``: the id of the run the job writes, continued when it resumes."""
STEP = "step"


def check_wandb_installed(enabled: bool) -> None:
    """Before any process group: the extra is there when the run would use it."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            '`metrics.enable_wandb` needs wandb: `pip install -e ".[wandb]"` (or `pip install wandb`), '
            "or turn it off with `--metrics.enable_wandb false`."
        )


class WandbSink:
    """One wandb run of this job, its config the job's resolved config."""

    name = "wandb"

    def __init__(self, dump_folder: Path, resumed: bool, run_config: Mapping[str, Any]):
        import wandb

        folder = dump_folder / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        record = folder / RUN_RECORD
        run_id = record.read_text().strip() if resumed and record.is_file() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "meshtrain"),
                name=dump_folder.resolve().name,
                id=run_id,
                resume="allow",
                dir=str(dump_folder),
                config=dict(run_config),
                # wandb would otherwise wrap stderr, where the launcher reads the job's one-line errors.
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:
            raise JobError(
                f"wandb could not start the run ({type(e).__name__}: {e}); `metrics.enable_wandb` needs wandb's "
                "login (`wandb login` or WANDB_API_KEY), or WANDB_MODE=offline to write it in the dump folder "
                "for `wandb sync`."
            ) from e
        record.write_text(run_id + "\n")
        self._open = True
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def where(self) -> str:
        if self.run.settings.mode == "offline":
            return f"offline run in {self.run.dir}; `wandb sync {Path(self.run.dir).parent}` uploads it"
        return str(self.run.url)

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log({**scalars, STEP: step})

    def close(self) -> None:
        if self._open:
            self._open = False
            self.run.finish()
