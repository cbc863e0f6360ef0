"""Forcing the portable attention kernel's per-target strategy constexprs (``launch_configs``) in a test, so the
interpreter runs every code path a target's row can choose, whatever target the machine is."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from helpers import DEVICE
from sparse_mla.ops import attention_plan, launch_configs

# NATIVE_FP8, Q_IN_LOOP, DECODE_FENCE: every combination, and with Q_IN_LOOP both Q_ROPE_SCALAR (which only changes
# how the in-loop q is read) (the table uses some; each must compute the same). DECODE_FENCE is inline PTX, which
# Triton's CPU interpreter cannot run: on a CUDA device only.
_FENCES = [False, True] if DEVICE.type == "cuda" else [False]
STRATEGIES = [dict(NATIVE_FP8=n, Q_IN_LOOP=q, Q_ROPE_SCALAR=r, DECODE_FENCE=f)
              for n, q, r, f in itertools.product([False, True], [False, True], [False, True], _FENCES) if q or not r]
# PREFETCH (the indices loaded a block ahead; the L2 prefetch itself, inline PTX, only on a CUDA device): two of them
STRATEGIES += [dict(STRATEGIES[0], PREFETCH=True), dict(STRATEGIES[-1], PREFETCH=True)]
# PTX_DECODE (inline PTX: on a CUDA device only), as sm_80's row takes it: with the integer decode and the fence
STRATEGIES += [dict(STRATEGIES[0], DECODE_FENCE=True, PREFETCH=True, PTX_DECODE=True)] * (DEVICE.type == "cuda")
STRATEGY_IDS = ["native" * s["NATIVE_FP8"] + "int" * (not s["NATIVE_FP8"]) + "-q" * s["Q_IN_LOOP"]
                + "-r" * s["Q_ROPE_SCALAR"] + "-f" * s["DECODE_FENCE"] + "-p" * s.get("PREFETCH", False)
                + "-x" * s.get("PTX_DECODE", False)
                for s in STRATEGIES]


def force_strategy(monkeypatch, num_warps: int | None = None, **constexprs) -> None:
    """Plans made from now on (the plan cache emptied) take ``constexprs`` (and ``num_warps``, when given) over their
    target's row."""
    real = launch_configs.attention_config

    def attention_config(*args, **kwargs):
        row = real(*args, **kwargs)
        return launch_configs.AttentionConfig({**row.constexprs, **constexprs}, num_warps or row.num_warps,
                                              row.num_stages, "forced by a test")

    monkeypatch.setattr(launch_configs, "attention_config", attention_config)
    monkeypatch.setattr(attention_plan, "_PLANS", OrderedDict())
