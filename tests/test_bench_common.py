"""``benchmarks/common.py``'s ``--settings`` helpers, which the dev A/B scripts (``pdl_ab.py``, ``ln_bwd_sweep.py``)
share: the parse of ``"A=1,B=0;A=0"`` and the environment each setting holds only for its own block. CPU only."""
from __future__ import annotations

import os

import pytest

from utils import load_benchmark


@pytest.fixture(scope="module")
def common():
    yield from load_benchmark("common")


def test_env_settings_parse(common):
    assert common.env_settings("PDL=1,LN_BWD_SLOTS=0;PDL=0") == [{"PDL": "1", "LN_BWD_SLOTS": "0"}, {"PDL": "0"}]
    assert common.env_settings("") == [{}]
    assert common.env_settings(" A=x=y , B= ;") == [{"A": "x=y", "B": ""}, {}]
    for bad in ("A", "=1", "A=1,B"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            common.env_settings(bad)


def test_settings_label(common):
    assert common.settings_label({"A": "1", "B": "0"}) == "A=1,B=0"
    assert common.settings_label({}) == "default"


def test_env_setting_sets_then_restores(common, monkeypatch):
    monkeypatch.setenv("PYKERNELS_TEST_A", "before")
    monkeypatch.delenv("PYKERNELS_TEST_B", raising=False)
    seen = []
    for setting in common.env_settings("TEST_A=1,TEST_B=2;TEST_B=3"):
        with common.env_setting(setting):
            seen.append((os.environ.get("PYKERNELS_TEST_A"), os.environ.get("PYKERNELS_TEST_B")))
    # the second setting does not name TEST_A: it sees the value from before the first, not the first's
    assert seen == [("1", "2"), ("before", "3")]
    assert os.environ["PYKERNELS_TEST_A"] == "before" and "PYKERNELS_TEST_B" not in os.environ
    with pytest.raises(RuntimeError):
        with common.env_setting({"TEST_B": "4"}):
            raise RuntimeError("inside")
    assert "PYKERNELS_TEST_B" not in os.environ
    with common.env_setting({"TEST_A": None}):  # (None: unset inside the block)
        assert "PYKERNELS_TEST_A" not in os.environ
    assert os.environ["PYKERNELS_TEST_A"] == "before"
