"""Every private torch name meshtrain uses, one module per concern, behind one version check.

torch changes its private API without notice, so each name is reached through the module of its
concern, and that module says on which torch releases it was checked (``CHECKED_ON``). Before any
process group exists, the trainer's plan calls :func:`check` with the concerns its job uses: a
torch outside what was checked stops the job with one line naming the feature and the range,
instead of an ``AttributeError`` on every rank minutes later. ``pyproject.toml``'s torch range is
the range checked here (``tests/test_torch_private.py`` keeps the two, and the inventory, true).

Concern modules import nothing heavy at module level beyond torch itself, so listing or checking
them costs nothing; ``tests/test_torch_private.py`` also fails when a private torch name is used
outside them.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

CONCERNS = ("fsdp", "dtensor", "pipelining", "fake", "process_group", "kernels", "dataloader", "checkpoint_storage")
"""The concern modules, each with ``FEATURE`` (what it serves, for the error) and ``CHECKED_ON``."""


class UnsupportedTorch(ValueError):
    """This torch is outside the releases a concern was checked on."""


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.13.0+cpu`` or ``2.14.0a0+git1``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorch(f"cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def supported_range(checked_on: tuple[str, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The first and last release a concern was checked on; the releases between are assumed."""
    releases = sorted(release(v) for v in checked_on)
    return releases[0], releases[-1]


def concern(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def problem(names: tuple[str, ...] = CONCERNS, version: str | None = None) -> str | None:
    """One line naming every concern in ``names`` this torch was not checked on, with the range
    that would serve them all; None when there is none."""
    import torch

    version = version or torch.__version__
    current = release(version)
    outside = []
    for name in names:
        module = concern(name)
        checked = supported_range(module.CHECKED_ON)
        if not checked[0] <= current <= checked[1]:
            outside.append((module.FEATURE, checked))
    if not outside:
        return None
    low = max(checked[0] for _, checked in outside)
    high = min(checked[1] for _, checked in outside)
    return (
        f"this is torch {version}, and {'; '.join(feature for feature, _ in outside)} reach torch internals "
        f"checked on torch {low[0]}.{low[1]} to {high[0]}.{high[1]} only: install a torch in that range "
        f"(pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}')"
    )


def check(names: tuple[str, ...] = CONCERNS) -> None:
    """Raise :class:`UnsupportedTorch` with :func:`problem`'s line, if there is one."""
    message = problem(names)
    if message is not None:
        raise UnsupportedTorch(message)
