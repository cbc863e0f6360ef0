"""Bad input to the library's public helpers for scenarios, workspace plans and verification
(:mod:`sparse_mla.scenario`, :mod:`sparse_mla.workspace`, :mod:`sparse_mla.verify`): a ValueError / TypeError naming
the argument, not an error from inside torch or a silently different scenario."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.config import V41_KINDS
from sparse_mla.scenario import make_scenario
from sparse_mla.verify import random_scope, random_sink, rel_err
from sparse_mla.workspace import plan_prefill_workspace

V41 = dict(fmt="fp8_v41", kinds=V41_KINDS, window=8, topk=4)


@pytest.mark.parametrize("change, error, match", [
    (dict(kinds=("swa", "bogus")), ValueError, "kinds must be a sequence of cache kinds"),  # a KeyError
    (dict(kinds="swa"), ValueError, "kinds must be a sequence of cache kinds"),
    (dict(window=-3), ValueError, "window must be a positive int"),  # a RuntimeError in the oracle's range
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(picks=[[0]]), TypeError, r"picks\['c2a'\] must be a torch.Tensor"),
    (dict(picks=torch.zeros(3, 4, dtype=torch.int32)), ValueError, r"picks\['c2a'\] must have shape \(2, \*\)"),
    # picks of a kind the batch has not: they were dropped and random picks made instead
    (dict(picks={"c4a": torch.zeros(2, 4, dtype=torch.int32)}), ValueError, "picks must be for this scenario's"),
    (dict(fmt="fp4_v41", compressed_fmt="fp8_v41"), ValueError, "cache format mismatch"),
])
def test_make_scenario_names_a_bad_argument(change, error, match):
    with pytest.raises(error, match=match):
        make_scenario([(9, 1), (5, 1)], **(V41 | change))


def test_make_scenario_takes_kinds_from_a_generator_and_no_picks():
    """Kinds given as a generator are read once (checked, then used), and an empty dict of picks means random ones."""
    sc = make_scenario([(9, 1), (5, 1)], **(V41 | dict(kinds=(k for k in V41_KINDS), picks={})))
    assert sc.batch.kinds == V41_KINDS


def test_plan_prefill_workspace_names_its_meta_and_budget():
    sc = make_scenario([(40, 8)], **V41)
    assert plan_prefill_workspace(sc.meta, "c1a", 10**6)  # the same call with its arguments runs
    with pytest.raises(TypeError, match="meta must be the step's StepMetadata"):
        plan_prefill_workspace(None, "c1a", 10**6)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        plan_prefill_workspace(sc.meta, "c1a", None)
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        plan_prefill_workspace(sc.meta, "c1a", -1)


def test_verify_helpers_name_a_bad_argument():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="out must have ref's shape"):  # broadcast into a wrong error
        rel_err(torch.zeros(3), torch.ones(4))
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        random_scope(gen, "bf16", 512, 0, 4, 2, 4, "cpu")
    with pytest.raises(ValueError, match="lens_mode must be 'random' or 'full'"):  # taken as random
        random_scope(gen, "bf16", 512, 3, 4, 2, 4, "cpu", lens_mode="bogus")
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        random_sink(gen, -1, "cpu")
