"""``benchmarks/bench_hf.py --smoke``: a tiny random-weight HF DeepSeek-V4 through eager and sparse-mla on the CPU."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from helpers import needs

pytestmark = needs("transformers")

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_bench_hf_smoke_writes_the_expected_json(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # as ``python benchmarks/bench_hf.py`` runs: its harness is there
    spec = importlib.util.spec_from_file_location("bench_hf", os.path.join(BENCHMARKS, "bench_hf.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_hf", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--smoke", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "bench_hf.json").read_text())
    assert result["smoke"] and result["kv_format"] == "bf16" and result["contexts"] == [160]
    assert result["index_format"] == ["bf16"]
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "sdpa", "sparse_mla", "sparse_mla_pipeline", "sparse_mla_graphs"}
    assert rows["sdpa"]["status"] == "unsupported" and rows["sdpa"]["reason"]
    assert rows["sparse_mla_graphs"]["status"] == "unsupported"  # CUDA graphs: not on the CPU
    assert "cuda_graphs=True needs a CUDA device" in rows["sparse_mla_graphs"]["reason"]
    for impl in ("eager", "sparse_mla", "sparse_mla_pipeline"):
        r = rows[impl]
        assert r["status"] == "ok" and r["generated"] == 2 and r["prefill_s"] > 0 and r["decode_ms"] > 0
        assert r["index_format"] == ("bf16" if impl == "sparse_mla_pipeline" else None)
    assert "sparse_mla" in capsys.readouterr().out  # the table
