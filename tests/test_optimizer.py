"""AdamW parameter groups, the warm-up / hold / decay schedule, and the schedule a resume keeps."""

import copy
import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import LRScheduler, Optimizer
from trainer.model.llama3 import FLAVORS, Transformer
from trainer.optimizer import LRSchedule, build_lr_scheduler, build_optimizer, lr_factor, schedule_change


def test_weight_decay_only_on_matrices():
    model = Transformer(FLAVORS["debugmodel"])
    opt = build_optimizer(model, Optimizer(weight_decay=0.1), "cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])
    assert all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert opt.defaults["foreach"] is True


def test_warmup_hold_then_linear_decay_to_min():
    config = LRScheduler(warmup_steps=4, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)
    factors = [lr_factor(s, 20, config) for s in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4:10] == [1.0] * 6  # hold, then the last 50% of the 20 steps decay
    assert factors[10:] == pytest.approx([0.1 + 0.9 * (1 - k / 10) for k in range(1, 11)])
    assert factors[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_decay_shapes_end_at_min_lr(decay_type):
    config = LRScheduler(warmup_steps=0, decay_ratio=-1.0, decay_type=decay_type, min_lr_factor=0.0)
    factors = [lr_factor(s, 10, config) for s in range(10)]
    assert factors[-1] == pytest.approx(0.0, abs=1e-12)
    middle = factors[4]  # decay step 5 of 10: progress 0.5
    expected = {"linear": 0.5, "sqrt": 1 - math.sqrt(0.5), "cosine": 0.5}[decay_type]
    assert middle == pytest.approx(expected)


@pytest.mark.parametrize("steps", [6, 7])
def test_short_runs_decay_to_min_on_the_last_step(steps):
    """The debug config's schedule (warm-up 5, decay ratio 0.8) on runs of 6 and 7 steps: the
    last step runs at min_lr_factor, and with two decay steps the first is halfway, not a jump."""
    config = LRScheduler(warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1)
    factors = [lr_factor(s, steps, config) for s in range(steps)]
    assert factors[:5] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])
    assert factors[-1] == pytest.approx(0.1)
    if steps == 7:
        assert factors[5] == pytest.approx(0.55)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("min_lr_factor", [0.0, 0.25])
def test_every_combination_matches_the_documented_phases(decay_type, min_lr_factor):
    """For every warm-up, decay ratio and (short or long) run: warm-up climbs (i+1)/(W+1), the hold
    is the peak, the decay falls strictly from below the peak to exactly min_lr_factor on the last
    step, and nothing leaves [min_lr_factor, 1]."""
    for total in range(1, 25):
        for warmup in range(0, 8):
            for ratio in (-1.0, 0.0, 0.1, 0.25, 0.5, 0.8, 1.0):
                config = LRScheduler(
                    warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type, min_lr_factor=min_lr_factor
                )
                factors = [lr_factor(s, total, config) for s in range(total)]
                lr_factor(total, total, config)  # the scheduler's look past the last step must not fail
                w = min(warmup, total)
                decay = total - w if ratio < 0 else min(total - w, round(total * ratio))
                where = (total, warmup, ratio)
                assert factors[:w] == pytest.approx([(i + 1) / (w + 1) for i in range(w)]), where
                assert factors[w : total - decay] == [1.0] * (total - w - decay), where
                tail = factors[total - decay :]
                if decay:
                    assert tail[-1] == pytest.approx(min_lr_factor), where
                    assert all(a > b for a, b in zip([1.0, *tail], tail)), where  # strictly falling
                assert all(f >= min_lr_factor - 1e-12 for f in tail), where
                assert all(0.0 <= f <= 1.0 for f in factors), where
                assert all(f > 0.0 for f in factors[:-1]), where  # only the very last step may be 0


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = build_lr_scheduler(opt, 10, LRScheduler(warmup_steps=2, decay_ratio=-1.0, min_lr_factor=0.0))
    seen = []
    for _ in range(3):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1 / 3, 2 / 3, 7 / 8])  # warm-up, then the first of 8 decay steps


SCHEDULE = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)


def trained(lr: float, total: int, steps: int, saved: dict | None = None) -> tuple[torch.optim.AdamW, LRSchedule]:
    """``steps`` optimizer steps of a run of ``total`` at peak ``lr``, resumed from ``saved`` (the
    optimizer's and the scheduler's state) when given, as a checkpoint loads them: optimizer first."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = build_lr_scheduler(opt, total, SCHEDULE)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["lr_scheduler"])
    for _ in range(steps):
        param.grad = torch.ones(4)
        opt.step()
        sched.step()
    return opt, sched


def rates(opt: torch.optim.AdamW, sched: LRSchedule, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(float(sched.get_last_lr()[0]))
        assert seen[-1] == opt.param_groups[0]["lr"]
        opt.param_groups[0]["params"][0].grad = torch.ones(4)
        opt.step()
        sched.step()
    return seen


def checkpoint(opt: torch.optim.AdamW, sched: LRSchedule) -> dict:
    return copy.deepcopy({"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict()})


def test_a_resume_with_the_same_schedule_takes_the_same_rates_and_saves_torchs_format():
    opt, sched = trained(1e-3, 12, 5)
    plain = LambdaLR(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), lambda step: 1.0)
    assert set(sched.state_dict()) == set(plain.state_dict())  # the checkpoint's keys are its format
    expected = rates(*trained(1e-3, 12, 5), 7)
    assert rates(*trained(1e-3, 12, 0, checkpoint(opt, sched)), 7) == expected  # bit for bit


@pytest.mark.parametrize(
    ("lr", "total"),
    [(1e-3, 24), (2e-3, 8), (2e-3, 24)],
    ids=["longer run", "higher peak", "both"],
)
def test_a_resume_with_another_schedule_takes_this_runs_from_its_first_step(lr, total):
    """torch's LambdaLR would keep the checkpoint's peak (a new `optimizer.lr` changing nothing)
    and run the first resumed step at the old schedule's rate; this run's schedule holds from it,
    and the resume says what changed, with both rates."""
    opt, sched = trained(1e-3, 8, 5)
    saved = checkpoint(opt, sched)
    resumed = rates(*trained(lr, total, 0, saved), 3)
    fresh = [lr * lr_factor(step, total, SCHEDULE) for step in range(5, 8)]
    assert resumed == pytest.approx(fresh, rel=1e-12)
    plain_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=lr)
    plain = LambdaLR(plain_opt, lambda step: lr_factor(step, total, SCHEDULE))
    plain_opt.load_state_dict(saved["optimizer"])
    plain.load_state_dict(saved["lr_scheduler"])
    assert plain.get_last_lr()[0] == pytest.approx(1e-3 * lr_factor(5, 8, SCHEDULE))  # the old rate
    said = schedule_change(sched.settings(), trained(lr, total, 0)[1].settings(), 5)
    assert said is not None and said.startswith("the LR schedule is this run's, not the checkpoint's (")
    assert (f"`training.steps` 8 there, {total} here" in said) == (total != 8)
    assert ("`optimizer.lr` 0.001 there, 0.002 here" in said) == (lr != 1e-3)
    assert (
        f"step 6 trains at LR {fresh[0]:.3e} where the checkpoint's schedule gave {1e-3 * lr_factor(5, 8, SCHEDULE):.3e}"
        in said
    )
    assert schedule_change(sched.settings(), sched.settings(), 5) is None
