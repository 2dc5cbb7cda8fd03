"""AdamW parameter groups and the warm-up / hold / decay schedule."""

import math

import pytest
import torch

from trainer.config import LRScheduler, Optimizer
from trainer.model.llama3 import FLAVORS, Transformer
from trainer.optimizer import build_lr_scheduler, build_optimizer, lr_factor


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
