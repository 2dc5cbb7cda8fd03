"""Shared fixtures and the markers that pick subsets of the suite.

``pytest -m fast`` is the inner loop (under 2 minutes): every test not marked ``slow``
(multi-process CPU runs) or ``launcher`` (through ``./run_train.sh``) is ``fast``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from trainer.model.llama3 import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
# ./run_train.sh runs $PYTHON (scripts/find_python.sh): the interpreter running the tests, also
# when its virtual environment is not activated.
os.environ.setdefault("PYTHON", sys.executable)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(name) for name in ("slow", "launcher")):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def ref():
    """The single-process reference step of the harness's default batch, computed once per session."""
    from harness import GLOBAL_BATCH, argv_for, reference

    return reference(argv_for(GLOBAL_BATCH, []))


@pytest.fixture(scope="module")
def vocab_size() -> int:
    """The test tokenizer's vocabulary, which sizes the debug model of test_model*.py."""
    from harness import MODEL_TOKENIZER

    from trainer.data.tokenizer import load_tokenizer

    return load_tokenizer(MODEL_TOKENIZER).vocab_size


@pytest.fixture(scope="module")
def debug_args(vocab_size: int) -> ModelArgs:
    from harness import MODEL_SEQ_LEN

    from trainer.model.llama3 import model_args

    return model_args("debugmodel", vocab_size, MODEL_SEQ_LEN)


@pytest.fixture(scope="module")
def debug_model(debug_args: ModelArgs) -> Transformer:
    from harness import MODEL_SEED

    from trainer.model.llama3 import Transformer

    model = Transformer(debug_args)
    model.init_weights(MODEL_SEED)
    return model


@pytest.fixture
def lighthouse():
    """A lighthouse that forms a quorum of any one group, waits for a group that heartbeats
    but has not asked yet (a peer mid-step), and gives a silent group up after a second."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=30_000, quorum_tick_ms=20, heartbeat_timeout_ms=1_000
    )
    yield server.address()
    server.shutdown()
