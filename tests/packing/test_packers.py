"""The registered packers: typed options, and empty rows of the configured budget or the server's context."""

from __future__ import annotations

import pickle

import pytest

from asyncrl.packing import PACKERS, FlatRow, PackingOptions, TreeRow
from asyncrl.registry import RegistryError


@pytest.mark.parametrize(("name", "row"), [("flat", FlatRow), ("tree", TreeRow)])
def test_rows_take_the_configured_budget_else_the_servers_context(name, row):
    factory, budget = PACKERS.build({"name": name}).rows(max_model_len=512)
    assert budget == 512 and isinstance(factory(), row) and factory().token_budget == 512
    factory, budget = PACKERS.build({"name": name, "token_budget": 64}).rows(max_model_len=512)
    assert budget == 64 and factory().token_budget == 64


def test_a_packer_pickles_with_its_options():
    packer = PACKERS.build({"name": "tree", "token_budget": 1024})
    assert pickle.loads(pickle.dumps(packer)).options == PackingOptions(token_budget=1024)


def test_bad_options_fail_naming_the_packer():
    with pytest.raises(RegistryError, match=r"packing 'flat' has no parameter 'attention' \(has: token_budget\)"):
        PACKERS.build({"name": "flat", "attention": "sdpa"})
    with pytest.raises(RegistryError, match="packing 'tree': token_budget=0 must be >= 1"):
        PACKERS.build({"name": "tree", "token_budget": 0})
