"""The library's environment variables (sparse_mla.env): a value outside the documented set is a ``ValueError``
naming the variable and the values it takes, where the library reads it — never read as unset."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import DEVICE, random_scope
from sparse_mla.env import VARIABLES, env_value, switch_on
from sparse_mla.ops import sparse_attention_decode


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_every_variable_rejects_a_value_outside_its_set(monkeypatch, name):
    values, _ = VARIABLES[name]
    for value in values:
        monkeypatch.setenv(name, value)
        assert env_value(name) == value
    monkeypatch.setenv(name, "bogus")
    shown = ", ".join(repr(v) for v in values if v)
    with pytest.raises(ValueError, match=f"environment variable {name}='bogus' is not one of {shown}"):
        env_value(name)
    monkeypatch.delenv(name)
    assert env_value(name) == ""


def test_switches(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    assert not switch_on("SPARSE_MLA_DEBUG") and switch_on("SPARSE_MLA_DEBUG", default=True)
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    assert switch_on("SPARSE_MLA_DEBUG")
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "0")
    assert not switch_on("SPARSE_MLA_DEBUG", default=True)


@pytest.mark.parametrize("name", ["SPARSE_MLA_DEBUG", "SPARSE_MLA_GLUON"])
def test_an_op_call_names_a_bad_variable(monkeypatch, name):
    """``SPARSE_MLA_GLUON=bogus`` was read as unset and ``SPARSE_MLA_DEBUG=yes`` as on: now each is refused."""
    gen = torch.Generator().manual_seed(0)
    cache, idx, lens = random_scope(gen, "bf16", 512, 2, 4, 2, 4)
    q = torch.randn(2, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"environment variable {name}='yes' is not one of '0', '1'"):
        sparse_attention_decode(q, cache.data, idx, lens, backend="triton")


def test_the_test_session_refuses_a_bad_lowering(tmp_path):
    """``SPARSE_MLA_LOWERING`` (tests/conftest.py: every kernel lowered as for that target) outside sm80 / sm86 /
    sm89 stops the session at once, naming the variable, on any machine."""
    env = dict(os.environ, SPARSE_MLA_LOWERING="sm75")
    tests = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                           os.path.join(tests, "test_env.py")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "environment variable SPARSE_MLA_LOWERING='sm75' is not one of 'sm80', 'sm86', 'sm89'" in done.stdout + \
        done.stderr
