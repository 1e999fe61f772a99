"""The built-in server's HTTP API: vLLM's paths, bodies, error shape and metric names over the ``Engine``.

Weight updates use the built-in transport: ``update_info = {"path": "/abs/file.safetensors"}`` names a file
of state_dict tensors written by the trainer (see ``weight_updates.py``). Batch-size evidence in /metrics is the
histogram ``asyncrl:batch_size`` (rows per model forward) and the gauge ``asyncrl:batch_rows_max``. With
``--enable-lora`` it also serves vLLM's runtime LoRA endpoints (``lora.py``) and a ``/server_info`` that
reports the LoRA limits where vLLM's does.

Security. Every request that changes the server's state (every POST but the generation routes: pause,
resume, the weight update sequence, LoRA load/unload) needs ``Authorization: Bearer <token>``, the token the
server was started with in the environment variable ``ASYNCRL_SERVER_TOKEN`` (the environment, not argv, so
``ps`` does not show it; the CLI generates one per run, ``asyncrl serve`` prints it, and asyncrl's clients send
it from the same variable); a missing or wrong one is a 401 before the body is read. GETs (/health, /v1/models,
/metrics, ...) and generation (/v1/completions, /v1/chat/completions, /inference/v1/generate) stay open: they
change no state, they are what monitoring and evaluation tools probe without the run's secret, the weights they
expose are the model's the user served, and the server binds to loopback unless told otherwise (``__main__``
warns when not).
Weights and adapters load only from ``--weights-dir`` (``weight_updates.py``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from asyncrl import __version__
from asyncrl.engine.chat import ChatCompletionRequest, chat_completion_response
from asyncrl.engine.chat import as_completion_request as chat_as_completion
from asyncrl.engine.core import Engine, EngineStats, EngineUnavailable
from asyncrl.engine.generate import GenerateRequest, as_completion_request, generate_response
from asyncrl.engine.images import ImageInputs, ImagePrompts
from asyncrl.engine.lora import AdapterNotFound
from asyncrl.engine.protocol import (
    CompletionRequest,
    ModelNotFound,
    TokenTexts,
    build_generation_request,
    completion_response,
    fan_out,
)
from asyncrl.engine.rows import GenerationResult
from asyncrl.engine.weight_updates import WeightsDir, WeightUpdater

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
OPEN_POSTS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
"""The POST routes anyone may call: generation changes no server state (the module docstring says why)."""


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """vLLM's ErrorResponse body, its message on one line."""
    message = re.sub(r"\s*\n\s*", " ", message.strip())
    error = {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"), "param": None, "code": status}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class TokenGuard:
    """ASGI middleware: a request that may change state without ``Authorization: Bearer <token>`` is a 401,
    answered before its body is read or its route runs."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    def _allowed(self, scope: Scope) -> bool:
        if scope["method"] in ("GET", "HEAD") or scope["path"] in OPEN_POSTS:
            return True
        sent = Headers(scope=scope).get("authorization", "").encode()
        return secrets.compare_digest(sent, self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        message = (
            f"{scope['path']} needs the server's token: send 'Authorization: Bearer <token>' with the "
            "ASYNCRL_SERVER_TOKEN the server was started with (asyncrl serve prints it)"
        )
        await error_response(401, message, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected. The body was read already, so the ASGI server's next message is
    the disconnect: waiting for it costs nothing, where polling ``is_disconnected`` woke every request each second.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_message(error: RequestValidationError | ValidationError) -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        parts.append(f"{location or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts)


class InitWeightTransferBody(BaseModel):
    model_config = ConfigDict(strict=True)
    init_info: dict[str, Any]


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(strict=True)
    update_info: dict[str, Any]


class FinishWeightUpdateBody(BaseModel):
    model_config = ConfigDict(strict=True)
    weight_version: str | None = None


class LoadLoraAdapterBody(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterBody(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class BuiltinServer:
    """Route handlers bound to one engine, tokenizer and served model name."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        served_model_name: str,
        model_path: str,
        max_logprobs: int,
        weights_dir: Path | None = None,
        token: str | None = None,
        image_prompts: ImagePrompts | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_logprobs = max_logprobs
        self.allowed = WeightsDir(weights_dir)
        self.weights = WeightUpdater(engine, self.allowed)
        self.token = token
        """None: no route needs a token (in-process tests only; ``__main__`` always has one)."""
        self.image_prompts = image_prompts
        """None: chat requests with images are a 400 (a text-only model)."""

    async def completions(self, request: Request, body: CompletionRequest) -> dict[str, Any]:
        results = await self._run(request, body)
        return completion_response(results, body, self.texts, self.served_model_name)

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> dict[str, Any]:
        """OpenAI's chat endpoint: the messages through the model's chat template, then /v1/completions' path."""
        max_model_len = self.engine.config.max_model_len
        completion, images = chat_as_completion(body, self.tokenizer, max_model_len, self.image_prompts)
        results = await self._run(request, completion, images)
        return chat_completion_response(results, completion, self.texts, self.served_model_name)

    async def generate(self, request: Request, body: GenerateRequest) -> dict[str, Any]:
        """vLLM's tokens-in/tokens-out endpoint: the same request as /v1/completions, another response shape."""
        completion = as_completion_request(body)
        results = await self._run(request, completion)
        return generate_response(results, completion, self.served_model_name)

    async def _run(
        self, request: Request, body: CompletionRequest, images: ImageInputs | None = None
    ) -> list[GenerationResult]:
        """Validate ``body`` against this server, generate its ``n`` completions (of a prompt with ``images``), and
        abort them if its client disconnects."""
        generation = build_generation_request(
            body,
            self.tokenizer,
            served_model_name=self.served_model_name,
            max_model_len=self.engine.config.max_model_len,
            max_logprobs=self.max_logprobs,
            vocab_size=self.engine.vocab_size,
            adapters=self.adapter_names(),
            images=images,
        )
        children = fan_out(generation, body.n)
        waiter = asyncio.gather(*(asyncio.wrap_future(self.engine.submit(child)) for child in children))
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
        if not waiter.done():
            for child in children:
                self.engine.abort(child.request_id)  # the client went away, as vLLM does
        return list(await waiter)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "asyncrl",
            "root": self.model_path,
            "parent": None,
            "max_model_len": self.engine.config.max_model_len,
            "permission": [],
        }
        adapters = self.engine.adapters.cards(created=0) if self.engine.adapters else []
        return {"object": "list", "data": [card, *adapters]}

    def adapter_names(self) -> list[str]:
        return list(self.engine.adapters.adapters) if self.engine.adapters else []

    def server_info(self) -> dict[str, Any]:
        """The part of vLLM's dev-mode /server_info the trainer reads: the LoRA limits, or null without LoRA."""
        adapters = self.engine.adapters
        lora = (
            None
            if adapters is None
            else {"max_loras": adapters.limits.max_loras, "max_lora_rank": adapters.limits.max_lora_rank}
        )
        return {"vllm_config": {"lora_config": lora}}

    def load_lora_adapter(self, body: LoadLoraAdapterBody) -> PlainTextResponse:
        path = self.allowed.adapter(body.lora_name, body.lora_path)
        self.engine.load_adapter(body.lora_name, str(path), body.load_inplace)
        logger.info("loaded LoRA adapter %r from %s", body.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    def unload_lora_adapter(self, body: UnloadLoraAdapterBody) -> PlainTextResponse:
        self.engine.unload_adapter(body.lora_name)
        logger.info("unloaded LoRA adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> dict[str, str]:
        self.engine.pause(mode, clear_cache)
        return {"status": "paused"}

    def resume(self) -> dict[str, str]:
        self.engine.resume()
        return {"status": "resumed"}

    def init_weight_transfer_engine(self, body: InitWeightTransferBody) -> dict[str, str]:
        self.weights.init(body.init_info)
        return {"message": "Weight transfer initialized"}

    def start_weight_update(self) -> dict[str, str]:
        self.weights.start()
        return {"message": "Weight update started"}

    def update_weights(self, body: UpdateWeightsBody) -> dict[str, str]:
        names = self.weights.update(body.update_info)
        logger.info("loaded %d tensors from %s", len(names), body.update_info.get("path"))
        return {"message": "Weights updated"}

    def finish_weight_update(self, body: FinishWeightUpdateBody | None = None) -> dict[str, str]:
        self.weights.finish(body.weight_version if body else None)
        return {"message": "Weight update finished"}

    def metrics(self) -> PlainTextResponse:
        config = self.engine.config
        text = render_metrics(self.engine.stats(), self.served_model_name, config.kv_cache_tokens, config.max_model_len)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(stats: EngineStats, model_name: str, kv_cache_tokens: int, max_model_len: int) -> str:
    """Prometheus text exposition with vLLM's metric names and labels. Every waiting request waits for capacity
    (vLLM's other reason, "deferred", is for requests its scheduler holds back, which this one never does)."""
    labels = f'model_name="{_escape(model_name)}",engine="0"'
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{sample}{{{labels}{extra}}} {value!r}" for sample, extra, value in samples)

    def single(name: str, kind: str, help_text: str, value: float, sample: str | None = None) -> None:
        family(name, kind, help_text, [(sample or name, "", float(value))])

    single("vllm:num_requests_running", "gauge", "Requests in model execution batches.", stats.running)
    single("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", stats.waiting)
    family("vllm:num_requests_waiting_by_reason", "gauge", "Requests waiting to be processed, by reason.",
           [("vllm:num_requests_waiting_by_reason", ',reason="capacity"', float(stats.waiting)),
            ("vllm:num_requests_waiting_by_reason", ',reason="deferred"', 0.0)])  # fmt: skip
    single("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           stats.kv_tokens / kv_cache_tokens)  # fmt: skip
    single("vllm:num_preemptions", "counter", "Cumulative number of preemptions.",
           stats.preemptions_total, "vllm:num_preemptions_total")  # fmt: skip
    single("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
           stats.prompt_tokens_total, "vllm:prompt_tokens_total")  # fmt: skip
    single("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
           stats.generation_tokens_total, "vllm:generation_tokens_total")  # fmt: skip
    cache_labels = (
        f',block_size="1",kv_cache_size_tokens="{kv_cache_tokens}",num_gpu_blocks="{kv_cache_tokens}"'
        f',kv_cache_max_concurrency="{kv_cache_tokens / max_model_len}"'
    )  # full-length requests that fit
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.",
           [("vllm:cache_config_info", cache_labels, 1.0)])  # fmt: skip
    counts = stats.batch_sizes
    total = float(sum(counts.values()))
    cumulative = [(str(b), float(sum(n for size, n in counts.items() if size <= b))) for b in _BATCH_BUCKETS]
    samples = [("asyncrl:batch_size_bucket", f',le="{le}"', n) for le, n in [*cumulative, ("+Inf", total)]]
    samples += [
        ("asyncrl:batch_size_sum", "", float(sum(s * n for s, n in counts.items()))),
        ("asyncrl:batch_size_count", "", total),
    ]
    family("asyncrl:batch_size", "histogram", "Rows per model forward (decode or prefill).", samples)
    single("asyncrl:batch_rows_max", "gauge", "Most rows in one model forward since startup.",
           max(stats.batch_sizes, default=0))  # fmt: skip
    return "\n".join(lines) + "\n"


GIL_SWITCH_INTERVAL_S = 0.0005
"""How long the host-bound engine thread may hold the GIL while the HTTP event loop waits for it (Python's default
is 5 ms): on one H200 (0.6B shape, 256 requests through HTTP) 0.5 ms raised tokens/s from 3,376 to 3,844, level with
the engine alone (benchmarks/RESULTS.md)."""


def prepare_serving_process() -> None:
    """Process settings for serving, once the model is loaded. Every object alive now (the model, torch,
    transformers: ~0.5M of them, alive for good) leaves the garbage collector's sight, so a full collection scans
    only what requests made (scanning them all held the GIL for ~0.5 s, stalling the engine thread and every
    request); and the GIL changes hands every ``GIL_SWITCH_INTERVAL_S``."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def build_app(server: BuiltinServer) -> FastAPI:
    """The FastAPI app; the engine thread runs for the app's lifetime."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        server.engine.stop()

    app = FastAPI(title="asyncrl built-in server", version=__version__, lifespan=lifespan)
    handlers = {
        HTTPException: lambda exc: error_response(exc.status_code, str(exc.detail)),  # no route, unreadable body
        RequestValidationError: lambda exc: error_response(400, _validation_message(exc)),
        ValidationError: lambda exc: error_response(400, _validation_message(exc)),
        ValueError: lambda exc: error_response(400, str(exc)),
        ModelNotFound: lambda exc: error_response(404, str(exc)),
        AdapterNotFound: lambda exc: error_response(404, str(exc)),
        EngineUnavailable: lambda exc: error_response(503, str(exc)),
        Exception: lambda exc: error_response(500, f"{type(exc).__name__}: {exc}"),
    }
    for exception_type, make in handlers.items():
        app.add_exception_handler(exception_type, lambda request, exc, make=make: make(exc))
    if server.token is not None:
        app.add_middleware(TokenGuard, token=server.token)
    routes = [
        ("/health", "GET", lambda: Response(status_code=200)),
        ("/version", "GET", lambda: {"version": f"asyncrl-builtin-{__version__}"}),
        ("/v1/models", "GET", server.models),
        ("/get_world_size", "GET", lambda: {"world_size": 1}),
        ("/is_paused", "GET", lambda: {"is_paused": server.engine.is_paused}),
        ("/weight_info", "GET", lambda: {"weight_version": server.weights.version}),
        ("/metrics", "GET", server.metrics),
        ("/v1/completions", "POST", server.completions),
        ("/v1/chat/completions", "POST", server.chat_completions),
        ("/inference/v1/generate", "POST", server.generate),
        ("/pause", "POST", server.pause),
        ("/resume", "POST", server.resume),
        ("/init_weight_transfer_engine", "POST", server.init_weight_transfer_engine),
        ("/start_weight_update", "POST", server.start_weight_update),
        ("/update_weights", "POST", server.update_weights),
        ("/finish_weight_update", "POST", server.finish_weight_update),
        ("/server_info", "GET", server.server_info),
    ]
    if server.engine.adapters is not None:  # vLLM registers these only when runtime LoRA updating is allowed
        routes += [
            ("/v1/load_lora_adapter", "POST", server.load_lora_adapter),
            ("/v1/unload_lora_adapter", "POST", server.unload_lora_adapter),
        ]
    for path, method, endpoint in routes:
        app.add_api_route(path, endpoint, methods=[method])
    return app
