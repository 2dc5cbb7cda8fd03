"""What the tests share: a rank launcher, the single-process reference step, the trainer's own
step run on any mesh, and the ``./run_train.sh`` launcher with its TensorBoard read-back.

The promise under test: for a fixed global batch, every mesh and accumulation count gives the
same loss and the same gradients as one process computing ``sum of token losses / N`` on the
whole batch. The data is ``shakespeare_dialogue``: prompts and padding are masked, so valid-token
counts differ between micro-batches and ranks, which is what makes the classic bugs visible.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from step_helpers import fetch_step, forward_backward, part_of, trainer_for

from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.data.loader import global_order
from trainer.entry.job import prepare
from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model.llama3 import Transformer
from trainer.planning.job_plan import resolve_job
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.part import StepResult
from trainer.train import train
from trainer.training import Training

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the debug model's initial true grad norm, so clipping is exercised
TOLERANCE = 5e-6
MODEL_TOKENIZER = str(ROOT / "assets" / "tokenizer" / "shakespeare.model")
"""The tokenizer that sizes the debug model of the model tests (``conftest.py``'s ``debug_model``)."""
MODEL_SEQ_LEN = 32
MODEL_SEED = 1234

BASE_ARGV = [
    "--training.dataset",
    "shakespeare_dialogue",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    str(GLOBAL_BATCH),
    "--training.max_norm",
    str(MAX_NORM),
    "--training.steps",
    "1",
    "--debug.seed",
    "7",
    "--metrics.enable_tensorboard=false",
    # Chunks of the output projection and loss that cut micro-batches (64 to 512 tokens) unevenly,
    # against the reference's whole logits (last: argv_for drops them).
    *("--training.loss_chunk_tokens", "48"),
]

QUICK = [
    "--validation.enable=false",  # validation is tested on its own (test_validation, test_run_train)
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
]
"""A short job's settings (no validation, a line per step), which the fault and stop-request
tests lengthen as they need."""


# --------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
WORKER_PORTS = 1000


def free_port() -> int:
    """A port nobody holds now. Under xdist, from the worker's own range below the kernel's
    ephemeral ports, so that another worker's ``localhost:0`` listener cannot take it between
    this check and the store binding it (where the kernel leaves no room below them, port 0)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    first_ephemeral = int(EPHEMERAL.read_text().split()[0]) if EPHEMERAL.is_file() else 32768
    low = first_ephemeral - WORKER_PORTS * (int(worker[2:]) + 1) if worker.startswith("gw") else 0
    if low < 1024:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.sample(range(low, low + WORKER_PORTS), WORKER_PORTS):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in {low}..{low + WORKER_PORTS - 1} for xdist worker {worker}")


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, env: dict, cwd: str, args: tuple
) -> None:
    # A forked rank starts with the fork server's environment and folder: the test's own, now.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Two cores run up to eight ranks: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    result = fn(*args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _start_method() -> str:
    """Ranks fork from a server that has imported torch and the trainer once (``forkserver``):
    a spawned rank spends seconds of the CI's two cores importing them, every launch."""
    multiprocessing.set_forkserver_preload(["harness"])
    return "forkserver"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank its own process joined in
    one gloo group with torchrun's environment, so the code under test initialises exactly as
    in training."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, dict(os.environ), os.getcwd(), args),
            nprocs=world_size,
            start_method=_start_method(),
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _each(cases: list[tuple], ports: list[int]) -> list[Any]:
    results = []
    for (fn, *args), port in zip(cases, ports, strict=True):
        # Its own port: a rank ahead would otherwise join the last case's store, still open on rank 0.
        os.environ["MASTER_PORT"] = str(port)
        results.append(fn(*args))
        # Compiled code bakes in the names of the process groups it traced with, and dynamo's
        # guards do not look at them: the next case's fresh groups must not meet the old code.
        torch._dynamo.reset()
    return results


def run_cases(world_size: int, cases: dict[str, tuple]) -> dict[str, list[Any]]:
    """Several ``run_ranks`` in one launch: ``{name: [fn(*args) on rank r ...]}`` for ``cases``
    ``{name: (fn, *args)}``, run one after the other by the same ranks. Starting a rank (torch,
    a process group) costs seconds of the CI's two cores; a test file's cases of one world size
    share that cost. Each case builds its own trainer, meshes and process groups."""
    names = list(cases)
    ports: list[int] = []
    while len(ports) < len(names):
        ports += [port] if (port := free_port()) not in ports else []
    per_rank = run_ranks(_each, world_size, [cases[name] for name in names], ports)
    return {name: [per_rank[r][i] for r in range(world_size)] for i, name in enumerate(names)}


def run_by_world(cases: dict[str, tuple[int, tuple]]) -> dict[str, list[Any]]:
    """:func:`run_cases` for ``{name: (world_size, (fn, *args))}``: one launch per world size."""
    out: dict[str, list[Any]] = {}
    for world in sorted({world for world, _ in cases.values()}):
        out.update(run_cases(world, {name: case for name, (w, case) in cases.items() if w == world}))
    return out


# --------------------------------------------------------------------------------------------
# The reference and the comparison
# --------------------------------------------------------------------------------------------


def train_as_a_worker(argv: list[str]) -> None:
    """Train as ``python -m trainer.entry.worker`` does: prepared through the one way in (which
    also makes the dump folder), then the loop; without its memory check, stop requests or
    validation."""
    job = prepare(argv, int(os.environ["WORLD_SIZE"]), local_ranks=int(os.environ["LOCAL_WORLD_SIZE"]), memory=False)
    train(job.plan, job.dataset)


def argv_for(local_batch_size: int, extra: list[str]) -> list[str]:
    """:data:`BASE_ARGV` and ``extra``; without the loss chunks (its last pair) where ``extra`` gathers whole logits."""
    base = BASE_ARGV[:-2] if "--parallelism.disable_loss_parallel" in extra else BASE_ARGV
    return base + ["--training.local_batch_size", str(local_batch_size)] + extra


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference(argv: list[str]) -> dict[str, Any]:
    """One process, no sharding, no accumulation: the definition of the right answer."""
    p = resolve_job(load_config(argv), world_size=1)
    dataset = load_dataset(p.config, p.tokenizer, p.global_batch_size)
    model = Transformer(p.model_args)
    model.init_weights(p.config.debug.seed)
    order = global_order(dataset, GLOBAL_BATCH, p.config.debug.seed)
    samples = [dataset[i] for i in order.batch(0)]
    inputs = torch.stack([s[0] for s in samples])
    labels = torch.stack([s[1] for s in samples])
    n = int((labels != IGNORE_INDEX).sum())
    loss = cross_entropy_sum(model(inputs), labels) / n
    loss.backward()
    grads = {name: prm.grad.detach().clone() for name, prm in model.named_parameters()}
    norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().float()
    coef = min(1.0, MAX_NORM / (norm.item() + 1e-6))
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "n": n,
        "grads": {k: g * coef for k, g in grads.items()},
        "unclipped": grads,
        "labels": labels,
        "model": model,
        "inputs": inputs,
    }


def max_relative_error(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert grads.keys() == expected.keys()
    return max(((grads[k] - expected[k]).norm() / expected[k].norm()).item() for k in expected)


def assert_equal(got: Any, want: Any, where: str = "") -> None:
    """Exactly equal, recursively: same keys, same tensor dtypes and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_matches(result: dict, ref: dict) -> None:
    import pytest

    assert result["n"] == ref["n"]
    assert result["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE)
    assert result["norm"] == pytest.approx(ref["norm"], rel=TOLERANCE)
    assert max_relative_error(result["grads"], ref["grads"]) < TOLERANCE


def clipped(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().item()
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    return {k: g * coef for k, g in grads.items()}


def passes_over(tensors: list[torch.Tensor], versions_before: list[int]) -> list[float]:
    """How many times each tensor was written in place since ``versions_before``.

    Views of one buffer (FSDP keeps a parameter group's gradients in one) share a version
    counter, so one pass over n such views adds n to each view's version.
    """
    sharing: dict[int, int] = {}
    for t in tensors:
        sharing[t.untyped_storage().data_ptr()] = sharing.get(t.untyped_storage().data_ptr(), 0) + 1
    return [
        (t._version - before) / sharing[t.untyped_storage().data_ptr()] for t, before in zip(tensors, versions_before)
    ]


def step_worker(argv: list[str]) -> dict | None:
    """One training step through the trainer's own code; rank 0 returns the full gradients and
    how often the accumulator's finish wrote each gradient (exactly once: no second scaling pass)."""
    p, training = trainer_for(argv)
    params = list(training.model.parameters())
    accumulator = part_of(training, GradAccumulator)
    finish = accumulator.finish
    writes: list[float] = []

    def counting_finish(result: StepResult) -> None:
        locals_ = [prm.grad._local_tensor for prm in params]
        before = [t._version for t in locals_]
        finish(result)
        writes.extend(passes_over(locals_, before))

    accumulator.finish = counting_finish  # type: ignore[method-assign]
    microbatches = fetch_step(training)
    result = forward_backward(training, microbatches)
    grads = {name: full(prm.grad) for name, prm in training.model.named_parameters()}
    counts = [int((mb.labels != IGNORE_INDEX).sum()) for mb in microbatches]
    out = {
        "loss": result.loss_avg,
        "loss_max": result.loss_max,
        "norm": result.grad_norm,
        "n": result.n_valid_tokens,
        "grads": grads,
        "counts": counts,
        "writes": writes,
        "values": result.values,
    }
    if p.dims.dp_replicate == 1 and p.dims.dp > 1 and p.dims.tp == 1:
        out["rank_mean_grads"] = per_rank_mean_then_average(training, microbatches)
    return out if dist.get_rank() == 0 else {"counts": counts}


@contextlib.contextmanager
def counting_hsdp_collectives(training: Training) -> Iterator[dict[str, int]]:
    """Count FSDP's reduce-scatters and its all-reduces over the replicate dimension (HSDP's
    cross-replica reduction) while the block runs."""
    replicate_group = training.meshes.fsdp["dp_replicate"].get_group()
    counts = {"all_reduce_replicate": 0, "reduce_scatter": 0}
    originals = {}

    def wrap(name, key, predicate):
        original = getattr(dist, name)
        originals[name] = original

        def counted(*args, **kwargs):
            if predicate(kwargs):
                counts[key] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_reduce", "all_reduce_replicate", lambda kw: kw.get("group") is replicate_group)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            wrap(name, "reduce_scatter", lambda kw: True)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def per_rank_mean_then_average(training: Training, microbatches) -> dict[str, torch.Tensor]:
    """The DDP/FSDP-default bug: each rank normalises by its own tokens, ranks are averaged."""
    model = training.model
    model.zero_grad(set_to_none=True)
    local_n = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in microbatches)
    for i, (inputs, labels, positions, document_ids) in enumerate(microbatches):
        model.set_is_last_backward(i == len(microbatches) - 1)
        logits = model(inputs, positions, document_ids)
        (cross_entropy_sum(logits, labels) / local_n / dist.get_world_size()).backward()
    return {name: full(prm.grad) for name, prm in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# The real entry point
# --------------------------------------------------------------------------------------------


def can_mount_tmpfs() -> bool:
    """A tiny or read-only file system needs a private mount namespace (``unshare``)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="no user namespaces here to mount a small tmpfs")
"""For a test on a real full or read-only file system: a tmpfs mounted in ``unshare -rm``."""


def run_train(ngpu: int, args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``NGPU=ngpu ./run_train.sh args``, one thread per rank."""
    environment = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args], env=environment, capture_output=True, text=True, timeout=timeout
    )


class Launched:
    """``NGPU=ngpu ./run_train.sh args`` (or another ``script`` taking the launcher's arguments)
    running in the background, its output in ``log``."""

    def __init__(self, ngpu: int, args: list[str], log: Path, script: Path = ROOT / "run_train.sh", **env: str):
        self.log = log
        environment = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1", **env}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(script), *args], env=environment, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 180, count: int = 1) -> None:
        """Until ``text`` appears ``count`` times in the output; fails if the job ends or the time
        runs out first."""
        deadline = time.monotonic() + timeout
        while self.output().count(text) < count:
            assert self.proc.poll() is None, (
                f"job ended (exit {self.proc.returncode}) before {text!r}:\n{self.output()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def workers(self) -> list[int]:
        """The training processes: the children of torchrun, the launcher's child."""
        return [pid for torchrun in children(self.proc.pid) for pid in children(torchrun)]

    def finish(self, timeout: float = 300) -> int:
        """The exit code; a job still running after ``timeout`` is killed (its torchrun follows)."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tensorboard_scalars(dump: Path, tags: tuple[str, ...], run: int = -1) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the ``run``-th (default: newest) TensorBoard run in ``dump``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow to import

    run_dir = sorted(p for p in (dump / "tb").iterdir() if p.is_dir())[run]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in tags}
