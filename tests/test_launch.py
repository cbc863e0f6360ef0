"""The fast launcher's fingerprint (ops.launch): the generated per-type-pattern functions tell apart exactly what
the plain per-argument walk did (what Triton specialises a compiled binary on)."""
from __future__ import annotations

import random

import torch

from sparse_mla.ops.launch import fingerprint, fingerprint_function


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
