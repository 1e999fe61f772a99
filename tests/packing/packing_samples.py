"""Sample builders for the packing tests: single samples, and random GRPO-shaped sets that share prefixes.

`random_samples` draws what a row sees in training: groups of rollouts sharing a prompt, a system prefix
shared across groups, and multi-turn rollouts that fork (a later sample re-renders the conversation and
diverges inside it), over a small vocabulary so that accidental sharing happens too.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.rollout.types import PromptImages, RolloutSample, TrainingSequence

VOCAB_SIZE = 48
IMAGE_TOKEN, VISION_START, VISION_END = 47, 45, 46
"""build_tiny_vlm's image placeholder and the tokens a chat template puts around an image."""


def make_sample(
    tokens: list[int], prompt_len: int, group_id: int = 0, advantage: float = 1.0, seed: int = 0
) -> RolloutSample:
    """Prompt tokens untrained, the rest trained, with distinct sampler log-probabilities per token."""
    rng = random.Random(seed)
    mask = [0] * prompt_len + [1] * (len(tokens) - prompt_len)
    logprobs = [0.0 if m == 0 else -rng.uniform(0.1, 3.0) for m in mask]
    top = [
        None if m == 0 else {t: lp, (t + 1) % VOCAB_SIZE: lp - 1.0}
        for t, m, lp in zip(tokens, mask, logprobs, strict=True)
    ]
    sequence = TrainingSequence(list(tokens), mask, logprobs, sampler_top_logprobs=top)
    return RolloutSample(
        sequence=sequence, advantage=advantage, reward=advantage, group_id=group_id, row_index=group_id,
        prompt_index=group_id, model_version=0, rollout_id=f"{group_id}-{seed}",
    )  # fmt: skip


def random_samples(seed: int, num_groups: int = 3, max_group: int = 16) -> list[RolloutSample]:
    rng = random.Random(seed)
    system = _tokens(rng, rng.randint(0, 12))
    samples: list[RolloutSample] = []
    for group in range(num_groups):
        prompt = system + _tokens(rng, rng.randint(1, 24))
        for rollout in range(rng.randint(2, max_group)):
            completion = _tokens(rng, rng.randint(1, 20))
            advantage = rng.uniform(-2.0, 2.0)
            sample_seed = seed * 1000 + group * 100 + rollout
            samples.append(make_sample(prompt + completion, len(prompt), group, advantage, sample_seed))
            if rng.random() < 0.3:  # a multi-turn rollout whose next turn forks inside the conversation
                fork_at = rng.randint(1, len(prompt) + len(completion) - 1)
                turn = (prompt + completion)[:fork_at] + _tokens(rng, rng.randint(1, 10))
                samples.append(make_sample(turn, fork_at, group, advantage, sample_seed + 50))
    rng.shuffle(samples)
    return samples


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


def build_tiny_qwen3(seed: int = 0, head_dim: int = 8, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """2 layers, grouped-query attention (4 query heads, 2 KV heads), random weights."""
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).to(dtype)


def build_tiny_hybrid(seed: int = 0, vision: bool = False) -> torch.nn.Module:
    """Qwen3.5's gated-DeltaNet hybrid (DeltaNet, attention, DeltaNet, DeltaNet; 4 value heads over 2 key heads),
    with a one-block vision tower when ``vision``. Decay drawn mild (A in [0.05, 0.37], dt_bias in [-1, 0]) so a
    segment's recurrent state still carries its parent's tokens: with the initializer's A up to 16 the state
    forgets within a few tokens, and the parent's state would hardly be tested."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    text = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if vision:
            vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                 num_position_embeddings=16)  # fmt: skip
            config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision_config)
            model = Qwen3_5ForConditionalGeneration(config).float()
        else:
            model = Qwen3_5ForCausalLM(text).float()
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.uniform_(-3.0, -1.0)
                    module.dt_bias.uniform_(-1.0, 0.0)
    return model


def build_tiny_vlm(seed: int = 0, deltanet: bool = True) -> torch.nn.Module:
    """build_tiny_hybrid's vision-language model (a one-block vision tower, 16x16 patches merged 2x2) in float64,
    its image tokens inside the tiny vocabulary; without ``deltanet``, its four text layers all attention (Qwen3.5's
    gated-DeltaNet layers compute in float32 whatever the model's dtype)."""
    model = build_tiny_hybrid(seed, vision=True)
    config = model.config
    config.image_token_id = IMAGE_TOKEN
    config.vision_start_token_id, config.vision_end_token_id = VISION_START, VISION_END
    if not deltanet:
        config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = type(model)(config)
    return model.double()


def make_images(model: torch.nn.Module, grids: list[list[int]], seed: int) -> PromptImages:
    """Random pixel values (float64) for images of the given (t, h, w) patch grids, shaped for ``model``'s tower."""
    vision = model.config.vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor(grids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid.prod(-1).sum()), features, generator=generator, dtype=torch.float64)
    return PromptImages(pixels, grid, IMAGE_TOKEN, vision.spatial_merge_size)


def placeholders(images: PromptImages, index: int) -> list[int]:
    """Image ``index``'s placeholder tokens: one per merged patch."""
    return [IMAGE_TOKEN] * (int(images.image_grid_thw[index].prod()) // images.merge_size**2)


def build_tiny_gemma3(
    seed: int = 0,
    sliding_window: int = 6,
    final_logit_softcapping: float | None = None,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float64,
) -> torch.nn.Module:
    """Gemma 3's text model: sliding-window layers around a full-attention one (a window shorter than the
    samples, so that it matters), grouped-query attention, tied embeddings, random weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=head_dim, max_position_embeddings=256,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=final_logit_softcapping, pad_token_id=0, bos_token_id=None, eos_token_id=1,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Gemma3ForCausalLM(config).to(dtype)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):  # type: ignore[no-untyped-def]
    """What a varlen flash kernel computes: per sequence, causal attention aligned bottom-right, each query seeing
    at most window - 1 keys before its own (None: all)."""
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[lo:hi].transpose(0, 1) for t, lo, hi in
                      ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1])))  # fmt: skip
        n_q, n_k = qs.shape[1], ks.shape[1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
        if window is not None:
            mask &= torch.ones(n_q, n_k, dtype=torch.bool).triu(diagonal=n_k - n_q - window + 1)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True))
    return torch.cat([o.transpose(0, 1) for o in out])
