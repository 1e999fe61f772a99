"""HTTP clients for the generation server (vLLM or the built-in one): async generation, sync control.

The rollout worker generates with ``GenerationClient`` (token ids in, token ids + processed logprobs out,
retrying only what a retry can fix); the trainer and launcher use ``ControlClient`` for health, model info,
pause/resume, metrics and the weight update sequence. Both send the server's token (``ASYNCRL_SERVER_TOKEN``,
which the CLI sets for the server and every process of its run) as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from types import TracebackType
from typing import Any, Protocol

import httpx

from asyncrl.sampling import SamplingParams

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_LABEL_ESCAPE = re.compile(r"\\(.)")
_TOKEN_KEY = "token_id:"

logger = logging.getLogger(__name__)

TOKEN_ENV = "ASYNCRL_SERVER_TOKEN"
"""The environment variable holding the token a server's state-changing requests need (engine/api.py)."""


def ensure_token() -> str:
    """$ASYNCRL_SERVER_TOKEN, first set to a fresh random one when unset: servers started from here and the clients
    of this process and its children share it through the environment."""
    return os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))


def auth_headers(token: str | None = None) -> dict[str, str]:
    """The bearer header for ``token``, by default $ASYNCRL_SERVER_TOKEN; none when there is no token."""
    token = token or os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


ROLLOUT_MODEL: ContextVar[str | None] = ContextVar("asyncrl_rollout_model", default=None)
"""The ``model`` this task's generation requests name instead of the client's: the LoRA adapter of the policy
version a rollout started under (the rollout worker sets it per group; its rollouts' tasks inherit it)."""


def policy_model(base: str, adapter_prefix: str | None, version: int) -> str:
    """The ``model`` that requests for policy ``version`` name: that version's adapter under adapter-only sync
    (``adapter_prefix`` set), else the base model. Version 0 is the base model itself: peft starts lora_B at 0."""
    return base if adapter_prefix is None or version == 0 else f"{adapter_prefix}-v{version}"


class ServerError(RuntimeError):
    """A request the server refused or could not answer; ``status`` is None when no response came."""

    def __init__(self, status: int | None, path: str, message: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}" if status is not None else f"{path}: {message}")
        self.status = status
        self.path = path
        self.message = message


class PolicyRetired(ServerError):
    """The LoRA adapter a rollout runs under was unloaded: it left the trainer's max_staleness window."""


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


def completion_fields(params: SamplingParams) -> dict[str, Any]:
    """``params`` as /v1/completions fields, every one explicit so server defaults never apply; a regex goes as vLLM's
    ``structured_outputs``, and generation_kwargs join as they are (config validation kept them off the others)."""
    fields = asdict(params)
    extra, regex = fields.pop("generation_kwargs"), fields.pop("structured_outputs_regex")
    fields["stop_token_ids"] = list(params.stop_token_ids)
    if not params.return_sampling_mask:
        del fields["return_sampling_mask"]  # vLLM's /v1/completions ignores it, logging a warning per request
    if regex is not None:
        fields["structured_outputs"] = {"regex": regex}
    return {**fields, **extra}


def generate_fields(params: SamplingParams) -> dict[str, Any]:
    """``sampling_params`` of /inference/v1/generate (vLLM's SamplingParams; the mask is a server flag)."""
    fields = completion_fields(params)
    fields.pop("return_sampling_mask", None)
    return fields


def with_n(fields: dict[str, Any], n: int) -> dict[str, Any]:
    """``fields`` asking for ``n`` completions (the field is left out for one, as every server's default)."""
    return {**fields, "n": n} if n > 1 else fields


def choices(response: dict[str, Any], n: int, path: str) -> list[dict[str, Any]]:
    """The response's ``n`` choices in index order; a server that sent another number cannot answer ``n``."""
    found = sorted(response["choices"], key=lambda choice: choice.get("index", 0))
    if len(found) != n:
        raise GroupRequestRefused(None, path, f"asked for n={n} completions, got {len(found)}")
    return found


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

    @classmethod
    def from_chat_choice(cls, choice: dict[str, Any], prompt_ids: Sequence[int]) -> Completion:
        """Read a /v1/chat/completions choice made with return_token_ids and return_tokens_as_token_ids (OpenAI's
        logprobs content: one entry per token, its top_logprobs keyed "token_id:N")."""
        if choice.get("token_ids") is None:
            raise ValueError("chat completion choice has no token_ids: the request must set return_token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        return cls(
            token_ids=list(choice["token_ids"]),
            logprobs=None if content is None else [entry["logprob"] for entry in content],
            top_logprobs=None if content is None else [
                {parse_token_key(top["token"]): top["logprob"] for top in entry.get("top_logprobs") or []}
                for entry in content
            ],
            sampling_masks=None,
            finish_reason=choice["finish_reason"],
            prompt_token_ids=list(prompt_ids),
        )  # fmt: skip

    @classmethod
    def from_generate_choice(cls, choice: dict[str, Any], prompt_ids: Sequence[int]) -> Completion:
        """Read an /inference/v1/generate choice (token ids in and out, logprobs as {token_id, logprob} lists)."""
        content = (choice.get("logprobs") or {}).get("content")
        return cls(
            token_ids=list(choice["token_ids"]),
            logprobs=None if content is None else [entry["logprob"] for entry in content],
            top_logprobs=None if content is None else [
                {_entry_token(top): top["logprob"] for top in entry.get("top_logprobs") or []} for entry in content
            ],
            sampling_masks=choice.get("sampling_mask"),
            finish_reason=choice["finish_reason"],
            prompt_token_ids=list(prompt_ids),
        )  # fmt: skip


def _entry_token(entry: dict[str, Any]) -> int:
    """vLLM >= 0.32 sends integer ``token_id``; 0.28-0.31 sent ``token`` as "token_id:N"."""
    return int(entry["token_id"]) if "token_id" in entry else parse_token_key(entry["token"])


POOL_REQUESTS = 8
"""Requests in flight per httpx connection pool. httpcore assigns requests to connections in O(connections x
requests) per event, so one pool serving ~100 rollouts spent the worker's CPU there: at 100 in flight against the
built-in server on CPU, 121 requests/s with one pool, 197 with pools of 8."""


class _Pool:
    """One httpx connection pool and its requests in flight."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict[str, str]) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=POOL_REQUESTS)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers)
        self.inflight = 0


@dataclass
class ServerLoad:
    """What the client knows of one server's load: its requests in flight from us, those it was sent, and its KV
    cache usage from its last /metrics scrape (None until one)."""

    base_url: str
    inflight: int = 0
    requests: int = 0
    kv_cache_usage: float | None = None
    pools: list[_Pool] = field(default_factory=list)


def choose_server(servers: Sequence[ServerLoad], turn: int) -> int:
    """The server for the next request: the fewest requests in flight from us; ties go to the lowest KV cache
    usage where known (a server not scraped yet ranks after those that were), then round robin from ``turn``."""
    count = len(servers)

    def load(index: int) -> tuple[int, bool, float, int]:
        kv = servers[index].kv_cache_usage
        return servers[index].inflight, kv is None, kv or 0.0, (index - turn) % count

    return min(range(count), key=load)


class GroupRequestRefused(ServerError):
    """A server that cannot answer a request of n completions (it refused ``n`` or sent other than n choices)."""


@dataclass
class JointRequest:
    """The same turn asked for by several rollouts (a group's first turn): sent once, with n = its waiters."""

    prompt_ids: list[int]
    params: SamplingParams
    waiters: list[asyncio.Future[Completion]] = field(default_factory=list)


class GenerationClient:
    """Async generation client; retries transport errors, timeouts, 5xx and 429 with capped backoff.

    ``sample`` is what rollouts call: with ``return_sampling_mask`` it asks /inference/v1/generate for each
    token's candidate set; a server that cannot return sets gets one warning, and /v1/completions from then on.
    With several servers (``base_url`` a list) each request, retries included, goes to the least loaded one
    (``choose_server``); ``servers`` holds their loads and counts.

    With ``group_requests`` (rollout.group_requests), the rollouts that ask for the same turn in one pass of the
    event loop (a group's rollouts start together, so their first turns do) share one request of n completions: the
    worker's CPU per rollout, spent mostly in httpx, is what bounds short completions' rate (benchmarks/RESULTS.md),
    and the server prefills the prompt once. Completion i draws from the first rollout's seed + i, as vLLM's child
    requests do (the rollouts' own seeds are consecutive too). A server that refuses ``n`` gets one warning and
    single requests from then on.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        timeout_s: float,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        group_requests: bool = False,
    ) -> None:
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retry_count = 0
        self.candidate_sets: bool | None = None
        """None until the first request that asks for candidate sets; False once the server could not."""
        self.group_requests = group_requests
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.servers = [ServerLoad(url.rstrip("/")) for url in urls]
        self._turn = 0
        self._timeout_s = timeout_s
        self._headers = auth_headers()  # vLLM started with --api-key needs it for /v1 and /inference
        self._joints: dict[tuple[str | None, tuple[int, ...], str], JointRequest] = {}
        self._joint_tasks: set[asyncio.Task[None]] = set()

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """One /v1/completions request's completion."""
        (completion,) = await self._complete(prompt_ids, params, 1)
        return completion

    async def _complete(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
        """``n`` completions of one /v1/completions request."""
        body = {
            "model": ROLLOUT_MODEL.get() or self.model,
            "prompt": list(prompt_ids),
            **completion_fields(params),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        response = await self._post("/v1/completions", with_n(body, n), n)
        return [Completion.from_choice(choice) for choice in choices(response, n, "/v1/completions")]

    async def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, tools: list[dict[str, Any]] | None = None
    ) -> Completion:
        """One turn of a conversation the server renders: prompts with images, which vLLM's tokens-in endpoint does
        not take (rollout/images.py). The completion's ``prompt_token_ids`` are the server's rendering; candidate
        sets do not come back (chat has no sampling mask), so a truncating sampler's ratios are biased as on
        /v1/completions. ``tools``: their schemas, for the chat template only (``tool_choice`` none: the server
        parses no call; the rollout loop reads the calls from the tokens, as for any turn)."""
        if params.return_sampling_mask:
            self._no_candidate_sets("prompts with images go through /v1/chat/completions")
        fields = completion_fields(replace(params, return_sampling_mask=False))
        top = fields.pop("logprobs")
        body = {
            "model": ROLLOUT_MODEL.get() or self.model,
            "messages": messages,
            **fields,
            "logprobs": top is not None,
            **({"top_logprobs": top} if top else {}),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **({"tools": tools, "tool_choice": "none"} if tools else {}),
        }
        try:
            response = await self._post("/v1/chat/completions", body)
        except PolicyRetired as error:
            logger.info("ending a rollout whose policy left the server: %s", error.message)
            return Completion([], [], None, None, "abort", [])
        (choice,) = choices(response, 1, "/v1/chat/completions")
        return Completion.from_chat_choice(choice, response["prompt_token_ids"])

    async def _generate(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
        """``n`` completions of one /inference/v1/generate request (vLLM's tokens-in/tokens-out endpoint, with the
        sampling mask)."""
        model, path = ROLLOUT_MODEL.get() or self.model, "/inference/v1/generate"
        body = {"model": model, "token_ids": list(prompt_ids), "sampling_params": with_n(generate_fields(params), n)}
        response = await self._post(path, body, n)
        return [Completion.from_generate_choice(choice, prompt_ids) for choice in choices(response, n, path)]

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Generate one turn; candidate sets come from /inference/v1/generate when asked for and available. A
        rollout whose adapter was unloaded ends on an empty "abort" turn: its samples are more than max_staleness
        versions old, so the trainer drops them anyway."""
        try:
            if self.group_requests:
                return await self._joined(prompt_ids, params)
            (completion,) = await self._sample(prompt_ids, params, 1)
            return completion
        except PolicyRetired as error:
            logger.info("ending a rollout whose policy left the server: %s", error.message)
            return Completion([], [], None, None, "abort", list(prompt_ids))

    async def _joined(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """This turn's completion from the request it shares with the other rollouts asking for the same turn in this
        pass of the event loop; the first of them schedules the request for the next pass."""
        key = (ROLLOUT_MODEL.get(), tuple(prompt_ids), repr(replace(params, seed=None)))
        loop = asyncio.get_running_loop()
        joint = self._joints.get(key)
        if joint is None:
            joint = self._joints[key] = JointRequest(list(prompt_ids), params)
            loop.call_soon(self._send_joint, key)  # in this task's context: ROLLOUT_MODEL goes with it
        waiter: asyncio.Future[Completion] = loop.create_future()
        joint.waiters.append(waiter)
        return await waiter

    def _send_joint(self, key: tuple[str | None, tuple[int, ...], str]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(self._joints.pop(key)))
        self._joint_tasks.add(task)
        task.add_done_callback(self._joint_tasks.discard)

    async def _answer(self, joint: JointRequest) -> None:
        """Send the joint request and hand each waiter its completion (or the request's error)."""
        waiters = [waiter for waiter in joint.waiters if not waiter.done()]  # a cancelled rollout waits no more
        try:
            completions = await self._sample_each(joint.prompt_ids, joint.params, len(waiters))
        except asyncio.CancelledError:
            for waiter in waiters:
                waiter.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - each rollout raises it, as its own request would have
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        for waiter, completion in zip(waiters, completions, strict=True):
            if not waiter.done():
                waiter.set_result(completion)

    async def _sample_each(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
        """``n`` completions: one request, or n single ones (seeds seed + i) where the server refuses ``n``."""
        refused = None
        if n > 1:
            try:
                return await self._sample(prompt_ids, params, n)
            except GroupRequestRefused as error:
                refused = error
        seeds = [None if params.seed is None else params.seed + index for index in range(n)]
        singles = await asyncio.gather(*(self._sample(prompt_ids, replace(params, seed=seed), 1) for seed in seeds))
        if refused is not None and self.group_requests:  # n alone was the trouble: the single requests went through
            logger.warning("the server cannot answer a request of n completions (%s): one request per rollout from "
                           "now on (rollout.group_requests=false asks for that from the start)", refused)  # fmt: skip
            self.group_requests = False
        return [completion for (completion,) in singles]

    async def _sample(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
        if params.return_sampling_mask and self.candidate_sets is not False:
            try:
                completions = await self._generate(prompt_ids, params, n)
            except GroupRequestRefused:
                raise
            except ServerError as error:
                if error.status is None or error.status >= 500 or isinstance(error, PolicyRetired):
                    raise
                # No route (404/405), route disabled (403), or a release whose endpoint rejects the request
                # (400): /v1/completions below still reports a request that is wrong for every endpoint.
                self._no_candidate_sets(f"{error.path} answered HTTP {error.status} ({error.message})")
            else:
                if all(completion.sampling_masks is not None for completion in completions):
                    self.candidate_sets = True
                    return completions
                self._no_candidate_sets("/inference/v1/generate returned no sampling_mask (--return-sampling-mask)")
        return await self._complete(prompt_ids, replace(params, return_sampling_mask=False), n)

    def _no_candidate_sets(self, reason: str) -> None:
        if self.candidate_sets is not False:
            logger.warning(
                "the server cannot return per-token candidate sets: %s. Top-k/top-p/min-p ratios are biased "
                "(the trainer normalises over the whole vocabulary); vLLM >= 0.28 started with "
                "--return-sampling-mask (and --enable-scale-out from 0.30) returns them",
                reason,
            )
        self.candidate_sets = False

    async def _post(self, path: str, body: dict[str, Any], rollouts: int = 1) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                response = await self._send(path, body, rollouts)
            except httpx.TransportError as error:  # connection failures and timeouts
                failure = ServerError(None, path, f"{type(error).__name__}: {error}")
            else:
                if response.status_code < 400:
                    return response.json()
                failure = ServerError(response.status_code, path, _error_message(response))
                if response.status_code == 404 and body.get("model") != self.model:
                    raise PolicyRetired(404, path, failure.message)
                if response.status_code == 400 and rollouts > 1:
                    raise GroupRequestRefused(400, path, failure.message)
                if not _retryable(response.status_code):
                    raise failure
            if attempt >= self.max_retries:
                raise failure
            await asyncio.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
            attempt += 1
            self.retry_count += 1

    async def _send(self, path: str, body: dict[str, Any], rollouts: int) -> httpx.Response:
        """POST to the least loaded server (counting the ``rollouts`` the request generates for), on its pool with
        the fewest requests in flight; a new pool once each has POOL_REQUESTS."""
        server = self.servers[choose_server(self.servers, self._turn)]
        self._turn += 1
        pool = min(server.pools, key=lambda p: p.inflight, default=None)
        if pool is None or pool.inflight >= POOL_REQUESTS:
            pool = _Pool(server.base_url, self._timeout_s, self._headers)
            server.pools.append(pool)
        pool.inflight += 1
        server.inflight += rollouts
        server.requests += rollouts
        try:
            return await pool.client.post(path, json=body)
        finally:
            pool.inflight -= 1
            server.inflight -= rollouts

    async def aclose(self) -> None:
        for task in list(self._joint_tasks):  # their rollouts are gone (the worker stops): no request is left behind
            task.cancel()
        await asyncio.gather(*self._joint_tasks, return_exceptions=True)
        for server in self.servers:
            for pool in server.pools:
                await pool.client.aclose()

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


def metric_values(text: str, name: str) -> list[float]:
    """Every sample value called ``name`` (one per label set, e.g. per vLLM engine)."""
    return [value for sample, _, value in _samples(text) if sample == name]


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


class Control(Protocol):
    """The control calls a weight sync makes: one server's (``ControlClient``) or every replica's at once
    (``ControlGroup``, asyncrl/control_group.py), so the round and its transports need not know which."""

    base_url: str
    timeout_s: float

    def world_size(self) -> int: ...
    def init_weight_transfer(self, init_info: dict[str, Any]) -> None: ...
    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None: ...
    def resume(self) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...
    def finish_weight_update(self, version: str | None = None) -> None: ...
    def shutdown_weight_transfer(self) -> None: ...
    def collective_rpc(self, method: str, **kwargs: str) -> list[Any]: ...
    def load_lora_adapter(self, name: str, path: str) -> None: ...
    def unload_lora_adapter(self, name: str) -> None: ...
    def reopened(self, timeout_s: float) -> Control: ...
    def close(self) -> None: ...
    def __enter__(self) -> Control: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class ControlClient:
    """Sync client for everything but generation; each call checks the status and has a timeout."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=auth_headers(token))

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
        """The served models; an answer without the list is from something that is not an OpenAI-style server."""
        response = self._request("GET", "/v1/models")
        try:
            return response.json()["data"]
        except (ValueError, KeyError, TypeError) as error:
            raise ServerError(response.status_code, "/v1/models", f"no model list in {response.text[:80]!r}: "
                              f"{self.base_url} is not an OpenAI-compatible server") from error  # fmt: skip

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

    def shutdown_weight_transfer(self) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine")

    def collective_rpc(self, method: str, **kwargs: str) -> list[Any]:
        """Call ``method`` on every server worker (vLLM dev mode; a worker extension's method); their results."""
        response = self._request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        return list(response.json().get("results", [])) if response.content else []

    def world_size(self) -> int:
        """Server ranks a weight transfer reaches (tensor x pipeline x data parallel)."""
        return int(self._request("GET", "/get_world_size").json()["world_size"])

    def server_info(self) -> dict[str, Any]:
        """vLLM's dev-mode /server_info: the full engine config and the VLLM_* environment, as JSON."""
        return dict(self._request("GET", "/server_info", params={"config_format": "json"}).json())

    def generate(self, token_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        body = {"token_ids": list(token_ids), "sampling_params": sampling_params}
        return dict(self._request("POST", "/inference/v1/generate", json=body).json())

    def weight_version(self) -> str:
        return str(self._request("GET", "/weight_info").json()["weight_version"])

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def reopened(self, timeout_s: float) -> ControlClient:
        """A fresh client of the same server under ``timeout_s`` (cleanup after a failed weight-sync round)."""
        return ControlClient(self.base_url, timeout_s=timeout_s)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
