"""The built-in server under bad HTTP input (the session server, as the CLI launches it): malformed bodies,
out-of-range sampling values, weight updates out of order, paths outside --weights-dir and calls without the
token each get a one-line 4xx, never a 5xx, and the server then generates exactly as before."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncrl.serving.process import ServerProcess

PROMPT = [5, 9, 14, 20, 33]
STATE_CHANGING = {
    "/pause": None,
    "/resume": None,
    "/init_weight_transfer_engine": {"init_info": {"backend": "builtin"}},
    "/start_weight_update": None,
    "/update_weights": {"update_info": {"path": "model.safetensors"}},
    "/finish_weight_update": {"weight_version": "stolen"},
    "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/tmp"},
    "/v1/unload_lora_adapter": {"lora_name": "x"},
}


@pytest.fixture(scope="module")
def http(tiny_server: ServerProcess, server_token: str) -> Iterator[httpx.Client]:
    """A client of the session server (on its base weights) that sends the token."""
    headers = {"Authorization": f"Bearer {server_token}"}
    with httpx.Client(base_url=tiny_server.base_url, timeout=60, headers=headers) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_before(http: httpx.Client) -> list[int]:
    return greedy(http)


def greedy(http: httpx.Client) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 0, "return_token_ids": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def one_line_4xx(response: httpx.Response) -> str:
    """The error message of a 4xx in vLLM's shape; fails on anything else, a 5xx above all."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == response.status_code and error["message"] and "\n" not in error["message"]
    return error["message"]


def post_raw(http: httpx.Client, path: str, body: bytes | None) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def serves_as_before(http: httpx.Client, tokens: list[int]) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/weight_info").json() == {"weight_version": "default"}
    assert greedy(http) == tokens


def test_calls_without_the_right_token_are_401_and_change_nothing(http, greedy_before, server_token):
    for authorization in (None, "Bearer wrong", server_token, f"Bearer {server_token}x", f"Basic {server_token}"):
        headers = {"Authorization": authorization} if authorization else {}
        with httpx.Client(base_url=http.base_url, timeout=30, headers=headers) as stranger:
            for path, body in STATE_CHANGING.items():
                response = stranger.post(path, json=body, params={"mode": "keep"})
                assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
                assert one_line_4xx(response).startswith(f"{path} needs the server's token")
    with httpx.Client(base_url=http.base_url, timeout=30) as anonymous:  # reading and generating stay open
        assert [anonymous.get(path).status_code for path in ("/health", "/v1/models", "/metrics")] == [200] * 3
        assert anonymous.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
        generate = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
        assert anonymous.post("/inference/v1/generate", json=generate).status_code == 200
    serves_as_before(http, greedy_before)


MALFORMED_JSON = [b"{", b"", b"null", b"[]", b'"text"', b"3", b"NaN", b'{"prompt": [3, 4,]}', b"\xff\xfe"]
BAD_BODIES: list[dict[str, Any]] = [
    {}, {"prompt": []}, {"prompt": ""}, {"prompt": None}, {"prompt": [1.5]}, {"prompt": [True]}, {"prompt": [-1]},
    {"prompt": [10**12]}, {"prompt": [[3, 4]]}, {"prompt": {"ids": [3]}}, {"prompt": PROMPT * 200},
    {"prompt": PROMPT, "stream": "yes"},
]  # fmt: skip
BAD_SAMPLING: list[dict[str, Any]] = [
    {"max_tokens": "5"}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 2.5}, {"temperature": -0.5},
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": "hot"}, {"top_p": 0}, {"top_p": 1.5},
    {"top_p": math.nan}, {"top_k": -5}, {"top_k": 1.0}, {"min_p": -0.1}, {"min_p": math.inf},
    {"repetition_penalty": 0}, {"repetition_penalty": math.nan}, {"repetition_penalty": math.inf},
    {"presence_penalty": math.nan}, {"seed": 2**63}, {"seed": "1"}, {"logprobs": -1}, {"logprobs": 10**9},
    {"stop_token_ids": [10**12]}, {"stop_token_ids": "2"}, {"min_tokens": 10**6}, {"n": 0}, {"n": 10**6}, {"model": 5},
    {"model": "another-model"},
]  # fmt: skip
BAD_CONTROL = [
    ("/init_weight_transfer_engine", {"init_info": [1]}), ("/init_weight_transfer_engine", {}),
    ("/update_weights", {"update_info": "model.safetensors"}), ("/update_weights", {}),
    ("/finish_weight_update", {"weight_version": 3}), ("/finish_weight_update", [1]),
    ("/pause?mode=sleep", None), ("/pause?clear_cache=maybe", None), ("/pause?mode=", None),
]  # fmt: skip


def test_malformed_bodies_get_one_line_4xx(http, greedy_before):
    for path in ("/v1/completions", "/inference/v1/generate", "/init_weight_transfer_engine", "/update_weights"):
        for raw in MALFORMED_JSON:
            one_line_4xx(post_raw(http, path, raw))
    for body in BAD_BODIES:
        one_line_4xx(post_raw(http, "/v1/completions", json.dumps(body).encode()))
    for fields in BAD_SAMPLING:  # json.dumps writes NaN and Infinity, which Python's JSON reader accepts
        one_line_4xx(post_raw(http, "/v1/completions", json.dumps({"prompt": PROMPT, **fields}).encode()))
        request = {"token_ids": PROMPT, "sampling_params": fields, "model": fields.get("model")}
        one_line_4xx(post_raw(http, "/inference/v1/generate", json.dumps(request).encode()))
    for bad_generate in (
        {"token_ids": PROMPT},
        {"token_ids": PROMPT, "sampling_params": [1]},
        {"token_ids": "3 4"},
        {"token_ids": PROMPT, "sampling_params": {}, "stream": "yes"},
    ):
        one_line_4xx(http.post("/inference/v1/generate", json=bad_generate))
    for path, body in BAD_CONTROL:
        one_line_4xx(http.post(path, json=body))
    assert one_line_4xx(http.get("/pause")) == "Method Not Allowed"
    assert one_line_4xx(http.post("/no_such_route")) == "Not Found"
    serves_as_before(http, greedy_before)


def test_extreme_but_valid_sampling_values_generate(http, greedy_before):
    """Values at the edge of each range (some overflow float32 in the sampler): a well-formed completion with
    finite log-probabilities, not a 5xx or NaN."""
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    edges = [{"top_k": 10**9}, {"temperature": 1e308}, {"temperature": 1e-308}, {"repetition_penalty": 1e308},
             {"repetition_penalty": 1e-308}, {"min_p": 1.0, "top_p": 1e-300}, {"seed": -(2**63)},
             {"max_tokens": 10**30, "prompt": [7] * (max_model_len - 2)}]  # fmt: skip
    for edge in edges:
        body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 2, "return_token_ids": True, **edge}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, (edge, response.text)
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) <= 2
        assert all(math.isfinite(value) for value in choice["logprobs"]["token_logprobs"])
    serves_as_before(http, greedy_before)


@pytest.fixture
def paused(http: httpx.Client) -> Iterator[httpx.Client]:
    """The server paused (keeping its requests) for a weight update; resumed afterwards whatever happened."""
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    try:
        yield http
    finally:
        http.post("/resume")


def test_weight_updates_out_of_order_are_400s(paused, greedy_before, random_tiny_model_dir):
    http = paused
    own_weights = {"update_info": {"path": str(random_tiny_model_dir / "model.safetensors")}}
    assert "start_weight_update" in one_line_4xx(http.post("/update_weights", json=own_weights))
    assert "start_weight_update" in one_line_4xx(http.post("/finish_weight_update", json={}))
    assert http.post("/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
    assert http.post("/start_weight_update").status_code == 200
    assert "already active" in one_line_4xx(http.post("/start_weight_update"))
    assert http.post("/update_weights", json=own_weights).status_code == 200
    assert http.post("/finish_weight_update", json={}).status_code == 200
    assert "start_weight_update" in one_line_4xx(http.post("/finish_weight_update", json={}))
    http.post("/resume")
    assert "paused" in one_line_4xx(http.post("/start_weight_update"))
    serves_as_before(http, greedy_before)


def test_paths_outside_the_weights_dir_are_refused_alike(
    paused, greedy_before, tmp_path, weights_root, random_tiny_model_dir
):
    """Outside the directory, missing, a directory, a symlink out of it, not a string: one message for all,
    and the weights stay as they were, even when the file outside holds valid weights for this model."""
    http = paused
    outside = Path(tempfile.mkdtemp(prefix="asyncrl-outside-"))  # under /tmp, beside pytest's root
    try:
        shutil.copy(random_tiny_model_dir / "model.safetensors", outside / "weights.safetensors")
        (tmp_path / "escape.safetensors").symlink_to(outside / "weights.safetensors")
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        relative_out = os.path.relpath(outside / "weights.safetensors", weights_root)
        inside = [tmp_path / "missing.safetensors", tmp_path, tmp_path / "escape.safetensors", tmp_path / "loop"]
        refused = [str(outside / "weights.safetensors"), str(outside / "missing.safetensors"), "/etc/passwd",
                   relative_out, *map(str, inside), "", "a\x00b", 5, None, ["x"]]  # fmt: skip
        assert http.post("/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
        messages = set()
        for path in refused:
            assert http.post("/start_weight_update").status_code == 200
            messages.add(one_line_4xx(http.post("/update_weights", json={"update_info": {"path": path}})))
            one_line_4xx(http.post("/finish_weight_update", json={}))  # the refusal ended the session
        assert messages == {f"update_info.path is refused: the server loads weight files only from inside its "
                            f"--weights-dir {weights_root.resolve()}"}  # fmt: skip
    finally:
        for leftover in outside.iterdir():
            leftover.unlink()
        outside.rmdir()
    http.post("/resume")
    serves_as_before(http, greedy_before)
