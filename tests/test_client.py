"""The HTTP clients against a scripted local server: request bodies, parsing, and what is retried."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from asyncrl.app_thread import serve_in_thread
from asyncrl.client import (
    Completion,
    ControlClient,
    GenerationClient,
    SamplingParams,
    ServerError,
    ServerLoad,
    choose_server,
    completion_fields,
    generate_fields,
    metric_labels,
    parse_metrics,
)
from asyncrl.serving.process import free_port

CHOICE = {
    "index": 0,
    "text": "x y",
    "logprobs": {
        "text_offset": [0, 1],
        "token_logprobs": [-0.5, -0.25],
        "tokens": ["token_id:7", "token_id:8"],
        "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.5}, {"token_id:8": -0.25}],
    },
    "finish_reason": "length",
    "stop_reason": None,
    "token_ids": [7, 8],
    "prompt_token_ids": [1, 2, 3],
    "sampling_masks": [[7, 9], [8]],
}


@dataclass
class Stub:
    """A server whose next /v1/completions answers are scripted: an HTTP status, "slow" to stall, or "one" to answer
    a request of n completions with one (unscripted, it sends n copies of CHOICE, its ``seed`` in ``stop_reason``)."""

    base_url: str = ""
    script: list[int | str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def build_stub_app(stub: Stub) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        stub.bodies.append(await request.json())
        body = stub.bodies[-1]
        action = stub.script.pop(0) if stub.script else 200
        if action == "slow":
            await asyncio.sleep(1.0)
            action = 200
        if action not in (200, "one"):
            error = {"message": f"scripted {action}", "type": "Scripted", "code": action}
            return JSONResponse({"error": error}, status_code=action)
        n = 1 if action == "one" else body.get("n", 1)
        choices = [{**CHOICE, "index": i, "stop_reason": body.get("seed")} for i in range(n)]
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": choices})

    @app.post("/pause")
    async def pause() -> JSONResponse:
        return JSONResponse({"error": "Invalid pause mode"}, status_code=400)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"detail": "Not Found"})  # a server that is not OpenAI-style, answering 200

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n'
            'vllm:num_requests_running{engine="1"} 3.0\n'
            'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="4096",engine="0"} 1.0\n'
        )

    return app


@pytest.fixture(scope="module")
def stub_server():
    stub = Stub()
    with serve_in_thread(build_stub_app(stub)) as base_url:
        stub.base_url = base_url
        yield stub


@pytest.fixture
def stub(stub_server: Stub) -> Stub:
    stub_server.script.clear()
    stub_server.bodies.clear()
    return stub_server


def complete(base_url: str, params: SamplingParams | None = None, **client_kwargs: Any):
    """Run one completion; return it (or the exception) and the client's retry count."""

    async def run():
        async with GenerationClient(base_url, "m", **{"timeout_s": 5.0, "backoff_s": 0.01, **client_kwargs}) as client:
            try:
                return await client.complete([1, 2, 3], params or SamplingParams()), client.retry_count
            except ServerError as error:
                return error, client.retry_count

    return asyncio.run(run())


def test_every_sampling_field_is_sent_and_token_ids_are_parsed(stub):
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2, seed=9, stop_token_ids=(4,),
                            return_sampling_mask=True)  # fmt: skip
    completion, retries = complete(stub.base_url, params)
    body = stub.bodies[0]
    assert body == {
        "model": "m", "prompt": [1, 2, 3], "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
        "repetition_penalty": 1.0, "max_tokens": 16, "min_tokens": 0, "logprobs": 2, "seed": 9, "stop_token_ids": [4],
        "ignore_eos": False,
        "return_sampling_mask": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    assert completion == Completion(token_ids=[7, 8], logprobs=[-0.5, -0.25],
                                    top_logprobs=[{7: -0.5, 9: -1.5}, {8: -0.25}], sampling_masks=[[7, 9], [8]],
                                    finish_reason="length", prompt_token_ids=[1, 2, 3])  # fmt: skip
    assert retries == 0


def sample_all(stub: Stub, requests: list[tuple[list[int], int]]) -> tuple[list[Completion], GenerationClient]:
    """Sample each (prompt, seed) at once through a client with group requests on."""

    async def run():
        async with GenerationClient(stub.base_url, "m", timeout_s=5.0, group_requests=True) as client:
            asked = [client.sample(ids, SamplingParams(max_tokens=2, seed=seed)) for ids, seed in requests]
            return await asyncio.gather(*asked), client

    return asyncio.run(run())


def test_rollouts_asking_for_the_same_turn_at_once_share_one_request_of_n(stub):
    completions, client = sample_all(stub, [([1, 2, 3], 5), ([1, 2, 3], 6), ([4], 7), ([1, 2, 3], 8)])
    assert sorted((b["prompt"], b.get("n"), b["seed"]) for b in stub.bodies) == [([1, 2, 3], 3, 5), ([4], None, 7)]
    assert [c.token_ids for c in completions] == [[7, 8]] * 4 and client.group_requests
    assert client.servers[0].requests == 4  # rollouts, which the choice of a server among replicas weighs


def test_a_server_answering_n_with_one_choice_gets_single_requests_from_then_on(stub, caplog):
    stub.script.append("one")
    completions, client = sample_all(stub, [([1, 2, 3], 5), ([1, 2, 3], 6), ([1, 2, 3], 7)])
    assert [(b.get("n"), b["seed"]) for b in stub.bodies[:1]] == [(3, 5)]
    assert sorted((b.get("n"), b["seed"]) for b in stub.bodies[1:]) == [(None, 5), (None, 6), (None, 7)]
    assert len(completions) == 3 and not client.group_requests
    assert "cannot answer a request of n completions" in caplog.text


def test_structured_outputs_and_generation_kwargs_join_either_endpoints_request():
    """vLLM's structured_outputs field, and the generation_kwargs as they are, at the top of /v1/completions' body and
    in /inference/v1/generate's sampling_params (both vLLM's SamplingParams fields)."""
    params = SamplingParams(structured_outputs_regex="[0-9]+", generation_kwargs={"stop": ["END"]}, top_k=5)
    for fields in (completion_fields(params), generate_fields(params)):
        assert fields["structured_outputs"] == {"regex": "[0-9]+"} and fields["stop"] == ["END"]
        assert fields["top_k"] == 5 and not {"structured_outputs_regex", "generation_kwargs"} & fields.keys()


def test_a_4xx_is_raised_at_once_with_the_server_message(stub):
    stub.script[:] = [400, 200]
    error, retries = complete(stub.base_url)
    assert isinstance(error, ServerError) and error.status == 400 and error.message == "scripted 400"
    assert error.path == "/v1/completions" and len(stub.bodies) == 1 and retries == 0


def test_5xx_429_and_timeouts_are_retried_until_success(stub):
    stub.script[:] = [503, 429, 500, "slow"]
    completion, retries = complete(stub.base_url, timeout_s=0.3)
    assert isinstance(completion, Completion) and retries == 4 and len(stub.bodies) == 5


def test_retries_are_bounded(stub):
    stub.script[:] = [503] * 10
    error, retries = complete(stub.base_url, max_retries=2)
    assert isinstance(error, ServerError) and error.status == 503
    assert retries == 2 and len(stub.bodies) == 3


def test_connection_errors_are_retried_then_raised():
    error, retries = complete(f"http://127.0.0.1:{free_port()}", max_retries=2)
    assert isinstance(error, ServerError) and error.status is None and retries == 2


def test_choice_without_token_ids_is_an_error():
    with pytest.raises(ValueError, match="return_token_ids"):
        Completion.from_choice({**CHOICE, "token_ids": None})


def test_control_errors_name_the_path_and_carry_the_server_message(stub):
    with ControlClient(stub.base_url, timeout_s=5) as control, pytest.raises(ServerError) as raised:
        control.pause("sleep")
    assert (raised.value.status, raised.value.path, raised.value.message) == (400, "/pause", "Invalid pause mode")


def test_an_answer_without_a_model_list_says_the_server_is_not_openai_style(stub):
    """A ServerError (one line at the CLI), not a KeyError's traceback, when server.base_url points elsewhere."""
    with ControlClient(stub.base_url, timeout_s=5) as control, pytest.raises(ServerError) as raised:
        control.max_model_len()
    assert raised.value.path == "/v1/models"
    assert f"{stub.base_url} is not an OpenAI-compatible server" in str(raised.value)


def test_metrics_are_summed_over_label_sets_and_labels_are_exposed(stub):
    with ControlClient(stub.base_url, timeout_s=5) as control:
        assert control.metrics()["vllm:num_requests_running"] == 5.0
        assert control.cache_config() == {"block_size": "16", "kv_cache_size_tokens": "4096", "engine": "0"}
    text = 'a{x="q\\"z",y="1"} 1.5 1700000000\n# HELP a\nb 2\n'
    assert parse_metrics(text) == {"a": 1.5, "b": 2.0}
    assert metric_labels(text, "a") == [{"x": 'q"z', "y": "1"}]


def test_wait_healthy_stops_when_the_process_dies_and_times_out_otherwise():
    with ControlClient(f"http://127.0.0.1:{free_port()}", timeout_s=1) as control:
        with pytest.raises(ServerError, match="exited"):
            control.wait_healthy(timeout_s=30, is_alive=lambda: False)
        with pytest.raises(TimeoutError):
            control.wait_healthy(timeout_s=0.3, is_alive=lambda: True)


def loads(*servers: tuple[int, float | None]) -> list[ServerLoad]:
    return [ServerLoad(f"http://s{i}", inflight=n, kv_cache_usage=kv) for i, (n, kv) in enumerate(servers)]


def test_a_request_goes_to_the_server_with_the_fewest_in_flight_then_the_emptiest_kv_cache():
    assert choose_server(loads((3, 0.1), (1, 0.9), (2, 0.0)), turn=0) == 1
    assert choose_server(loads((2, 0.5), (2, 0.2), (3, 0.0)), turn=0) == 1
    assert choose_server(loads((1, None), (1, 0.7)), turn=0) == 1  # a server not scraped yet ranks last


def test_equal_servers_take_turns():
    servers = loads((0, 0.0), (0, 0.0), (0, 0.0))
    assert [choose_server(servers, turn) for turn in range(5)] == [0, 1, 2, 0, 1]


def test_the_client_spreads_requests_over_its_servers(stub):
    """Two addresses of one scripted server: sequential requests alternate, and each server counts its own."""

    async def run() -> list[int]:
        async with GenerationClient([stub.base_url, stub.base_url + "/"], "m", timeout_s=5.0) as client:
            for _ in range(3):
                await client.complete([1, 2, 3], SamplingParams(max_tokens=2))
            return [server.requests for server in client.servers]

    assert asyncio.run(run()) == [2, 1]
