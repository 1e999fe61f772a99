"""SDPA for decoding without copying the KV cache per query head (grouped-query attention, one query token).

With a padding mask, transformers' SDPA path (before 5.24) expands keys and values to one copy per query head
(``repeat_kv``) because the fused kernels take no GQA flag with a mask: at 256 rows that copies the whole cache
twice per layer per decoding step. For one query token the query heads sharing a KV head can instead ride along
the query-length axis, ``[rows, heads, 1, dim] -> [rows, kv_heads, groups, dim]``, so the kernel reads each
cached key once. Prefill (several query tokens) goes to transformers' own SDPA unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_DECODE = "asyncrl_grouped_decode"


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [rows, query_len, heads, dim] as SDPA's does."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, query_len, dim = query.shape
    if query_len != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    folded = query.reshape(rows, heads // groups, groups, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=attention_mask, scale=scaling
    )
    return output.reshape(rows, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_decode_attention(model: torch.nn.Module) -> None:
    """Switch a model that runs transformers' SDPA to ``grouped_decode_attention``; leave any other one alone."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
    AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)
    model.set_attn_implementation(GROUPED_DECODE)
