"""The fast launcher (ops.launch): the generated per-type-pattern fingerprint functions tell apart exactly what
the plain per-argument walk did (what Triton specialises a compiled binary on)."""
from __future__ import annotations

import random

import pytest
import torch

from sparse_mla.ops.launch import BindOnce, BoundLaunch, fingerprint, fingerprint_function


def walk_fingerprint(args: tuple) -> tuple:
    """The fingerprint as one walk over the arguments (the launcher's former, slower form): the oracle."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a & 15 == 0, -(1 << 31) <= a < (1 << 31), a >= 1 << 63) if type(a) is int
                  else type(a) for a in args])


BYTES, WORDS = torch.zeros(256, dtype=torch.uint8), torch.zeros(64, dtype=torch.int32)
INTS = [v + d for v in (0, 1, 16, 1 << 31, 1 << 63, -(1 << 31)) for d in (-1, 0, 1)] + [32, 48, 1 << 33, -16]


def random_arg(rng: random.Random) -> object:
    """A tensor of one of three dtypes at one of four alignments, an int near an edge Triton specialises on, a float,
    None or a bool."""
    kind = rng.randrange(5)
    if kind == 0:
        if rng.random() < 0.5:
            return BYTES[rng.choice((0, 1, 8, 16)):][:32].view(rng.choice((torch.uint8, torch.int8)))
        return WORDS[rng.choice((0, 1, 2, 4)):][:8]
    if kind == 1:
        return rng.choice(INTS)
    return rng.choice((2.0, 0.5, None, True, False)) if kind == 2 else rng.choice(INTS + [3.0, None])


def test_generated_fingerprints_separate_exactly_what_the_walk_did():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 8)
        first = tuple(random_arg(rng) for _ in range(n))
        # a second tuple mostly of the same pattern: same types, values near the first's
        second = tuple(random_arg(rng) if rng.random() < 0.4 else a for a in first)
        if rng.random() < 0.2:
            second = tuple(random_arg(rng) for _ in range(n))
        assert (fingerprint(first) == fingerprint(second)) == (walk_fingerprint(first) == walk_fingerprint(second)), \
            (first, second)


def test_the_fingerprint_of_a_launch_like_argument_list():
    q, out = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    args = (q, 8, 1, out, 2 ** 31, 0.5, None, True)
    types = tuple(map(type, args))
    assert fingerprint_function(types) is fingerprint_function(types)  # made once per type pattern
    assert fingerprint(args) == (types, (torch.bfloat16, True,  # q: dtype, 16-byte aligned
                                         False, False, True, False,  # 8: == 1, % 16 == 0, int32, >= 2^63
                                         True, False, True, False,  # 1
                                         torch.bfloat16, True,  # out
                                         False, True, False, False))  # 2^31: int64
    assert fingerprint(()) == ((), ())
    assert fingerprint((q[:, 1:], *args[1:])) != fingerprint(args)  # 2-byte offset: not 16-byte aligned
    assert fingerprint((*args[:-1], 1)) != fingerprint(args)  # a bool became an int


def test_bind_once_binds_on_the_first_settle_and_launches_only_under_its_key():
    launched, binds = [], []

    def bind(result):
        binds.append(result)
        return result

    def bound(*args):
        launched.append(args)
        return True

    slot = BindOnce()
    assert not slot("k", 1) and not launched  # nothing bound yet: the caller launches the ordinary way
    slot.settle("k", lambda: bind(bound))
    slot.settle("other", lambda: bind(bound))  # bound once: later settles change nothing
    assert binds == [bound] and slot.key == "k"
    assert slot("k", 1, 2) and launched == [(1, 2)]
    assert not slot("other", 3) and launched == [(1, 2)]  # another key: the bound launch does not run

    refused = BindOnce()
    refused.settle("k", lambda: bind(None))  # no direct path: never asked again
    refused.settle("k", lambda: bind(bound))
    assert refused.bound is False and binds == [bound, None] and not refused("k", 1)


def test_a_bound_launch_passes_the_binding_calls_values_with_each_calls_varying_tensors():
    """The generated call of a :class:`BoundLaunch`: grid, stream, the launcher's leading values, then the arguments
    in order — fixed tensors and non-tensors as bound, the other tensors from the call, as data pointers — and the
    constexprs."""
    calls = []
    a, b, c, d = (torch.zeros(4, dtype=torch.int32) for _ in range(4))
    args = (a, 7, b, None, 2.5, c, d, 1 << 40)
    bound = BoundLaunch((lambda *xs: calls.append(xs), ("fn", None)), (3, 2, 1), args, ("C0", True), 0,
                        fixed=frozenset({2, 6}))
    x, y = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    bound._call(bound._launch, bound._values, "stream", [x, y])  # (the device test of __call__ needs a GPU)
    assert calls == [(3, 2, 1, "stream", "fn", None, x.data_ptr(), 7, b.data_ptr(), None, 2.5, y.data_ptr(),
                      d.data_ptr(), 1 << 40, "C0", True)]
    assert bound._held == [b, d]  # the fixed tensors stay alive with their bound pointers
    again = BoundLaunch((lambda *xs: calls.append(xs), ("fn", None)), (1, 1, 1), args, ("C0", True), 0,
                        fixed=frozenset({2, 6}))
    assert again._call is bound._call  # one generated function per pattern of arguments, not per binding
    with pytest.raises(ValueError):  # another number of tensors than bound: refused, never launched half-stale
        bound._call(bound._launch, bound._values, "stream", [x])
    assert len(calls) == 1
