"""Image prompts on the built-in server, with the tiny vision-language checkpoint (``asyncrl.assets.tiny_vlm``): the
engine generates what transformers' own greedy loop generates for the same prompt and image, rows with and without
images decode together and through preemption as they do alone, and the chat route takes vLLM's image parts."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from tiny import engines
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from asyncrl.assets.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, save_tiny_vlm
from asyncrl.engine.batch import RunningBatch
from asyncrl.engine.chat import ChatCompletionRequest, as_completion_request
from asyncrl.engine.core import Engine
from asyncrl.engine.images import ImagePrompts, load_image_prompts
from asyncrl.engine.protocol import build_generation_request
from asyncrl.engine.rows import DecodeRow, GenerationRequest, GenerationResult
from asyncrl.prompts import render_prompt
from asyncrl.sampling import SamplingParams
from asyncrl.serving.process import ServerProcess, free_port

TOLERANCE = 1e-4
MAX_TOKENS = 10
SMALL, WIDE = (32, 32), (64, 48)
"""Image sizes (width, height): 4x4 and 8x6 patches of 8 pixels, so 4 and 12 image tokens (2x2 patches merge)."""


def data_url(size: tuple[int, int], seed: int) -> str:
    """A base64 PNG data URL of random RGB noise."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(text: str, *urls: str) -> list[dict[str, Any]]:
    """One user message: the images (OpenAI's image_url parts), then the text."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def tokenizer(random_tiny_vlm_dir):
    return AutoTokenizer.from_pretrained(random_tiny_vlm_dir)


@pytest.fixture(scope="module")
def vlm(random_tiny_vlm_dir) -> torch.nn.Module:
    """The checkpoint as transformers loads it, for reference generations (the engine runs its own copy)."""
    return AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(random_tiny_vlm_dir) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def image_prompts(served, tokenizer, random_tiny_vlm_dir) -> ImagePrompts:
    prompts = load_image_prompts(served, tokenizer, str(random_tiny_vlm_dir), trust_remote_code=False)
    assert prompts is not None
    return prompts


@pytest.fixture
def make_engine(served, tokenizer) -> Iterator:
    yield from engines(served, max_model_len=128, max_num_seqs=8, eos_token_id=tokenizer.eos_token_id)


def chat_request(tokenizer, image_prompts: ImagePrompts, messages: list[dict[str, Any]]) -> GenerationRequest:
    """The engine request the chat route makes of greedy ``messages``, with logprobs."""
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True}
    )
    completion, images = as_completion_request(body, tokenizer, 128, image_prompts)
    return build_generation_request(completion, tokenizer, served_model_name="tiny-vlm", max_model_len=128,
                                    max_logprobs=20, vocab_size=len(tokenizer), images=images)  # fmt: skip


@pytest.fixture(scope="module")
def requests(tokenizer, image_prompts) -> list[GenerationRequest]:
    """A small image, a wide one beside other text, two small ones, and text only."""
    return [
        chat_request(tokenizer, image_prompts, user("What is it?", data_url(SMALL, 1))),
        chat_request(tokenizer, image_prompts, user("Describe it, briefly.", data_url(WIDE, 2))),
        chat_request(tokenizer, image_prompts, user("Same?", data_url(SMALL, 1), data_url(SMALL, 3))),
        chat_request(tokenizer, image_prompts, [{"role": "user", "content": "What is 3 + 4?"}]),
    ]


def generate(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    futures = [engine.submit(request) for request in requests]
    return [future.result(timeout=120) for future in futures]


def generate_together(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """All of ``requests`` joining in one prefill."""
    engine.pause("keep", clear_cache=False)
    futures = [engine.submit(request) for request in requests]
    engine.resume()
    return [future.result(timeout=120) for future in futures]


def assert_same_generations(actual: list[GenerationResult], expected: list[GenerationResult]) -> None:
    for mine, theirs in zip(actual, expected, strict=True):
        assert mine.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=TOLERANCE, rtol=0)


def greedy_reference(model: torch.nn.Module, request: GenerationRequest) -> tuple[list[int], list[float]]:
    """transformers' ``generate`` on the request's prompt and images: greedy tokens and their logprobs."""
    ids = torch.tensor([request.prompt_ids])
    images = request.images
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=images.pixel_values,
                             image_grid_thw=images.image_grid_thw,
                             mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        score[0].double().log_softmax(-1)[token].item() for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def image_tokens(tokenizer, prompt: list[int]) -> int:
    return prompt.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD))


@pytest.mark.parametrize("index", [0, 1, 2], ids=["small", "wide", "two-images"])
def test_an_image_prompt_generates_what_transformers_generates_greedily(make_engine, vlm, requests, index):
    result = generate(make_engine(), [requests[index]])[0]
    tokens, logprobs = greedy_reference(vlm, requests[index])
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=TOLERANCE)


def test_images_of_different_grids_give_different_prompts_and_generations(make_engine, tokenizer, requests):
    small, wide, pair = requests[:3]
    assert [image_tokens(tokenizer, r.prompt_ids) for r in (small, wide, pair)] == [4, 12, 8]
    assert small.images.image_grid_thw.tolist() == [[1, 4, 4]] and wide.images.image_grid_thw.tolist() == [[1, 6, 8]]
    # an image's tokens span max(height, width) / 2 positions: 4 tokens over 2, 12 over 4, two images 8 over 4
    assert [r.images.rope_delta for r in (small, wide, pair)] == [-2, -8, -4]
    results = generate(make_engine(), [small, wide])
    assert results[0].token_ids != results[1].token_ids


def test_rows_with_and_without_images_decode_together_as_they_do_alone(make_engine, requests):
    engine = make_engine()
    together = generate_together(engine, requests)
    assert max(engine.stats().batch_sizes) == len(requests)
    assert_same_generations(together, [generate(engine, [request])[0] for request in requests])


def test_a_group_sharing_one_image_is_prefilled_once_and_a_row_of_another_image_apart(
    make_engine, served, tokenizer, requests, image_prompts
):
    """Rows of equal tokens share a prefill only when they share their images too (an n > 1 request's children)."""
    small = requests[0]
    other = chat_request(tokenizer, image_prompts, user("What is it?", data_url(SMALL, 4)))
    assert other.prompt_ids == small.prompt_ids
    group = [replace(small, request_id=f"g{k}") for k in range(3)]
    engine = make_engine()
    prefills: list[int] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if "inputs_embeds" in kwargs:  # a prefill with images
            prefills.append(len(kwargs["inputs_embeds"]))

    handle = served.register_forward_pre_hook(record, with_kwargs=True)
    try:
        results = generate_together(engine, [*group, other])
    finally:
        handle.remove()
    assert prefills == [2]  # the group's prompt once, the other image's once
    assert_same_generations(results[:3], [generate(engine, [small])[0]] * 3)
    assert_same_generations(results[3:], generate(engine, [other]))
    assert results[3].token_ids != results[0].token_ids


def test_preempted_rows_keep_their_images(make_engine, requests):
    roomy = generate_together(make_engine(), requests)
    tight = make_engine(max_model_len=64, kv_cache_tokens=64)
    assert_same_generations(generate_together(tight, requests), roomy)
    assert tight.stats().preemptions_total > 0


def test_a_re_prefilled_row_that_generated_image_tokens_continues_as_it_decoded(served, tokenizer, requests):
    """The prefill places image features itself: the model's own forward would take a generated image token for one
    of the prompt's images and fail the whole step."""
    batch = RunningBatch(served)
    row = DecodeRow(requests[1], random.Random(0))
    forced = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, IMAGE_PAD, VISION_END, "a"])
    with torch.inference_mode():
        batch.join([row])
        for token in forced:
            row.output_ids.append(token)
            decoded = batch.decode()  # the logits after ``token``
        prefilled = batch.join(batch.clear())  # preempted, then prefilled from the prompt and every forced token
    torch.testing.assert_close(prefilled, decoded, atol=TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def vlm_server(random_tiny_vlm_dir, weights_root, tmp_path_factory) -> Iterator[ServerProcess]:
    """`python -m asyncrl.engine` on the tiny vision-language checkpoint."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(random_tiny_vlm_dir), "--served-model-name",
            "tiny-vlm", "--port", str(port), "--device", "cpu", "--weights-dir", str(weights_root)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("vlm-server-log") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log_path, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process


def chat(base_url: str, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", json={"messages": messages, **body}, timeout=60)


def test_the_chat_route_takes_a_base64_png_and_answers_token_ids(vlm_server, vlm, tokenizer, image_prompts):
    url = data_url(WIDE, 5)
    response = chat(vlm_server.base_url, user("What is it?", url), max_tokens=MAX_TOKENS, temperature=0.0,
                    logprobs=True, return_token_ids=True)  # fmt: skip
    assert response.status_code == 200, response.text
    answer = response.json()
    prompt, choice = answer["prompt_token_ids"], answer["choices"][0]
    assert image_tokens(tokenizer, prompt) == 12 and answer["usage"]["prompt_tokens"] == len(prompt)
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])
    rendered = render_prompt(tokenizer, user("What is it?", url), {})  # one placeholder per image
    ids, images = image_prompts.inputs(rendered, [{"type": "image_url", "image_url": {"url": url}}])
    assert ids == prompt
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert choice["token_ids"] == greedy_reference(vlm, GenerationRequest("ref", ids, params, images=images))[0]
    huggingface_part = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "x"}]}]
    openai_part = user("x", url)
    prompts = [chat(vlm_server.base_url, m, max_tokens=1, return_token_ids=True).json()["prompt_token_ids"]
               for m in (huggingface_part, openai_part)]  # fmt: skip
    assert prompts[0] == prompts[1]
    text_only = chat(vlm_server.base_url, [{"role": "user", "content": "1 + 2"}], max_tokens=1).json()
    assert text_only["prompt_token_ids"] is None and text_only["choices"][0]["token_ids"] is None


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "base64 data: URLs only"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "not a base64 image"),
        ({"type": "image_url"}, "needs image_url.url"),
        ({"type": "input_audio"}, "serves text and images only"),
    ],
    ids=["remote-url", "not-an-image", "no-url", "audio"],
)
def test_bad_image_parts_are_one_line_400s(vlm_server, part, message):
    response = chat(vlm_server.base_url, [{"role": "user", "content": [part]}], max_tokens=1)
    error = response.json()["error"]["message"]
    assert response.status_code == 400 and message in error and "\n" not in error, response.text


def test_a_text_only_model_refuses_an_image_with_one_line_400(tiny_server):
    response = chat(tiny_server.base_url, user("What is it?", data_url(SMALL, 1)), max_tokens=1)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        "messages: image content parts, but the served model has no vision tower: it serves text only"
    )


def test_the_builder_writes_a_small_deterministic_checkpoint_that_loads_offline(random_tiny_vlm_dir, tmp_path):
    model = AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert sum(path.stat().st_size for path in Path(random_tiny_vlm_dir).iterdir()) < 5_000_000
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_vlm_dir)
    ids = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    config = model.config
    assert ids == [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    assert AutoImageProcessor.from_pretrained(random_tiny_vlm_dir).merge_size == config.vision_config.spatial_merge_size
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2"}], tokenize=False,
                                         add_generation_prompt=True) == "<|user|>1 + 2<|end|><|assistant|>"  # fmt: skip

    def weights_digest(seed: int) -> str:
        return hashlib.sha256(
            (save_tiny_vlm(tmp_path / str(seed), seed) / "model.safetensors").read_bytes()
        ).hexdigest()

    assert weights_digest(0) == hashlib.sha256((random_tiny_vlm_dir / "model.safetensors").read_bytes()).hexdigest()
    assert weights_digest(1) != weights_digest(0)


def test_auto_processor_loads_the_builders_folder_and_expands_images_alike(
    random_tiny_vlm_dir, tokenizer, image_prompts
):
    """Qwen's processor needs torchvision (transformers builds it with its video processor): where it is installed,
    it loads the folder and expands an image as the server does."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(random_tiny_vlm_dir)
    url = data_url(WIDE, 6)
    messages = user("What is it?", url)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2])))])
    rendered = render_prompt(tokenizer, messages, {})
    ids, images = image_prompts.inputs(rendered, [{"type": "image_url", "image_url": {"url": url}}])
    assert ids == expected["input_ids"][0].tolist()
    assert images.image_grid_thw.tolist() == expected["image_grid_thw"].tolist()
