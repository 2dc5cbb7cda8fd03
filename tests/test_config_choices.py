"""The config declares its choices itself, so it loads without torch or the data stack; each layer
that implements a choice covers exactly the config's list."""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT

from parallelisms import context_parallel, pipeline_split
from trainer.config import choices
from trainer.data import samples


def test_the_config_loads_without_torch_or_the_data_stack():
    code = "import trainer.config, sys; assert 'torch' not in sys.modules and 'trainer.data' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_data_layer_covers_the_configs_dataset_kinds():
    assert samples.DATASET_KINDS == choices.DATASET_KINDS
    assert samples.PACKED_KINDS == choices.PACKED_DATASET_KINDS


def test_the_parallelisms_cover_the_configs_choices():
    assert context_parallel.BACKENDS == choices.CONTEXT_PARALLEL_BACKENDS
    assert pipeline_split.SCHEDULES == choices.PIPELINE_SCHEDULES


def test_the_hardware_table_covers_the_configs_gpus():
    from trainer import hardware

    assert tuple(hardware.GPUS) == choices.TARGET_GPUS
