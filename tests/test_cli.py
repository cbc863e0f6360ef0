"""`sparse-mla demo | verify | bench` and `--version`: they run on this machine, check themselves, fail loudly
when the layer is wrong, and turn every bad option into a one-line usage error (exit 2, no traceback)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

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
    (["demo", "--max-context", "1", "--decodes", "2"], "--max-context"),  # an MTP request needs 2 tokens
    (["demo", "--model", "deepseek-v3.2"], "--model"),
    (["demo", "--no-such-option"], "--no-such-option"),
    (["verify", "--device", "tpu"], "--device"),
    (["verify", "--fast"], "--fast"),
    # the step benchmark's options: usage errors before any device check (this CPU included)
    (["bench", "--cases", "flash-b33"], "--cases"),
    (["bench", "--rep", "0"], "--rep"),
    (["bench", "--rep", "fast"], "--rep"),
    (["bench", "--rounds", "-2", "--smoke"], "--rounds"),
    (["demo", "--seed", "99999999999999999999"], "--seed"),
    (["demo", "--max-context", "99999999999999999999999"], "--max-context"),  # a traceback in the draw
    (["demo", "--decodes", "100000000"], "--decodes"),  # drawn for minutes before the memory check
    (["demo", "--prefill-tokens", str(2**31)], "--prefill-tokens"),
    (["verify", "--seed", "-1"], "--seed"),
    (["bench", "--smoke", "--seed", "99999999999999999999"], "--seed"),
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


@pytest.mark.parametrize("where", ["existing file", "under a file"])
def test_bench_out_that_cannot_be_a_folder_is_one_line_usage_error(tmp_path, capsys, where):
    file = tmp_path / "taken"
    file.write_text("")
    out = file if where == "existing file" else file / "results"
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--smoke", "--cases", "prefill-flash", "--out", str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert done.value.code == 2 and "Traceback" not in err
    assert last.startswith("sparse-mla bench: error: argument --out: ") and str(out) in last


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
                                                    "in [0, 65536], got -1")


def test_demo_too_big_for_memory_is_one_error_line():
    """Sizes no machine holds (terabytes of caches and oracle keys) end in one ``error:`` line, at once, instead of
    the OOM killer or an allocation traceback."""
    done = subprocess.run([sys.executable, "-m", "sparse_mla.cli", "demo", "--decodes", "60000", "--max-context",
                           "100000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sparse-mla demo: error: --decodes 60000 --max-context 100000") and "memory" in last


def test_demo_checks_its_memory_against_what_is_available(monkeypatch, capsys):
    monkeypatch.setattr(cli, "available_bytes", lambda device: 10**8)  # 0.1 GB free
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--device", "cpu", *SMALL])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2 and "GB of cpu memory, 0.1 GB is available" in last


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM and VmRSS from /proc")
def test_demo_memory_estimate_follows_the_measured_peak():
    """The estimate :func:`cli.demo_bytes` tracks what the demo really holds (the growth of the peak resident memory
    of a CPU run with long contexts, where the caches and the oracle dominate), so the check neither lets an OOM
    through nor refuses sizes that fit. (Not ``ru_maxrss``: Linux keeps it across ``exec``, from pytest's process.)"""
    argv = ["--decodes", "4", "--max-context", "200000", "--prefill-tokens", "0"]
    probe = textwrap.dedent(f"""
        import contextlib, io, torch
        from sparse_mla import cli

        def status(key):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

        argv = {argv!r}
        args = cli.build_parser().parse_args(["demo", *argv])
        lengths = cli._demo_requests(args, torch.Generator().manual_seed(args.seed))
        est = cli.demo_bytes(lengths, cli.get_config(args.model), "fp8_v4", -sum(q for _, q in lengths) % 64,
                              cli.PREFILL_SAMPLE + 1)
        base = status("VmRSS")
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["demo", "--device", "cpu", *argv]) == 0
        print(est["cpu"], status("VmHWM") - base)
        """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    estimated, measured = map(int, done.stdout.split())
    assert 0.7 * measured < estimated < 1.5 * measured, (estimated, measured)


def test_bench_smoke_runs_on_the_cpu(tmp_path, capsys):
    """``sparse-mla bench --smoke``: the step benchmark of this checkout at tiny sizes, on any machine."""
    assert cli.main(["bench", "--smoke", "--cases", "prefill-flash", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_step.json").read_text())
    assert result["smoke"] and result["cases"] == ["prefill-flash"] and len(result["prefill"]) == 2
    assert "prefill-flash" in capsys.readouterr().out  # the table


@pytest.mark.skipif(ON_GPU, reason="on a GPU bench runs the benchmark")
def test_bench_on_a_cpu_without_smoke_says_what_it_needs(tmp_path, capsys):
    assert cli.main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--smoke" in err


def test_verify_passes_on_this_machine(capsys):
    """The whole check, as a user runs it: on a CPU the kernels run in a subprocess under the interpreter."""
    assert cli.main(["verify"]) == 0
    shown = capsys.readouterr()
    assert "FAIL" not in shown.out and shown.out.count("OK") >= 8 + 2 + 6  # kernels, prefill + order, oracle
    assert ("skipped" in shown.out) == (not ON_GPU or importlib.util.find_spec("flash_mla") is None)  # FlashMLA
    assert "torch / Triton: GPU-tested: torch " in shown.out  # the support statement for this torch / Triton
