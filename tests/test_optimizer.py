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
    assert factors[4:11] == [1.0] * 7  # hold, then the last 50% of the 20 steps decay from the peak
    assert factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(factors[10:], factors[11:]))


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_decay_shapes_end_at_min_lr(decay_type):
    config = LRScheduler(warmup_steps=0, decay_ratio=-1.0, decay_type=decay_type, min_lr_factor=0.0)
    factors = [lr_factor(s, 11, config) for s in range(11)]
    assert factors[0] == 1.0
    assert factors[-1] == pytest.approx(0.0, abs=1e-12)
    middle = factors[5]  # progress 0.5
    expected = {"linear": 0.5, "sqrt": 1 - math.sqrt(0.5), "cosine": 0.5}[decay_type]
    assert middle == pytest.approx(expected)


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = build_lr_scheduler(opt, 10, LRScheduler(warmup_steps=2, decay_ratio=-1.0, min_lr_factor=0.0))
    seen = []
    for _ in range(3):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1 / 3, 2 / 3, 1.0])  # warm-up, then the peak
