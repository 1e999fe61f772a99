"""HTTP clients for the generation server (vLLM or the built-in one): async generation, sync control.

The rollout worker generates with ``GenerationClient`` (token ids in, token ids + processed logprobs out,
retrying only what a retry can fix); the trainer and launcher use ``ControlClient`` for health, model info,
pause/resume, metrics and the weight update sequence.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

import httpx

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_LABEL_ESCAPE = re.compile(r"\\(.)")
_TOKEN_KEY = "token_id:"


class ServerError(RuntimeError):
    """A request the server refused or could not answer; ``status`` is None when no response came."""

    def __init__(self, status: int | None, path: str, message: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}" if status is not None else f"{path}: {message}")
        self.status = status
        self.path = path
        self.message = message


def _error_message(response: httpx.Response) -> str:
    """The server's message from vLLM's ErrorResponse, FastAPI's detail, or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(body)


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling fields; every one is sent explicitly so server defaults never apply.

    ``logprobs`` is the number of top logprobs per token (0: the sampled token's only; None: none at all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    return_sampling_mask: bool = False

    def request_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["stop_token_ids"] = list(self.stop_token_ids)
        return fields


def parse_token_key(key: str) -> int:
    """Token id of a ``"token_id:N"`` key (what ``return_tokens_as_token_ids`` makes the server send)."""
    if not key.startswith(_TOKEN_KEY):
        raise ValueError(f"top_logprobs key {key!r} is not of the form 'token_id:N' (return_tokens_as_token_ids)")
    return int(key[len(_TOKEN_KEY) :])


@dataclass(frozen=True, slots=True)
class Completion:
    """One generated turn: ids, processed logprobs per token, optional top logprobs and candidate sets."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    sampling_masks: list[list[int]] | None
    finish_reason: str
    prompt_token_ids: list[int]

    @classmethod
    def from_choice(cls, choice: dict[str, Any]) -> Completion:
        """Read a /v1/completions choice made with return_token_ids and return_tokens_as_token_ids."""
        if choice.get("token_ids") is None:
            raise ValueError("completion choice has no token_ids: the request must set return_token_ids")
        logprobs = choice.get("logprobs")
        tops = None
        if logprobs is not None and logprobs.get("top_logprobs") is not None:
            tops = [{parse_token_key(k): v for k, v in (entry or {}).items()} for entry in logprobs["top_logprobs"]]
        return cls(
            token_ids=list(choice["token_ids"]),
            logprobs=list(logprobs["token_logprobs"]) if logprobs is not None else None,
            top_logprobs=tops,
            sampling_masks=choice.get("sampling_masks"),
            finish_reason=choice["finish_reason"],
            prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        )


class GenerationClient:
    """Async /v1/completions client; retries transport errors, timeouts, 5xx and 429 with capped backoff."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout_s: float,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ) -> None:
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retry_count = 0
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, limits=limits)

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            **params.request_fields(),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        response = await self._post("/v1/completions", body)
        return Completion.from_choice(response["choices"][0])

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                response = await self._client.post(path, json=body)
            except httpx.TransportError as error:  # connection failures and timeouts
                failure = ServerError(None, path, f"{type(error).__name__}: {error}")
            else:
                if response.status_code < 400:
                    return response.json()
                failure = ServerError(response.status_code, path, _error_message(response))
                if not _retryable(response.status_code):
                    raise failure
            if attempt >= self.max_retries:
                raise failure
            await asyncio.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
            attempt += 1
            self.retry_count += 1

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> value per sample name, summed over label sets (e.g. over vLLM engines)."""
    values: dict[str, float] = {}
    for name, _, value in _samples(text):
        values[name] = values.get(name, 0.0) + value
    return values


def metric_labels(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample called ``name``, e.g. vllm:cache_config_info's configuration."""
    return [labels for sample, labels, _ in _samples(text) if sample == name]


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        match = None if line.startswith("#") else _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        label_values = {key: _LABEL_ESCAPE.sub(_unescape, raw) for key, raw in _LABEL.findall(labels or "")}
        samples.append((name, label_values, float(value)))
    return samples


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match.group(1) == "n" else match.group(1)


class ControlClient:
    """Sync client for everything but generation; each call checks the status and has a timeout."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise ServerError(None, path, f"{type(error).__name__}: {error}") from error
        if response.status_code >= 400:
            raise ServerError(response.status_code, path, _error_message(response))
        return response

    def wait_healthy(self, timeout_s: float, is_alive: Callable[[], bool] | None = None) -> None:
        """Poll /health until 200; stop early if ``is_alive()`` turns false (the server process died)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if is_alive is not None and not is_alive():
                raise ServerError(None, "/health", f"the server at {self.base_url} exited before becoming healthy")
            try:
                self._request("GET", "/health", timeout=min(5.0, timeout_s))
                return
            except ServerError as error:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.base_url} not healthy after {timeout_s:.0f} s: {error}") from error
            time.sleep(0.25)

    def models(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/models").json()["data"]

    def max_model_len(self) -> int:
        return int(self.models()[0]["max_model_len"])

    def served_model_name(self) -> str:
        return str(self.models()[0]["id"])

    def version(self) -> str:
        return str(self._request("GET", "/version").json()["version"])

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        """POST /pause; ``timeout_s`` overrides the client timeout (mode="wait" lasts until requests drain)."""
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        self._request("POST", "/pause", params=params, **extra)

    def resume(self) -> None:
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused").json()["is_paused"])

    def metrics_text(self) -> str:
        return self._request("GET", "/metrics").text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def cache_config(self) -> dict[str, str]:
        """Labels of vllm:cache_config_info (kv_cache_size_tokens, block_size, num_gpu_blocks, ...)."""
        labels = metric_labels(self.metrics_text(), "vllm:cache_config_info")
        if not labels:
            raise ServerError(200, "/metrics", "no vllm:cache_config_info sample")
        return labels[0]

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, version: str | None = None) -> None:
        self._request("POST", "/finish_weight_update", json={} if version is None else {"weight_version": version})

    def weight_version(self) -> str:
        return str(self._request("GET", "/weight_info").json()["weight_version"])

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
