"""benchmarks/deltanet_conv.py: its reference is the convolution transformers' gated-DeltaNet layers run without a
kernel package, so its figures time what the trainer ran before fla's kernel."""

from __future__ import annotations

import inspect
from types import ModuleType

import torch


def test_the_reference_is_transformers_own_convolution(deltanet_conv: ModuleType) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    transformers_reference = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    x, weight = torch.randn(1, 50, 12, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    theirs = transformers_reference(x.transpose(1, 2), weight).transpose(1, 2)
    torch.testing.assert_close(deltanet_conv.reference(x, weight), theirs, rtol=0, atol=1e-12)
    shifted = deltanet_conv.reference(torch.cat([torch.zeros(1, 3, 12, dtype=torch.float64), x], 1), weight)
    torch.testing.assert_close(shifted[:, 3:], theirs, rtol=0, atol=1e-12)  # causal: zeros before change nothing
