"""The demo runs on this machine, checks itself, and fails loudly when the layer is wrong."""
from __future__ import annotations

import torch

from sparse_mla import cli
from sparse_mla.layer import SparseMLAAttention


def test_demo_passes(capsys):
    assert cli.main(["demo", "--device", "cpu"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("OK") == 3 and "FAIL" not in shown


def test_demo_exits_non_zero_on_wrong_output(monkeypatch, capsys):
    real = SparseMLAAttention.forward

    def off_by_a_bit(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.add_(torch.randn_like(out.float()).to(out.dtype) * 0.1)
        return out

    monkeypatch.setattr(SparseMLAAttention, "forward", off_by_a_bit)
    monkeypatch.setattr(SparseMLAAttention, "__call__", off_by_a_bit)
    assert cli.main(["demo", "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out
