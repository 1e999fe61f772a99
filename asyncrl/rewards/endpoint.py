"""The reward models' scoring endpoint: ``POST /score/{index}`` scores one request's prompts and completions with
the run's reward model ``index``, served by uvicorn in a thread of the trainer's rank-0 process, the process that
holds a GPU (rewards/reward_model.py says why there).

It binds 127.0.0.1 on a free port, answers only requests that carry its token (random per start, handed to the
workers' ``RewardModel`` with the URL) and loads nothing on request: the checkpoints load once, when it starts.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from asyncrl.app_thread import serve_in_thread
from asyncrl.rewards.classifier import Classifier, load_classifier
from asyncrl.rewards.reward_model import RewardModel, ScoringEndpoint

if TYPE_CHECKING:
    from asyncrl.config.schema import Config
    from asyncrl.rollout.scoring import RewardSource

log = logging.getLogger(__name__)


class ScoreRequest(BaseModel):
    prompts: list[Any]
    completions: list[Any]


def build_app(classifiers: Sequence[Classifier], token: str) -> FastAPI:
    """The endpoint's routes: ``/health``, and ``/score/{index}`` behind the bearer token."""
    app = FastAPI(title="asyncrl reward models")
    expected = f"Bearer {token}".encode()

    def score(index: int, body: ScoreRequest, authorization: str = Header("")) -> dict[str, list[float]]:
        if not secrets.compare_digest(authorization.encode(), expected):
            raise HTTPException(401, "this endpoint needs its token: 'Authorization: Bearer <token>'")
        if not 0 <= index < len(classifiers):
            raise HTTPException(404, f"no reward model {index} (this run has {len(classifiers)})")
        if len(body.prompts) != len(body.completions):
            raise HTTPException(400, f"{len(body.prompts)} prompts for {len(body.completions)} completions")
        return {"rewards": classifiers[index].score(body.prompts, body.completions)}

    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    app.add_api_route("/score/{index}", score, methods=["POST"])  # a sync route: FastAPI runs it in a thread
    app.add_exception_handler(
        Exception, lambda request, exc: JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
    )
    return app


@contextlib.contextmanager
def serving_reward_models(config: Config, sources: Sequence[RewardSource]) -> Iterator[None]:
    """For the block: the run's reward models loaded on this process's device (the trainer's rank 0: call it before
    the warm-up step measures the trainer's memory) and served, each ``RewardModel`` told where. Nothing without
    reward models."""
    entries = [(f"reward_funcs[{index}]", source.fn) for index, source in enumerate(sources)
               if isinstance(source.fn, RewardModel)]  # fmt: skip
    if not entries:
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    kwargs = dict(config.sampling.chat_template_kwargs)
    trusted = config.model.trust_remote_code
    classifiers = [load_classifier(model.options, key, device, kwargs, trust_remote_code=trusted)
                   for key, model in entries]  # fmt: skip
    models = [model for _, model in entries]
    token = secrets.token_urlsafe(32)
    with serve_in_thread(build_app(classifiers, token), "asyncrl-reward-models") as base_url:
        log.info("reward models served on %s from %s: %s", device, base_url,
                 ", ".join(model.options.path for model in models))  # fmt: skip
        for index, model in enumerate(models):
            model.endpoint = ScoringEndpoint(f"{base_url}/score/{index}", token, config.server.timeout)
        try:
            yield
        finally:
            for model in models:
                model.endpoint = None
