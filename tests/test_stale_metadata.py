"""Stale step metadata (issue 33 item 3): once the batch's builder has built another step, every public read of the
metadata — its index lists, the picks' conversion, the decode orders, the step plans (workspace, index forms) — is a
ValueError until it is built again from the current batch; and a layer given metadata of the other model family is
told so (issue 33 item 6)."""
from __future__ import annotations

import pytest
import torch

from sparse_mla import index_forms
from sparse_mla.batch import Request, blocks_needed
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import build_step_metadata
from sparse_mla.picks import convert_picks
from sparse_mla.scenario import make_scenario
from sparse_mla.workspace import plan_prefill_workspace, workspace_indices, workspace_plan

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}
LISTS = ("is_valid_token", "swa_indices", "swa_lens", "c128a_indices", "c128a_lens", "picks_indices", "picks_lens",
         "picks_local", "picks_bound", "decode_orders")


def next_step(sc):
    """The scenario builder's next step (request 0 again, one new token): this makes ``sc.meta`` stale."""
    batch = sc.batch
    s = batch.seq_lens_host[0]
    tables = {k: batch.block_tables[k][0, :blocks_needed(s, k, batch.block_sizes[k])].tolist() for k in batch.kinds}
    return batch.builder.build([Request(s, 1, tables)])


def reads(meta, picks, chunk=None):
    """Every public read of step metadata, by name (``chunk``: one of its prefill workspace chunks)."""
    v4 = "swa" in meta.batch.block_tables
    out = {name: (lambda name=name: getattr(meta, name)) for name in LISTS if v4 or "swa" not in name}
    out.update({
        "decode_order": lambda: meta.decode_order("c4a" if v4 else "dsa"),
        "workspace_plan": lambda: workspace_plan(meta, "swa" if v4 else "dsa", 1 << 20, 512 if v4 else 576),
        "plan_prefill_workspace": lambda: plan_prefill_workspace(meta, "swa" if v4 else "dsa", 1 << 20,
                                                                 512 if v4 else 576),
        "workspace_indices": lambda: workspace_indices(meta, chunk, meta.picks_local),
        "plan": lambda: meta.plan(("anything",), dict),
        "convert_picks": lambda: convert_picks(meta, picks, "c4a" if v4 else "dsa"),
    })
    if v4:
        out["c4a_indices"] = lambda: meta.c4a_indices(picks)
        out["step_ragged"] = lambda: index_forms.step_ragged(meta, "swa", meta.swa_indices, meta.swa_lens)
    else:
        out["dsa_indices"] = lambda: meta.dsa_indices(picks)
    return out


@pytest.mark.parametrize("model", ["v4", "v3.2"])
def test_every_read_of_stale_metadata_is_a_value_error(model):
    sc = (make_scenario([(40, 1), (30, 4)], window=8, topk=4, block_sizes=SIZES, padding=1) if model == "v4" else
          make_scenario([(40, 1), (30, 4)], topk=4, fmt="fp8_v32", dim=576, padding=1))
    meta, spec = sc.meta, sc.meta.spec
    chunk = workspace_plan(meta, "c128a" if model == "v4" else "dsa", 1 << 20, 512 if model == "v4" else 576)[0]
    current = {name: read() for name, read in reads(meta, sc.topk_local, chunk).items()}  # all fine while current
    assert current["picks_indices"] is not None
    newer = next_step(sc)
    for name, read in reads(meta, sc.topk_local, chunk).items():
        with pytest.raises(ValueError, match="stale step: this batch .* is build 1 of its StepBatchBuilder, which has "
                                             "built step 2"):
            read()
    assert build_step_metadata(newer, spec, out=meta) is meta  # refilled from the current batch: current again
    for name, read in reads(meta, torch.full((newer.token_capacity, 4), -1, dtype=torch.int32)).items():
        if name != "workspace_indices":  # the new step has no prefill chunk
            read()
    assert meta.is_valid_token.tolist() == [1] + [0] * (newer.token_capacity - 1)  # the new step's one token


def test_a_layer_on_metadata_of_the_other_model_names_it():
    v32 = make_scenario([(40, 1), (30, 4)], topk=4, fmt="fp8_v32", dim=576, padding=1)
    q = torch.zeros(v32.batch.token_capacity, 2, 512, dtype=torch.bfloat16)
    for window in (128, 64):  # the spec's window, or another (which once read "window 128")
        with pytest.raises(ValueError, match=r"meta was built from a batch of kinds \('dsa',\), but a swa layer reads "
                                             r"V4 step metadata \(a batch whose kinds include 'swa'\)"):
            SparseMLAAttention("swa", 2, window=window, backend="reference")(q, v32.meta, v32.caches)
    v4 = make_scenario([(40, 1), (30, 4)], window=8, topk=4, block_sizes=SIZES, padding=1)
    q576 = torch.zeros(v4.batch.token_capacity, 2, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"meta was built from a batch of kinds \('swa', 'c4a', 'c128a'\), but a dsa "
                                         r"layer reads V3.2 step metadata"):
        SparseMLAAttention("dsa", 2, 576, topk=4, scale=0.1, backend="reference")(
            q576, v4.meta, {"dsa": v4.caches["swa"]}, v4.topk_local)


def test_the_model_family_is_named_before_a_token_capacity_that_differs():
    """A dsa layer on V4 metadata, or a swa layer on V3.2 metadata, with a q sized for its own model's step: the
    family is what is wrong, not the token count."""
    v4 = make_scenario([(40, 1), (30, 4)], window=8, topk=4, block_sizes=SIZES, padding=1)
    q576 = torch.zeros(v4.batch.token_capacity + 3, 2, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"meta was built from a batch of kinds \('swa', 'c4a', 'c128a'\), but a dsa "
                                         r"layer reads V3.2 step metadata"):
        SparseMLAAttention("dsa", 2, 576, topk=4, scale=0.1, backend="reference")(
            q576, v4.meta, {"dsa": v4.caches["swa"]}, torch.zeros(len(q576), 4, dtype=torch.int32))
    v32 = make_scenario([(40, 1), (30, 4)], topk=4, fmt="fp8_v32", dim=576, padding=1)
    q = torch.zeros(v32.batch.token_capacity + 5, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"meta was built from a batch of kinds \('dsa',\), but a swa layer reads V4"):
        SparseMLAAttention("swa", 2, window=8, backend="reference")(q, v32.meta, v32.caches)


def test_a_stale_batch_s_entry_slots_and_new_entries_are_value_errors():
    """Both read the builder's buffers, which hold the next step once it is built: step 1's new entries came out in
    step 2's slots (an engine writing step N's entries after building step N + 1 wrote them there), silently."""
    sc = make_scenario([(40, 1), (30, 4)], window=8, topk=4, block_sizes=SIZES, padding=1)
    batch = sc.batch
    batch.new_entries("c4a")
    batch.entry_slots("swa", 0, torch.tensor([3]))
    next_step(sc)
    for read in (lambda: batch.new_entries("c4a"), lambda: batch.entry_slots("swa", 0, torch.tensor([3]))):
        with pytest.raises(ValueError, match="stale step: this batch .* is build 1 of its StepBatchBuilder"):
            read()
