"""The built-in server over real HTTP: vLLM's shapes and semantics, checked against a plain transformers forward."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file
from tiny import EOS_ID, MAX_MODEL_LEN, SERVED_NAME, VOCAB_SIZE
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.client import (
    Completion,
    ControlClient,
    GenerationClient,
    SamplingParams,
    ServerError,
    auth_headers,
    parse_token_key,
)

PROMPT = [5, 9, 14, 20, 33]


@pytest.fixture(scope="module")
def control(live_server) -> ControlClient:
    with ControlClient(live_server.base_url, timeout_s=30) as client:
        yield client


@pytest.fixture(scope="module")
def reference(live_server) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(live_server.model_dir, dtype=torch.float32).eval()


def post(base_url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={"model": SERVED_NAME, **body}, timeout=60)


def complete(base_url: str, **body: Any) -> dict[str, Any]:
    """One completion with token ids in and out; fails the test on any non-200."""
    response = post(base_url, {"return_token_ids": True, "return_tokens_as_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def reference_logits(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logits that predicted each completion token, from one unbatched forward of prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def generating(control: ControlClient) -> Callable[[], bool]:
    """A condition: some request is running and has produced tokens since this call."""
    start = control.metrics()["vllm:generation_tokens_total"]

    def check() -> bool:
        metrics = control.metrics()
        return metrics["vllm:num_requests_running"] >= 1 and metrics["vllm:generation_tokens_total"] > start

    return check


def test_info_endpoints_speak_vllm_shapes(live_server, control):
    assert control.served_model_name() == SERVED_NAME
    assert control.max_model_len() == MAX_MODEL_LEN
    assert control.models()[0]["root"] == str(live_server.model_dir)
    assert control.version().startswith("asyncrl-builtin-")
    assert httpx.get(f"{live_server.base_url}/get_world_size").json() == {"world_size": 1}
    assert control.is_paused() is False
    assert httpx.get(f"{live_server.base_url}/health").content == b""
    assert complete(live_server.base_url, prompt="a b c", max_tokens=1)["prompt_token_ids"] == [3, 4, 5]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_a_transformers_forward(live_server, reference, temperature):
    choice = complete(live_server.base_url, prompt=PROMPT, max_tokens=12, temperature=temperature, seed=1, logprobs=0)
    tokens = choice["token_ids"]
    expected = (reference_logits(reference, PROMPT, tokens) / temperature).log_softmax(-1)
    expected = expected.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    actual = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    assert choice["prompt_token_ids"] == PROMPT and choice["finish_reason"] == "length"


def test_top_k_logprobs_are_normalised_over_the_top_k_set(live_server, reference):
    choice = complete(live_server.base_url, prompt=PROMPT, max_tokens=10, temperature=0.8, top_k=5, seed=2,
                      logprobs=7, return_sampling_mask=True)  # fmt: skip
    tokens = choice["token_ids"]
    tempered = reference_logits(reference, PROMPT, tokens) / 0.8
    for i, token in enumerate(tokens):
        top_ids = tempered[i].topk(5).indices
        normalised = dict(zip(top_ids.tolist(), tempered[i][top_ids].log_softmax(-1).tolist(), strict=True))
        assert set(choice["sampling_masks"][i]) == set(normalised)
        assert choice["logprobs"]["token_logprobs"][i] == pytest.approx(normalised[token], abs=1e-4)
        top = {parse_token_key(key): value for key, value in choice["logprobs"]["top_logprobs"][i].items()}
        assert next(iter(top)) == token  # vLLM puts the sampled token first
        assert {k: v for k, v in top.items() if k in normalised} == pytest.approx(normalised, abs=1e-4)
        assert [v for k, v in top.items() if k not in normalised] == [-9999.0, -9999.0]  # outside the set


def test_seeds_reproduce_and_different_seeds_differ(live_server):
    def tokens(seed: int) -> list[int]:
        return complete(live_server.base_url, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)["token_ids"]

    assert tokens(7) == tokens(7)
    assert len({tuple(tokens(seed)) for seed in range(1, 6)}) > 1


def test_n_completions_are_the_requests_of_seeds_seed_to_seed_plus_n_minus_1(live_server):
    """vLLM splits a request of n completions into child requests drawing from seed, seed + 1, ...: the rollout
    worker's group requests (client.py) get what n requests of consecutive seeds would."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
    response = post(live_server.base_url, {**body, "seed": 7, "n": 3}).json()
    assert [choice["index"] for choice in response["choices"]] == [0, 1, 2]
    alone = [complete(live_server.base_url, **body, seed=seed) for seed in (7, 8, 9)]
    for choice, single in zip(response["choices"], alone, strict=True):
        assert choice["token_ids"] == single["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(single["logprobs"]["token_logprobs"], abs=1e-5)
    tokens = sum(len(choice["token_ids"]) for choice in response["choices"])
    assert response["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": tokens,
                                 "total_tokens": len(PROMPT) + tokens, "prompt_tokens_details": None}  # fmt: skip


def test_a_group_request_gives_each_rollout_what_its_own_request_would(live_server):
    """The rollout worker's client joins a group's first turns into one request of n (rollout.group_requests): each
    rollout gets the completion, log-probabilities and candidate sets of a request of its own seed."""
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=6, logprobs=2, seed=seed, return_sampling_mask=True)
              for seed in (21, 22, 23)]  # fmt: skip

    async def run(group_requests: bool) -> list[Completion]:
        async with GenerationClient(live_server.base_url, SERVED_NAME, timeout_s=30,
                                    group_requests=group_requests) as client:  # fmt: skip
            return await asyncio.gather(*(client.sample(PROMPT, p) for p in params))

    joined, alone = asyncio.run(run(True)), asyncio.run(run(False))
    for one, other in zip(joined, alone, strict=True):
        assert one.token_ids == other.token_ids and one.sampling_masks == other.sampling_masks
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-5)


def test_max_tokens_is_capped_to_the_context_and_a_full_prompt_is_rejected(live_server):
    long_prompt = [(i % 90) + 3 for i in range(MAX_MODEL_LEN - 12)]
    choice = complete(live_server.base_url, prompt=long_prompt, max_tokens=100, ignore_eos=True)
    assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"
    response = post(live_server.base_url, {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def test_eos_stops_unless_ignored_or_held_back_by_min_tokens(live_server):
    eos_prompt = PROMPT + [EOS_ID]  # the tiny model repeats its last token, so greedy decoding says EOS
    stopped = complete(live_server.base_url, prompt=eos_prompt, max_tokens=8, temperature=0.0)
    assert (stopped["token_ids"], stopped["finish_reason"], stopped["stop_reason"]) == ([EOS_ID], "stop", None)
    assert stopped["text"] == ""
    ignored = complete(live_server.base_url, prompt=eos_prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert ignored["finish_reason"] == "length" and len(ignored["token_ids"]) == 6
    held = complete(live_server.base_url, prompt=eos_prompt, max_tokens=8, temperature=0.0, min_tokens=3)
    assert EOS_ID not in held["token_ids"][:3]
    stop_id = complete(live_server.base_url, prompt=PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[PROMPT[-1]])
    assert (stop_id["token_ids"], stop_id["finish_reason"], stop_id["stop_reason"]) == ([33], "stop", 33)


def test_a_stop_string_ends_the_completion_as_vllms_does(live_server):
    """Token ids keep every generated token, the text is cut where the stop string starts, stop_reason names it;
    min_tokens holds it back, and the tokens-in endpoint takes it too."""
    free = complete(live_server.base_url, prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    text = free["text"]
    stop = text[3:5]  # two characters the greedy completion reaches after a few tokens
    stopped = complete(live_server.base_url, prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True,
                       stop=[stop, "never said"])  # fmt: skip
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert stopped["text"] == text[: text.find(stop)]
    assert stopped["token_ids"] == free["token_ids"][: len(stopped["token_ids"])]
    tokenizer = AutoTokenizer.from_pretrained(live_server.model_dir)
    assert tokenizer.decode(stopped["token_ids"], skip_special_tokens=True).endswith(stop)  # the last token ends it
    held = complete(live_server.base_url, prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop,
                    min_tokens=len(stopped["token_ids"]) + 1)  # fmt: skip
    assert len(held["token_ids"]) > len(stopped["token_ids"])
    params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    body = {"model": SERVED_NAME, "token_ids": PROMPT, "sampling_params": params}
    generated = httpx.post(f"{live_server.base_url}/inference/v1/generate", json=body, timeout=60).json()
    assert generated["choices"][0]["token_ids"] == stopped["token_ids"]
    assert generated["choices"][0]["stop_reason"] == stop


def test_pause_abort_ends_in_flight_requests_and_rejects_new_ones(live_server, control):
    with ThreadPoolExecutor(1) as pool:
        for _ in range(10):  # on a loaded machine the 480 tokens can finish before the pause lands: try again
            in_flight = pool.submit(complete, live_server.base_url, prompt=PROMPT, max_tokens=480, ignore_eos=True)
            wait_until(generating(control))
            control.pause("abort")
            choice = in_flight.result(timeout=30)
            if choice["finish_reason"] != "length":
                break
            control.resume()
        try:
            assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 480
            rejected = post(live_server.base_url, {"prompt": PROMPT})
            assert rejected.status_code == 503 and rejected.json()["error"]["code"] == 503
            assert control.is_paused()
        finally:
            control.resume()
    assert not control.is_paused()


def test_a_disconnected_client_has_its_request_aborted(live_server, control):
    with ThreadPoolExecutor(1) as pool:
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
        url = f"{live_server.base_url}/v1/completions"
        gone = pool.submit(httpx.post, url, json=body, timeout=1.0)
        wait_until(generating(control))
        control.pause("keep", clear_cache=False)  # frozen, so only the disconnect can end the request
        try:
            with pytest.raises(httpx.TimeoutException):
                gone.result(timeout=30)
            wait_until(lambda: control.metrics()["vllm:num_requests_running"] == 0, timeout_s=10)
        finally:
            control.resume()


def test_pause_wait_drains_in_flight_requests(live_server, control):
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(complete, live_server.base_url, prompt=PROMPT, max_tokens=150, ignore_eos=True)
        wait_until(generating(control))
        control.pause("wait")
        try:
            assert control.metrics()["vllm:num_requests_running"] == 0
            choice = in_flight.result(timeout=30)
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 150
            assert post(live_server.base_url, {"prompt": PROMPT}).status_code == 503
        finally:
            control.resume()


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_keep_freezes_queues_and_resumes_the_same_generation(live_server, control, clear_cache):
    # 400 tokens: the request must still be running when the test sees it generate (200 finished first once in CI)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "seed": 11, "logprobs": 0}
    uninterrupted = complete(live_server.base_url, **body)
    preemptions = control.metrics()["vllm:num_preemptions_total"]
    with ThreadPoolExecutor(2) as pool:
        started = generating(control)  # its counter is read before the request can produce a token
        frozen = pool.submit(complete, live_server.base_url, **body)
        wait_until(started)
        control.pause("keep", clear_cache=clear_cache)
        try:
            before = control.metrics()
            waiting = before["vllm:num_requests_waiting"]
            queued = pool.submit(complete, live_server.base_url, prompt=PROMPT, max_tokens=5)
            wait_until(lambda: control.metrics()["vllm:num_requests_waiting"] == waiting + 1)
            time.sleep(0.2)
            after = control.metrics()
            assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
            assert after["vllm:num_requests_running"] == (0 if clear_cache else 1)
            assert after["vllm:num_preemptions_total"] == preemptions + (1 if clear_cache else 0)
            assert not frozen.done() and not queued.done()
        finally:
            control.resume()
        resumed, short = frozen.result(timeout=60), queued.result(timeout=60)
    assert resumed["token_ids"] == uninterrupted["token_ids"] and resumed["finish_reason"] == "length"
    actual, expected = resumed["logprobs"]["token_logprobs"], uninterrupted["logprobs"]["token_logprobs"]
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=1e-4, rtol=0)
    assert short["finish_reason"] in ("length", "stop")


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    return str(path)


def update_weights(control: ControlClient, paths: list[str], version: str) -> None:
    control.pause("keep")
    try:
        control.init_weight_transfer({})
        control.start_weight_update()
        for path in paths:
            control.update_weights({"path": path, "dtype": "float32"})
        control.finish_weight_update(version)
    finally:
        control.resume()


def test_weight_update_serves_the_new_weights(live_server, control, reference, tmp_path):
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    original = {name: reference.state_dict()[name].clone() for name in names}
    noise = torch.Generator().manual_seed(3)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=noise) for name, t in original.items()}
    updated_reference = copy.deepcopy(reference)
    updated_reference.load_state_dict(perturbed, strict=False)
    chunks = [{name: perturbed[name]} for name in names]  # several update calls in one round
    update_weights(control, [write_weights(tmp_path / f"{i}.safetensors", c) for i, c in enumerate(chunks)], "1")
    try:
        assert control.weight_version() == "1"
        choice = complete(live_server.base_url, prompt=PROMPT, max_tokens=10, seed=5, logprobs=0)
        tokens = choice["token_ids"]
        actual = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
        for model, matches in ((updated_reference, True), (reference, False)):
            expected = reference_logits(model, PROMPT, tokens).log_softmax(-1)
            expected = expected.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            assert torch.allclose(actual, expected, atol=1e-4, rtol=0) is matches
    finally:
        update_weights(control, [write_weights(tmp_path / "original.safetensors", original)], "2")


def test_weight_update_sequence_errors_are_400s(control, tmp_path):
    with pytest.raises(ServerError) as not_paused:
        control.start_weight_update()
    assert not_paused.value.status == 400 and "paused" in not_paused.value.message
    control.pause("keep")
    try:
        with pytest.raises(ServerError) as not_started:
            control.update_weights({"path": "/nonexistent.safetensors"})
        assert not_started.value.status == 400 and "start_weight_update" in not_started.value.message
        for tensors, culprit in (({"lm_head.bias": torch.zeros(3)}, "lm_head.bias"),
                                 ({"model.norm.weight": torch.ones(7)}, "model.norm.weight")):  # fmt: skip
            control.init_weight_transfer({})
            control.start_weight_update()
            with pytest.raises(ServerError) as rejected:
                control.update_weights({"path": write_weights(tmp_path / "bad.safetensors", tensors)})
            assert rejected.value.status == 400 and culprit in rejected.value.message
            with pytest.raises(ServerError):  # the failed update ended the session, as in vLLM
                control.finish_weight_update("x")
        control.start_weight_update()
        with pytest.raises(ServerError) as twice:
            control.start_weight_update()
        assert twice.value.status == 400
        control.finish_weight_update(None)
    finally:
        control.resume()


def test_metrics_parse_with_vllm_names(control):
    metrics = control.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:cache_config_info", "asyncrl:batch_size_count", "asyncrl:batch_rows_max"):  # fmt: skip
        assert name in metrics, name
    assert control.cache_config()["kv_cache_size_tokens"] == str(32 * MAX_MODEL_LEN)
    assert control.cache_config()["model_name"] == SERVED_NAME


def test_concurrent_requests_are_batched(live_server, control):
    async def run() -> list:
        async with GenerationClient(live_server.base_url, SERVED_NAME, timeout_s=60) as client:
            params = [SamplingParams(max_tokens=16, seed=i, logprobs=1) for i in range(20)]
            return await asyncio.gather(*(client.complete(PROMPT, p) for p in params))

    completions = asyncio.run(run())
    assert len(completions) == 20
    for completion in completions:
        assert 0 < len(completion.token_ids) <= 16 and completion.finish_reason in ("length", "stop")
        assert len(completion.logprobs) == len(completion.token_ids) == len(completion.top_logprobs)
    assert control.metrics()["asyncrl:batch_rows_max"] > 1


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2, 3]",
        {},
        {"prompt": []},
        {"prompt": [1, "a"]},
        {"prompt": [3, -4]},
        {"prompt": [3, VOCAB_SIZE + 5]},
        {"prompt": [3, 4], "max_tokens": -1},
        {"prompt": [3, 4], "max_tokens": "5"},
        {"prompt": [3, 4], "logprobs": 21},
        {"prompt": [3, 4], "temperature": -0.5},
        {"prompt": [3, 4], "top_p": 0},
        {"prompt": [3, 4], "n": 0},
        {"prompt": [3, 4], "stream": True},
        {"prompt": [3, 4], "model": "some-other-model"},
    ],
    ids=repr,
)
def test_malformed_requests_get_4xx_json_and_the_server_stays_healthy(live_server, body):
    url = f"{live_server.base_url}/v1/completions"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["code"] == response.status_code and error["message"]
    assert httpx.get(f"{live_server.base_url}/health").status_code == 200


def test_unknown_model_is_404_and_bad_pause_mode_is_400(live_server):
    assert post(live_server.base_url, {"prompt": [3], "model": "nope"}).status_code == 404
    bad_mode = httpx.post(f"{live_server.base_url}/pause", params={"mode": "sleep"}, headers=auth_headers())
    assert bad_mode.status_code == 400
    assert httpx.get(f"{live_server.base_url}/is_paused").json() == {"is_paused": False}


def test_generation_client_retries_503_until_resume(live_server, control):
    control.pause("abort")
    resume = threading.Timer(1.0, control.resume)

    async def run():
        async with GenerationClient(live_server.base_url, SERVED_NAME, timeout_s=30, backoff_s=0.1) as client:
            completion = await client.complete(PROMPT, SamplingParams(max_tokens=4))
            return completion, client.retry_count

    resume.start()
    try:
        completion, retries = asyncio.run(run())
    finally:
        resume.join()
    assert retries > 0 and len(completion.token_ids) > 0
