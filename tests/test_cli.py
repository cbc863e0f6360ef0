"""`sparse-mla demo | verify | bench` and `--version`: they run on this machine, check themselves, fail loudly
when the layer is wrong, and turn every bad option into a one-line usage error (exit 2, no traceback)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

import sparse_mla
from helpers import ON_GPU
from sparse_mla import cli
from sparse_mla.layer import SparseMLAAttention

SMALL = ["--decodes", "3", "--max-context", "1500", "--prefill-tokens", "32"]


def test_demo_passes_at_full_size(capsys):
    assert cli.main(["demo", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    shown = captured.out
    assert shown.count("OK") == 3 and "FAIL" not in shown
    for kind in ("swa", "c4a", "c128a"):
        assert kind in shown
    assert "20 " in shown and "512" in shown  # 16 decodes (4 with an MTP token) = 20 tokens; 2 x 256 prefill
    # which kernel ran, and progress on stderr: set-up, then each layer
    assert "ran: backend auto -> reference on cpu" in shown
    assert "set-up" in captured.err and all(f"layer {kind}" in captured.err for kind in ("swa", "c4a", "c128a"))


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
    assert done.returncode == 0 and all(name in done.stdout for name in ("demo", "verify", "bench", "--version"))
    assert {"demo", "verify", "bench"} <= set(cli.COMMANDS)
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_version(capsys):
    assert sparse_mla.__version__ == importlib.metadata.version("sparse-mla")
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"sparse-mla {sparse_mla.__version__}"


BAD_OPTIONS = [
    (["demo", "--backend", "cuda"], "--backend"),
    (["demo", "--format", "fp4"], "--format"),
    (["demo", "--format", "fp8_v32"], "--format"),  # a V3.2 format with a V4 model
    (["demo", "--device", "tpu"], "--device"),
    (["demo", "--decodes", "-1"], "--decodes"),
    (["demo", "--decodes", "many"], "--decodes"),
    (["demo", "--decodes", "0", "--prefill-tokens", "0"], "--decodes 0"),
    (["demo", "--prefill-tokens", "-5"], "--prefill-tokens"),
    (["demo", "--max-context", "0"], "--max-context"),
    (["demo", "--model", "deepseek-v3.2"], "--model"),
    (["demo", "--no-such-option"], "--no-such-option"),
    (["verify", "--device", "tpu"], "--device"),
    (["verify", "--fast"], "--fast"),
] + ([] if ON_GPU else [(["demo", "--device", "cuda"], "--device cuda"),
                        (["verify", "--device", "cuda"], "--device cuda")])


@pytest.mark.parametrize("argv,option", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_are_one_line_usage_errors(capsys, argv, option):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"sparse-mla {argv[0]}: error: ") and option in last
    assert "Traceback" not in err


@pytest.mark.skipif(ON_GPU, reason="the Triton backend runs on a GPU")
def test_triton_backend_on_a_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--backend", "triton", "--device", "cpu", *SMALL])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--backend triton on the cpu needs TRITON_INTERPRET=1" in err


def test_usage_error_from_the_console_has_no_traceback():
    done = subprocess.run([sys.executable, "-m", "sparse_mla.cli", "demo", "--decodes", "-1"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("sparse-mla demo: error: argument --decodes: must be an integer "
                                                    ">= 0, got -1")


@pytest.mark.skipif(ON_GPU, reason="on a GPU bench runs the benchmark")
def test_bench_on_a_cpu_says_what_it_needs(capsys):
    assert cli.main(["bench", "--anything"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_verify_passes_on_this_machine(capsys):
    """The whole check, as a user runs it: on a CPU the kernels run in a subprocess under the interpreter."""
    assert cli.main(["verify"]) == 0
    shown = capsys.readouterr()
    assert "FAIL" not in shown.out and shown.out.count("OK") >= 8 + 2 + 6  # kernels, prefill + order, oracle
    assert ("skipped" in shown.out) == (not ON_GPU or importlib.util.find_spec("flash_mla") is None)  # FlashMLA
