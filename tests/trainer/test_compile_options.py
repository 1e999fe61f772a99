"""The trainer's Inductor options: valid keys of the installed torch, and only for Inductor."""

from __future__ import annotations

import torch

from asyncrl.trainer.compile_options import NON_STRICT_MIX_ORDER, inductor_options


def test_inductor_compiles_without_the_row_length_checks_of_its_mix_order_reduction():
    options = inductor_options("inductor")
    assert options == {NON_STRICT_MIX_ORDER: True}  # this torch has the option: a rename brings the guards back
    with torch._inductor.config.patch(options):  # a key Inductor does not know raises here
        assert torch._inductor.config.triton.mix_order_reduction_non_strict_mode


def test_other_backends_get_no_inductor_options():
    assert inductor_options("aot_eager") is None and inductor_options("eager") is None
