"""``scripts/gpu_check.py`` on a machine without a GPU: one line and exit 2, before anything runs."""

from __future__ import annotations

import importlib.util

import torch
from harness import ROOT


def test_without_cuda_it_exits_2_saying_so(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA GPU" in out
