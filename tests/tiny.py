"""A tiny random Qwen3 with a word-level tokenizer, built deterministically for the server tests, and the fixtures
that serve it (tests/engine/conftest.py and tests/serving/conftest.py take them from here).

The embeddings are tied and larger than the default init, so the untrained model mostly repeats its last
token: after an EOS it says EOS again (a deterministic "stop"), elsewhere its distribution is still spread
enough for top-k, top-p and seeds to matter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from asyncrl.serving.process import ServerProcess, free_port

VOCAB_SIZE = 96
EOS_ID = 1
MAX_MODEL_LEN = 512
SERVED_NAME = "tiny-qwen3"


def build_tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 0.1)
    return model


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz", *"0123456789"]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_model() -> Qwen3ForCausalLM:
    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_model().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@dataclass(frozen=True)
class LiveServer:
    base_url: str
    model_dir: Path
    process: ServerProcess


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`python -m asyncrl.engine` as a real subprocess on a free port, stopped when the module ends."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(tiny_model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port), "--device", "cpu", "--max-num-seqs", "32",
            "--weights-dir", str(weights_root)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("server-log") / "server.log"
    # One intra-op thread: on shared, busy CPU cores it decodes the tiny model several times faster.
    env = {"OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(argv, base_url=url, log_path=log_path, env=env, startup_timeout_s=120) as process:
        yield LiveServer(process.base_url, tiny_model_dir, process)


def engines(model: torch.nn.Module, max_model_len: int, max_num_seqs: int,
            eos_token_id: int) -> Iterator[Callable[..., object]]:  # fmt: skip
    """A fixture's body: ``make(**overrides)`` starts an engine on ``model`` (EngineConfig fields overridden), each
    stopped when the test ends."""
    from asyncrl.engine.core import Engine, EngineConfig

    started: list[Engine] = []

    def make(**overrides: int) -> Engine:
        tokens = max_num_seqs * max_model_len
        config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_tokens=tokens,
                              eos_token_ids=frozenset({eos_token_id}))  # fmt: skip
        engine = Engine(model, replace(config, **overrides))
        engine.start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.stop()
