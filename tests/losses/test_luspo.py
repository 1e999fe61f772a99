"""LUSPO's length weighting: removes GSPO's 1/|o| per-token gradient (its float64 reference is in test_gspo)."""

from __future__ import annotations

import torch

from .conftest import run_loss


def test_per_token_gradient_does_not_depend_on_length(make_batch):
    # two on-policy sequences (s = 1) with the same advantage, lengths 1 and 4
    args = dict(logprobs=[-1.0] * 5, sampler_logprobs=[-1.0] * 5, advantages=[1.0] * 5, mask=[1] * 5,
                sequence_index=[0, 1, 1, 1, 1])  # fmt: skip
    gspo, luspo = make_batch(**args), make_batch(**args)
    run_loss("gspo", gspo).loss_sum.backward()
    run_loss("luspo", luspo).loss_sum.backward()
    # GSPO: -A s / |o| per token, so the long answer's tokens get a quarter of the push; LUSPO: -A s for all
    expected = torch.tensor([-1.0, -0.25, -0.25, -0.25, -0.25], dtype=torch.float64)
    torch.testing.assert_close(gspo.logprobs.grad, expected)
    torch.testing.assert_close(luspo.logprobs.grad, torch.full((5,), -1.0, dtype=torch.float64))
