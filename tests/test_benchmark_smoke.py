"""The step benchmark (``benchmarks/bench_step.py``) and the V3.2 benchmark run end to end on the CPU in ``--smoke``
mode and write the JSON the GPU runs are read from. The scripts are loaded as they run: ``benchmarks/`` first on
``sys.path`` (their ``harness`` and ``timing`` modules live there)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def load_script(name: str, monkeypatch: pytest.MonkeyPatch):
    """``benchmarks/<name>.py`` as a module, imported the way ``python benchmarks/<name>.py`` imports it."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_step_benchmark_smoke_writes_the_expected_json(tmp_path, capsys, monkeypatch):
    benchmark = load_script("bench_step", monkeypatch)
    args = _args(benchmark, ["--smoke", "--cases", "flash-b32", "prefill-flash", "--out", str(tmp_path)])
    assert benchmark.run(args) == 0
    result = json.loads((tmp_path / "bench_step.json").read_text())
    assert {"device", "torch", "smoke", "graphs", "decode", "prefill", "batch_invariant_supported"} <= set(result)
    (row,) = result["decode"]
    assert row["case"] == "flash-b32" and row["layers"] == 6 and row["layer_kinds"] == {"swa": 2, "c4a": 2, "c128a": 2}
    assert row["ours_eager_us"] > 0 and "ours_graph_us" not in row  # no graphs on the CPU
    assert set(row["host_us"]) == {"swa", "c4a", "c4a_indexer_picks", "c128a", "build_step_metadata"}
    assert [r["kind"] for r in result["prefill"]] == ["c4a", "c128a"]
    for r in result["prefill"]:
        assert r["paged_us"] > 0 and r["workspace_us"] > 0 and r["rel_err_paged_vs_workspace"] < 1e-2
    assert "flash-b32" in capsys.readouterr().out  # the table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_step_benchmark_without_a_gpu_asks_for_one(tmp_path, capsys, monkeypatch):
    benchmark = load_script("bench_step", monkeypatch)
    assert benchmark.run(_args(benchmark, ["--out", str(tmp_path)])) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_model_layers_follow_the_presets(monkeypatch):
    benchmark = load_script("bench_step", monkeypatch)
    flash = benchmark.model_layers(benchmark.Sizes.of(False).model("deepseek-v4-flash"), None)
    pro = benchmark.model_layers(benchmark.Sizes.of(False).model("deepseek-v4-pro"), None)
    assert len(flash) == 43 and (flash.count("swa"), flash.count("c4a"), flash.count("c128a")) == (2, 21, 20)
    assert len(pro) == 61 and (pro.count("swa"), pro.count("c4a"), pro.count("c128a")) == (0, 30, 31)


def test_v32_benchmark_smoke_writes_the_expected_json(tmp_path, monkeypatch):
    bench_v32 = load_script("bench_v32", monkeypatch)
    assert bench_v32.run(_args(bench_v32, ["--smoke", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "bench_v32.json").read_text())
    assert {"decode", "prefill", "step"} <= set(result)
    assert result["decode"] and result["prefill"] and result["step"]
    assert all(r["ours_us"] > 0 for r in result["decode"]) and result["step"][0]["ours_eager_us"] > 0
    for r in result["prefill"]:
        assert r["paged_us"] > 0 and r["workspace_us"] > 0 and r["rel_err_paged_vs_workspace"] < 1e-2


def test_v41_benchmark_smoke_writes_the_expected_json(tmp_path, monkeypatch):
    bench_v41 = load_script("bench_v41", monkeypatch)
    assert bench_v41.run(_args(bench_v41, ["--smoke", "--rep", "1", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "bench_v41.json").read_text())
    memory = {m["format"]: m for m in result["memory"]}
    v4, fp8, fp4 = (memory[name] for name in bench_v41.FORMATS)
    # V4.1's records are smaller than V4's 584 bytes, the fp4 compressed cache smallest: longer contexts fit
    assert fp4["bytes_per_raw_token"] < fp8["bytes_per_raw_token"] < v4["bytes_per_raw_token"]
    assert fp4["longest_context_80gb"] > fp8["longest_context_80gb"] > v4["longest_context_80gb"]
    (row,) = result["decode"]
    for name, f in row["formats"].items():
        assert f["finite"] and f["eager_us"] > 0, name
        # the same latents quantised three ways: outputs apart by quantisation only (e2m1 is the coarsest)
        assert max(f["rel_diff_vs_v4"].values()) < 0.1, name
    assert {(p["kind"], p["format"]) for p in result["prefill"]} == {
        (k, n) for k in ("c2a", "c1a") for n in bench_v41.FORMATS}
    assert all(p["finite"] and p["us"] > 0 for p in result["prefill"])


def test_host_builder_times_ours_against_a_base(monkeypatch, capsys):
    """``benchmarks/host_builder.py --base``: every case timed for both packages (here the same tree twice), with the
    ratio printed; the builds it times are real builds (a batch of the case's requests)."""
    host_builder = load_script("host_builder", monkeypatch)
    monkeypatch.setattr(host_builder, "CASES", ((3, 70),))
    import sparse_mla
    from sparse_mla import batch as batch_mod

    build, builder = host_builder.step_build(batch_mod, [(70, 1)] * 3, ("swa", "c4a", "c128a"),
                                             {"swa": 64, "c4a": 64, "c128a": 2}, "cpu")
    assert build().num_reqs == 3
    from_arrays, _ = host_builder.step_build(batch_mod, [(70, 1)] * 3, ("swa", "c4a", "c128a"),
                                             {"swa": 64, "c4a": 64, "c128a": 2}, "cpu", arrays=True)
    assert torch.equal(from_arrays().block_tables["c4a"], build().block_tables["c4a"])
    monkeypatch.setattr(sys, "argv", ["host_builder.py", "--device", "cpu", "--rounds", "1", "--base",
                                      os.path.dirname(sparse_mla.__file__)])
    host_builder.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all("ours / base" in line for line in lines)
