"""docs/architecture.md's recipe, followed as a newcomer would: a term added to the loss (PaLM's
z-loss, ``1e-2 x log(Z)^2`` summed over the valid tokens) with its own dashboard line.

The recipe's one product edit, an entry of ``trainer/step/loss_terms.py:loss_terms``, is made here
by replacing that function where the step's plan (``trainer/planning/step_plan.py``) calls it. The term is then exactly
normalised on every mesh: one process accumulating 4 micro-batches and FSDP on 2 ranks
accumulating 2 give the single-process reference's loss (the cross-entropy alone, as logged),
z-loss value and gradients (of both, clipped); and a launched run puts the term on its console
line and in TensorBoard, charted. The injected bug, the term divided by each micro-batch's own
tokens, fails the comparison.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from harness import (
    GLOBAL_BATCH,
    MAX_NORM,
    TOLERANCE,
    argv_for,
    max_relative_error,
    run_by_world,
    run_ranks,
    step_worker,
    train_as_a_worker,
)
from metrics_helpers import _layout_charts, _read_events, _scalars

from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.data.loader import global_order
from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model.llama3 import Transformer
from trainer.planning.job_plan import resolve_job
from trainer.step.loss_terms import LossTerm
from trainer.step.sums import Logged, Total

WEIGHT = 1e-2


def z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log(Z)^2`` of every valid token's logits, summed."""
    valid = labels.flatten() != IGNORE_INDEX
    return (torch.logsumexp(logits.flatten(0, -2).float(), dim=-1)[valid] ** 2).sum()


def z_loss_per_microbatch_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The classic bug: the term normalised by its own micro-batch's tokens before the step's 1 / N."""
    return z_loss(logits, labels) / (labels != IGNORE_INDEX).sum().clamp(min=1)


Z_LOSS = Total("z_loss", logged=Logged("loss_metrics/z_loss", "z-loss", "loss/z-loss"))


def with_term(of=z_loss) -> None:
    """The recipe's edit: ``loss_terms`` returns the z-loss."""
    import trainer.planning.step_plan

    trainer.planning.step_plan.loss_terms = lambda config: (LossTerm(Z_LOSS, WEIGHT, of),)  # type: ignore[assignment]


def term_step(argv: list[str], bug: bool = False) -> dict | None:
    with_term(z_loss_per_microbatch_mean if bug else z_loss)
    out = step_worker(argv)
    return out


def reference() -> dict:
    """One process, the whole batch: loss = cross-entropy sum / N, z = z sum / N, gradients of
    their weighted sum, clipped."""
    argv = argv_for(GLOBAL_BATCH, [])
    p = resolve_job(load_config(argv), world_size=1)
    dataset = load_dataset(p.config, p.tokenizer, p.global_batch_size)
    model = Transformer(p.model_args)
    model.init_weights(p.config.debug.seed)
    samples = [dataset[i] for i in global_order(dataset, GLOBAL_BATCH, p.config.debug.seed).batch(0)]
    inputs, labels = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    n = int((labels != IGNORE_INDEX).sum())
    logits = model(inputs)
    ce, z = cross_entropy_sum(logits, labels) / n, z_loss(logits, labels) / n
    (ce + WEIGHT * z).backward()
    grads = {name: prm.grad.detach().clone() for name, prm in model.named_parameters()}
    norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().item()
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    return {"loss": ce.item(), "z": z.item(), "norm": norm, "n": n, "grads": {k: g * coef for k, g in grads.items()}}


@pytest.fixture(scope="module")
def steps() -> dict:
    return run_by_world(
        {
            "1 x 4": (1, (term_step, argv_for(2, []))),
            "fsdp 2 x 2": (2, (term_step, argv_for(2, []))),
            "bug: fsdp 2 x 2": (2, (term_step, argv_for(2, []), True)),
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1 x 4", "fsdp 2 x 2"])
def test_a_term_added_by_the_recipe_is_exact_on_every_layout(steps, layout):
    ref, result = reference(), steps[layout][0]
    assert result["n"] == ref["n"]
    assert result["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE)  # the cross-entropy alone
    assert result["values"][Z_LOSS.logged.tag] == pytest.approx(ref["z"], rel=TOLERANCE)
    assert result["norm"] == pytest.approx(ref["norm"], rel=TOLERANCE)
    assert max_relative_error(result["grads"], ref["grads"]) < TOLERANCE
    assert set(result["writes"]) == {1}


@pytest.mark.slow
def test_the_term_normalised_per_microbatch_is_caught(steps):
    ref, result = reference(), steps["bug: fsdp 2 x 2"][0]
    assert result["values"][Z_LOSS.logged.tag] != pytest.approx(ref["z"], rel=100 * TOLERANCE)
    assert max_relative_error(result["grads"], ref["grads"]) > 100 * TOLERANCE


def launched_worker(argv: list[str]) -> list[str]:
    """A short run of the loop with the term, as ``trainer.entry.worker`` runs it: its console lines."""
    with_term()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshtrain").addHandler(handler)
    logging.getLogger("meshtrain").setLevel(logging.INFO)
    train_as_a_worker(argv)
    return [line for line in lines if line.startswith("step: ")]


@pytest.mark.slow
def test_the_term_reaches_the_console_and_the_dashboard(tmp_path):
    argv = argv_for(2, ["--training.steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)])
    argv = [a for a in argv if a != "--metrics.enable_tensorboard=false"]
    [console] = run_ranks(launched_worker, 1, argv)
    assert len(console) == 2 and all(re.search(r"  z-loss: \d+\.\d{4}  ", line) for line in console), console
    (run,) = [p for p in (tmp_path / "tb").iterdir() if p.is_dir()]
    acc = _read_events(str(run))
    assert sorted(_scalars(acc, Z_LOSS.logged.tag)) == [1, 2]
    assert _layout_charts(acc)["z-loss"] == [Z_LOSS.logged.tag]
