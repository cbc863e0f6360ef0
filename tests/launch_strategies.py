"""Forcing the portable attention kernel's per-target strategy constexprs (``launch_configs``) in a test, so the
interpreter runs every code path a target's row can choose, whatever target the machine is."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from sparse_mla.ops import attention_plan, launch_configs

# NATIVE_FP8, Q_IN_LOOP, V_RELOAD: every combination, and with Q_IN_LOOP both Q_ROPE_SCALAR (which only changes how
# the in-loop q is read) (the table uses some; each must compute the same)
STRATEGIES = [dict(NATIVE_FP8=n, Q_IN_LOOP=q, Q_ROPE_SCALAR=r, V_RELOAD=v)
              for n, q, v, r in itertools.product([False, True], repeat=4) if q or not r]
STRATEGY_IDS = ["native" * s["NATIVE_FP8"] + "int" * (not s["NATIVE_FP8"]) + "-q" * s["Q_IN_LOOP"]
                + "-r" * s["Q_ROPE_SCALAR"] + "-v" * s["V_RELOAD"] for s in STRATEGIES]


def force_strategy(monkeypatch, **constexprs) -> None:
    """Plans made from now on (the plan cache emptied) take ``constexprs`` over their target's row."""
    real = launch_configs.attention_config

    def attention_config(*args, **kwargs):
        row = real(*args, **kwargs)
        return launch_configs.AttentionConfig({**row.constexprs, **constexprs}, row.num_warps, row.num_stages,
                                              "forced by a test")

    monkeypatch.setattr(launch_configs, "attention_config", attention_config)
    monkeypatch.setattr(attention_plan, "_PLANS", OrderedDict())
