"""Mixture-of-Experts (trainer/moe.py): packed rows return the router's load-balancing loss over their forwarded
tokens, the step loss adds it with its coefficient, and the coefficient resolves as the spec says."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from asyncrl.config.compose import compose, to_config
from asyncrl.config.errors import ConfigError
from asyncrl.losses import LOSSES
from asyncrl.losses.step import StepLoss
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.moe import check_router_aux_coef, router_aux_coef

sys.path.insert(0, str(Path(__file__).parents[1] / "packing"))
from packing_samples import VOCAB_SIZE, random_samples  # noqa: E402
from test_exactness import TEMPERATURE, alone_logprobs, pack  # noqa: E402

from asyncrl.packing import FlatRow, TreeRow  # noqa: E402


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def segment_router_logits(model, row) -> tuple[torch.Tensor, ...]:
    """Reference: each segment's path forwarded alone; its own tokens' router logits, per layer, in layout order."""
    per_layer = None
    for seg in row.segments:
        path = row.input_ids[seg.kv_index][None]
        logits = model(input_ids=path, output_router_logits=True, use_cache=False).router_logits
        own = [layer.reshape(-1, layer.shape[-1])[-(seg.q_end - seg.q_start) :] for layer in logits]
        per_layer = own if per_layer is None else [torch.cat([a, b]) for a, b in zip(per_layer, own, strict=True)]
    return tuple(per_layer)


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_packed_rows_return_the_load_balancing_loss_of_their_forwarded_tokens(row_cls):
    row = pack(random_samples(0, num_groups=2, max_group=4), row_cls)
    model = tiny_moe()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    out = packed_forward(model, row, TEMPERATURE, attention="sdpa", router_aux=True)
    torch.testing.assert_close(out.logprobs, alone_logprobs(reference, row.samples), atol=1e-5, rtol=0)
    config = model.config
    expected = load_balancing_loss_func(segment_router_logits(reference, row), config.num_experts,
                                        config.num_experts_per_tok)  # fmt: skip
    torch.testing.assert_close(out.aux_loss, expected, atol=1e-6, rtol=1e-5)
    assert packed_forward(model, row, TEMPERATURE, attention="sdpa").aux_loss is None


def test_the_step_loss_adds_the_weighted_mean_over_rows_and_logs_it():
    row = pack(random_samples(1, num_groups=1, max_group=3))
    model = tiny_moe(1)
    step = StepLoss(LOSSES.build({"name": "clipped"}))
    step.router_aux_coef = 0.5
    norm = step.norm([row, row])  # two micro-batches: each adds half of its share
    out = packed_forward(model, row, TEMPERATURE, attention="sdpa", router_aux=True)
    with_aux, metrics, _ = step.loss(step.batch(row, out, norm), norm, out.aux_loss)
    without, _, _ = step.loss(step.batch(row, out, norm), norm)
    torch.testing.assert_close(with_aux - without, 0.5 * out.aux_loss / 2)
    assert metrics["aux_loss"] == pytest.approx(float(out.aux_loss.detach()))
    with_aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_the_coefficient_resolves_from_the_model_config_and_refuses_dense_models(random_tiny_model_dir):
    moe, dense = tiny_moe().config, random_tiny_model_dir
    config = to_config(compose([]))
    assert router_aux_coef(config, moe) == 0.02
    assert router_aux_coef(to_config(compose(["model.router_aux_loss_coef=0"])), moe) == 0.0
    assert router_aux_coef(config, Qwen3MoeConfig.from_dict({})) == 0.001  # the class default
    with pytest.raises(ConfigError, match=r"model.router_aux_loss_coef=0.1 is set, but .* not a Mixture-of-Experts"):
        check_router_aux_coef(to_config(compose([f"model.name_or_path={dense}", "model.router_aux_loss_coef=0.1"])))
    with pytest.raises(ConfigError, match="must be >= 0"):
        check_router_aux_coef(to_config(compose([f"model.name_or_path={dense}", "model.router_aux_loss_coef=-1"])))
    assert check_router_aux_coef(to_config(compose([f"model.name_or_path={dense}"]))) == 0.0
