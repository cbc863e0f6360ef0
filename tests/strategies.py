"""Hypothesis strategies shared by the step tests."""
from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def step_lengths(draw, max_context: int = 420, max_query: int = 24, prefixes=st.integers(0, 300)):
    """``(lengths, decode_threshold)``: ``(seq_len, query_len)`` per request, decodes first.

    Decodes carry 1 to ``threshold`` tokens (threshold 1-4: MTP); prefills sit on prefixes shorter
    or longer than a window; contexts reach past 128 tokens so c128a entries exist.
    """
    threshold = draw(st.integers(1, 4))
    decodes = draw(st.lists(st.tuples(st.integers(1, max_context), st.integers(1, threshold)), max_size=3))
    prefills = draw(st.lists(st.tuples(prefixes, st.integers(threshold + 1, max_query)), max_size=2))
    lengths = [(max(s, q), q) for s, q in decodes] + [(p + q, q) for p, q in prefills]
    return (lengths or [(1, 1)]), threshold
