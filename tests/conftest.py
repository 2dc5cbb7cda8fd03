"""Shared fixtures and the markers that pick subsets of the suite.

``pytest -m fast`` is the inner loop (about a minute): every test not marked ``slow``
(multi-process CPU runs) or ``launcher`` (through ``./run_train.sh``) is ``fast``.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(name) for name in ("slow", "launcher")):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def ref():
    """The single-process reference step of the harness's default batch, computed once per session."""
    from harness import GLOBAL_BATCH, argv_for, reference

    return reference(argv_for(GLOBAL_BATCH, []))
