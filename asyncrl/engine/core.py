"""The batched generation engine: a scheduler fed from HTTP handlers and one thread that runs the model.

Continuous batching: every step decodes all running rows in one forward; waiting requests join at the next
step through a prefill (FIFO, while ``max_num_seqs`` rows and ``kv_cache_tokens`` cached tokens allow). When
the running rows would outgrow ``kv_cache_tokens``, the newest rows are preempted and later re-prefilled from
their tokens, as vLLM's recompute preemption does.

Pause modes follow vLLM: ``abort`` finishes every request now with finish_reason "abort" and its partial
output; ``wait`` returns once in-flight requests have drained; both reject new requests (HTTP 503) until
resume. ``keep`` freezes running rows (no decoding step runs) and queues new requests. With ``keep`` and
``clear_cache=True`` the running rows lose their KV cache and go back to the queue (counted as preemptions),
so after resume they are re-prefilled from their tokens under whatever weights are loaded then; with
``clear_cache=False`` they continue on the KV cache computed by the old weights. Under ``abort`` and ``wait``
no row keeps a cache, so ``clear_cache`` changes nothing.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from asyncrl.engine.attention import use_grouped_decode_attention
from asyncrl.engine.batch import RunningBatch
from asyncrl.engine.cache import check_cache_supported
from asyncrl.engine.lora import AdapterSet
from asyncrl.engine.protocol import ModelNotFound
from asyncrl.engine.rows import DecodeRow, GenerationRequest, GenerationResult
from asyncrl.engine.sampling import sample_step

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class EngineUnavailable(RuntimeError):
    """The engine refuses new requests for now (paused with abort/wait, or shutting down): retry later."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    kv_cache_tokens: int
    eos_token_ids: frozenset[int]
    seed: int = 0


@dataclass(slots=True)
class EngineStats:
    """Gauges and counters behind /metrics; ``batch_sizes`` counts forwards by number of rows."""

    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)


class Engine:
    """Owns the model for generation; HTTP handlers call submit/abort/pause/resume from any thread."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, adapters: AdapterSet | None = None) -> None:
        if config.kv_cache_tokens < config.max_model_len:
            raise ValueError(
                f"kv_cache_tokens={config.kv_cache_tokens} must hold one max_model_len={config.max_model_len} request"
            )
        check_cache_supported(model)
        use_grouped_decode_attention(model)
        self.model = model
        self.config = config
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._device = next(model.parameters()).device
        self.adapters = adapters
        """LoRA adapters loaded at runtime (``--enable-lora``); None: the server has no adapter support."""
        self._batch = RunningBatch(model, adapters)
        self._waiting: deque[DecodeRow] = deque()
        self._abort_ids: set[str] = set()
        self._stats = EngineStats()
        self._seeds = random.Random(config.seed)
        self._pause_mode: str | None = None
        self._stopping = False
        # Lock order: _step_lock, then _cond. The step lock is held while the model runs or is modified.
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="asyncrl-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and end every request with finish_reason "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        with self._step_lock, self._cond:
            self._abort_all()

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue a request; the future resolves when it finishes (or is aborted)."""
        with self._cond:
            if self._stopping:
                raise EngineUnavailable("the server is shutting down")
            if self._pause_mode in ("abort", "wait"):
                raise EngineUnavailable(f"the server is paused (mode={self._pause_mode}); retry after /resume")
            if request.adapter is not None:
                self._check_adapter(request.adapter)
            seed = request.params.seed
            if seed is None:
                seed = self._seeds.getrandbits(63)
                request = replace(request, params=replace(request.params, seed=seed))
            row = DecodeRow(request, random.Random(seed % 2**64))  # negative seeds get streams of their own
            self._waiting.append(row)
            self._stats.waiting = len(self._waiting)
            self._cond.notify_all()
        return row.future

    def _check_adapter(self, name: str) -> None:
        """A request's adapter must be resident now (not just when it was validated); log the first one under it."""
        if self.adapters is None or name not in self.adapters.adapters:
            raise ModelNotFound(f"The model `{name}` does not exist.")
        if name not in self.adapters.requested:
            self.adapters.requested.add(name)
            logger.info("first request under LoRA adapter %r", name)

    def abort(self, request_id: str) -> None:
        """Finish one request early (its client went away); the engine thread applies it at the next step."""
        with self._cond:
            self._abort_ids.add(request_id)
            self._cond.notify_all()

    def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause generation with vLLM's semantics (see the module docstring); returns once it holds."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self._pause_mode = mode
            self._cond.notify_all()
            if mode == "wait":
                self._cond.wait_for(lambda: self._stopping or (self._stats.running == 0 and not self._waiting))
                return
        with self._step_lock, self._cond:
            if mode == "abort":
                self._abort_all()
            elif clear_cache:
                self._preempt(self._batch.clear())
            self._publish()

    def resume(self) -> None:
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        with self._cond:
            return self._pause_mode is not None

    def stats(self) -> EngineStats:
        with self._cond:
            return replace(self._stats, batch_sizes=Counter(self._stats.batch_sizes))

    @contextmanager
    def paused_model(self) -> Iterator[torch.nn.Module]:
        """The model, held so no step runs while it is modified; only while paused."""
        with self._step_lock:
            if not self.is_paused:
                raise ValueError("weights can only change while the server is paused: POST /pause first")
            with torch.no_grad():
                yield self.model

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Make adapter ``name`` resident; generation waits while it is read (in place: rows keep running on it)."""
        if self.adapters is None:
            raise ValueError("LoRA is not enabled on this server: start it with --enable-lora")
        with self._step_lock:
            adapter = self.adapters.check_load(name, path, load_inplace)
            with torch.no_grad():
                self.model = self._batch.model = self.adapters.attach(self.model, adapter)

    def unload_adapter(self, name: str) -> None:
        """Drop adapter ``name``; its rows end now with finish_reason "abort" and their partial output."""
        if self.adapters is None:
            raise ValueError("LoRA is not enabled on this server: start it with --enable-lora")
        with self._step_lock, self._cond:
            self.adapters.check_unload(name)
            running = [row for row in self._batch.rows if row.request.adapter == name]
            queued = [row for row in self._waiting if row.request.adapter == name]
            self._batch.remove(running)
            for row in queued:
                self._waiting.remove(row)
            for row in running + queued:
                row.finish("abort")
            self.model = self._batch.model = self.adapters.detach(self.model, name)
            self._publish()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopping:
                    return
            with self._step_lock, torch.inference_mode():
                self._step()

    def _has_work(self) -> bool:
        frozen = self._pause_mode == "keep"
        return self._stopping or bool(self._abort_ids) or (not frozen and bool(self._waiting or self._batch.rows))

    def _step(self) -> None:
        with self._cond:
            self._drop_aborted()
            if self._pause_mode == "keep" or self._stopping:
                return
            self._preempt(self._rows_over_capacity())
            admitted = self._admit()
            self._publish()
        decoding = len(self._batch.rows)
        if not decoding and not admitted:
            return
        eos = self.config.eos_token_ids
        try:
            parts = [self._batch.decode()] if decoding else []
            if admitted:
                parts.append(self._batch.join(admitted))
            inputs = [row.sampling_input(eos, self.vocab_size, self._device) for row in self._batch.rows]
            draws = sample_step(torch.cat(parts), inputs)
        except Exception as error:  # a failed step must not kill the server: fail its rows and go on
            logger.exception("generation step failed")
            self._fail(self._batch.clear() + admitted, error)
            return
        finished = []
        for row, draw in zip(self._batch.rows, draws, strict=True):
            reason = row.accept(draw, eos)
            if reason is not None:
                finished.append((row, reason))
        self._batch.remove([row for row, _ in finished])
        with self._cond:
            self._stats.generation_tokens_total += len(draws)
            self._stats.batch_sizes.update(size for size in (decoding, len(admitted)) if size)
            for row, reason in finished:
                row.finish(reason)
            self._publish()

    def _rows_over_capacity(self) -> list[DecodeRow]:
        """Newest rows to preempt so that every running row can cache one more token."""
        rows = list(self._batch.rows)
        evicted = []
        while rows and sum(row.cached_len + 1 for row in rows) > self.config.kv_cache_tokens:
            evicted.append(rows.pop())
        return evicted

    def _preempt(self, rows: list[DecodeRow]) -> None:
        """Take rows out of the batch and put them first in the queue, to be re-prefilled from their tokens."""
        if not rows:
            return
        self._batch.remove(rows)
        self._waiting.extendleft(reversed(rows))
        self._stats.preemptions_total += len(rows)

    def _admit(self) -> list[DecodeRow]:
        """Pop waiting rows, first come first served, while rows and KV capacity allow."""
        admitted: list[DecodeRow] = []
        used = sum(row.cached_len + 1 for row in self._batch.rows)
        while self._waiting and len(self._batch.rows) + len(admitted) < self.config.max_num_seqs:
            needed = len(self._waiting[0].tokens())
            if used + needed > self.config.kv_cache_tokens:
                break
            row = self._waiting.popleft()
            used += needed
            admitted.append(row)
            if not row.prompt_counted:
                row.prompt_counted = True
                self._stats.prompt_tokens_total += len(row.request.prompt_ids)
        return admitted

    def _drop_aborted(self) -> None:
        if not self._abort_ids:
            return
        ids, self._abort_ids = self._abort_ids, set()
        leaving = [row for row in self._batch.rows if row.request.request_id in ids]
        self._batch.remove(leaving)
        queued = [row for row in self._waiting if row.request.request_id in ids]
        for row in queued:
            self._waiting.remove(row)
        for row in leaving + queued:
            row.finish("abort")
        self._publish()

    def _abort_all(self) -> None:
        for row in self._batch.clear() + list(self._waiting):
            row.finish("abort")
        self._waiting.clear()
        self._abort_ids.clear()
        self._publish()

    def _fail(self, rows: list[DecodeRow], error: Exception) -> None:
        with self._cond:
            for row in rows:
                if not row.future.done():
                    row.future.set_exception(error)
            self._publish()

    def _publish(self) -> None:
        self._stats.running = len(self._batch.rows)
        self._stats.waiting = len(self._waiting)
        self._stats.kv_tokens = self._batch.kv_tokens()
        self._cond.notify_all()
