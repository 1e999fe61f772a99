"""`python -m asyncrl.engine` on a tiny Qwen3.5 vision-language checkpoint (gated-DeltaNet hybrid): it loads the
whole model, serves text with a plain forward's logprobs, and a weight update of some text tensors changes them."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from asyncrl.client import Completion, ControlClient, GenerationClient, SamplingParams
from asyncrl.serving.process import ServerProcess

PROMPTS = [[9, 30, 41, 52, 17], [12, 60, 33]]
UPDATED = ["model.language_model.layers.0.linear_attn.out_proj.weight",
           "model.language_model.layers.3.self_attn.o_proj.weight", "model.language_model.norm.weight"]  # fmt: skip


@pytest.fixture(scope="module")
def vlm(random_tiny_vlm_dir) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vlm_server(fresh_vlm_server) -> ServerProcess:
    return fresh_vlm_server()


def complete_all(server: ServerProcess) -> list[tuple[list[int], list[float]]]:
    """Greedy completions of PROMPTS sent together (batched on the server): token ids and their logprobs."""

    async def run() -> list[Completion]:
        async with GenerationClient(server.base_url, served_name(server), timeout_s=60) as client:
            params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
            return await asyncio.gather(*(client.complete(prompt, params) for prompt in PROMPTS))

    return [(result.token_ids, result.logprobs) for result in asyncio.run(run())]


def served_name(server: ServerProcess) -> str:
    """The name the server serves its model under (--served-model-name)."""
    return server.argv[server.argv.index("--served-model-name") + 1]


def forward_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def served_logprobs_match(model: torch.nn.Module, served: list[tuple[list[int], list[float]]]) -> bool:
    return all(torch.allclose(torch.tensor(logprobs, dtype=torch.float64), forward_logprobs(model, prompt, tokens),
                              atol=1e-4, rtol=0)
               for prompt, (tokens, logprobs) in zip(PROMPTS, served, strict=True))  # fmt: skip


def test_a_hybrid_vlm_serves_a_plain_forwards_logprobs_and_takes_a_text_weight_update(vlm, vlm_server, tmp_path):
    served = complete_all(vlm_server)
    assert served_logprobs_match(vlm, served)
    with ControlClient(vlm_server.base_url, timeout_s=30) as control:
        before = control.metrics()["vllm:generation_tokens_total"]
        again = complete_all(vlm_server)
        assert control.metrics()["vllm:generation_tokens_total"] - before == sum(len(t) for t, _ in again)
        noise = torch.Generator().manual_seed(3)
        updated = copy.deepcopy(vlm)
        tensors = {key: vlm.state_dict()[key] + 0.2 * torch.randn(vlm.state_dict()[key].shape, generator=noise)
                   for key in UPDATED}  # fmt: skip
        updated.load_state_dict(tensors, strict=False)
        path = tmp_path / "update.safetensors"
        save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, str(path))
        control.pause("keep", clear_cache=True)
        try:
            control.init_weight_transfer({})
            control.start_weight_update()
            control.update_weights({"path": str(path)})
            control.finish_weight_update("1")
        finally:
            control.resume()
    served = complete_all(vlm_server)
    assert served_logprobs_match(updated, served) and not served_logprobs_match(vlm, served)
