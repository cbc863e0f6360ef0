"""`sparse-mla demo` runs on this machine, checks itself, and fails loudly when the layer is wrong."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparse_mla import cli
from sparse_mla.layer import SparseMLAAttention

SMALL = ["--decodes", "3", "--max-context", "1500", "--prefill-tokens", "32"]


def test_demo_passes_at_full_size(capsys):
    assert cli.main(["demo", "--device", "cpu"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("OK") == 3 and "FAIL" not in shown
    for kind in ("swa", "c4a", "c128a"):
        assert kind in shown
    assert "20 " in shown and "512" in shown  # 16 decodes (4 with an MTP token) = 20 tokens; 2 x 256 prefill


@pytest.mark.parametrize("extra", [["--prefill-mode", "workspace"], ["--format", "bf16"]])
def test_demo_variants_pass(capsys, extra):
    assert cli.main(["demo", "--device", "cpu", *SMALL, *extra]) == 0
    assert capsys.readouterr().out.count("OK") == 3


def test_demo_exits_non_zero_on_wrong_output(monkeypatch, capsys):
    real = SparseMLAAttention.forward

    def off_by_a_bit(self, q, meta=None, *args, **kwargs):
        out = real(self, q, meta, *args, **kwargs)
        if meta is not None and self.kind == "c128a":  # only one layer is wrong
            out[0].add_(0.1)
        return out

    monkeypatch.setattr(SparseMLAAttention, "forward", off_by_a_bit)
    assert cli.main(["demo", "--device", "cpu", *SMALL]) == 1
    shown = capsys.readouterr().out
    assert shown.count("OK") == 2 and shown.count("FAIL") == 1


def test_console_script_and_help():
    done = subprocess.run([sys.executable, "-m", "sparse_mla.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "demo" in done.stdout
    assert "demo" in cli.COMMANDS
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
