"""``python -m asyncrl.engine --model PATH``: start the built-in generation server (vLLM's HTTP subset)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import uvicorn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from asyncrl.client import TOKEN_ENV
from asyncrl.dtypes import DTYPES, torch_dtype
from asyncrl.engine.api import BuiltinServer, build_app, prepare_serving_process
from asyncrl.engine.core import Engine, EngineConfig
from asyncrl.engine.images import load_image_prompts
from asyncrl.engine.lora import AdapterSet, LoraLimits
from asyncrl.model_kind import auto_model_class
from asyncrl.serving.command import VLLM_LORA_RANKS
from asyncrl.serving.process import port_in_use, port_is_free

logger = logging.getLogger("asyncrl.engine")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.engine", description=__doc__)
    parser.add_argument("--model", required=True, help="local path or Hub id of a causal LM or a vision-language model")
    parser.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="float32")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, help="most rows decoded in one forward")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=None, help="default: seqs x model len")
    parser.add_argument("--max-logprobs", type=int, default=20, help="-1: no limit")
    parser.add_argument("--seed", type=int, default=0, help="seeds requests that carry no seed, in arrival order")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded at runtime (vLLM's)")
    parser.add_argument("--max-loras", type=positive_int, default=1, help="most adapters resident at once")
    parser.add_argument("--max-lora-rank", type=int, choices=VLLM_LORA_RANKS, default=16, help="highest adapter rank")
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="the only directory weight updates and LoRA adapters load from (default: none load)",
    )
    return parser.parse_args(argv)


def load_served_model(path: str, dtype: torch.dtype | str, trust_remote_code: bool) -> torch.nn.Module:
    """The checkpoint's model; a vision-language one whole, so the names of its weights are the trainer's (and chat
    requests may hold images, ``images.py``)."""
    auto = auto_model_class(path, trust_remote_code=trust_remote_code)
    return auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_access(args: argparse.Namespace) -> str:
    """Before the model loads: --weights-dir must be a directory and the port free; warn off a non-loopback bind.
    Returns the token that state-changing requests need: $ASYNCRL_SERVER_TOKEN, else a fresh one, logged for
    clients to send."""
    if args.weights_dir is not None and not args.weights_dir.is_dir():
        raise SystemExit(f"--weights-dir {args.weights_dir} is not a directory: create it or pass another")
    if not port_is_free(args.host, args.port):
        raise SystemExit(f"--port {args.port}: {port_in_use(args.host, args.port)}; choose a free one with --port N")
    if not is_loopback(args.host):
        logger.warning(
            "binding to %s, not loopback: other machines can reach this server (state-changing "
            "requests need its token; generation and metrics are open)",
            args.host,
        )
    token = os.environ.get(TOKEN_ENV)
    if not token:
        token = secrets.token_urlsafe(32)
        logger.info("no %s in the environment: clients must send 'Authorization: Bearer %s'", TOKEN_ENV, token)
    return token


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a completion: generation_config's eos_token_id(s) and the tokenizer's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def context_length(model: torch.nn.Module, requested: int | None) -> int:
    """--max-model-len, checked against the model's position limit (as vLLM does; a vision-language model's is its
    text model's)."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise SystemExit("the model config has no max_position_embeddings: pass --max-model-len")
        return int(limit)
    if limit is not None and requested > limit:
        raise SystemExit(f"--max-model-len {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    token = check_access(args)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(args.seed)
    logger.info("loading tokenizer from %s", args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    logger.info("loading model from %s (dtype %s) onto %s", args.model, args.dtype, device)
    dtype = torch_dtype(args.dtype) or "auto"
    model = load_served_model(args.model, dtype, args.trust_remote_code)
    model = model.to(device).eval()
    image_prompts = load_image_prompts(model, tokenizer, args.model, args.trust_remote_code)
    max_model_len = context_length(model, args.max_model_len)
    kv_cache_tokens = args.kv_cache_tokens or args.max_num_seqs * max_model_len
    eos = eos_token_ids(model, tokenizer)
    logger.info(
        "max_model_len %d, max_num_seqs %d, kv_cache_tokens %d, eos ids %s",
        max_model_len,
        args.max_num_seqs,
        kv_cache_tokens,
        sorted(eos),
    )
    config = EngineConfig(max_model_len, args.max_num_seqs, kv_cache_tokens, eos, seed=args.seed)
    name = args.served_model_name or args.model
    adapters = AdapterSet(LoraLimits(args.max_loras, args.max_lora_rank), name) if args.enable_lora else None
    try:
        engine = Engine(model, config, adapters)
    except ValueError as error:
        raise SystemExit(f"cannot serve {args.model}: {error}") from error
    server = BuiltinServer(
        engine,
        tokenizer,
        served_model_name=name,
        model_path=args.model,
        max_logprobs=args.max_logprobs,
        weights_dir=args.weights_dir,
        token=token,
        image_prompts=image_prompts,
    )
    logger.info("serving %r on http://%s:%d", name, args.host, args.port)
    app = build_app(server)
    prepare_serving_process()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
