"""Session fixtures shared across test folders: a tiny random-init model with the embedded default's
tokenizer and chat template (also loaded per test, ``model``, with the weight-sync tests' helpers that change its
weights and compare it with a server's logprobs), arithmetic data in DeepMath's schema (nothing is downloaded), and
one built-in server on that model for the whole session (starting a server costs seconds; resetting its weights
does not); `invoke` runs the `asyncrl` command in the test's process (a subprocess pays seconds of start and imports).

Every server the tests start needs the session's token for state-changing requests (``server_token``, in the
environment, which the servers, the CLIs and the clients read) and loads weights only from ``weights_root``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from asyncrl.app_thread import serve_in_thread
from asyncrl.cli import app
from asyncrl.client import TOKEN_ENV, GenerationClient, SamplingParams, ensure_token
from asyncrl.serving.process import ServerProcess
from asyncrl.trainer.ranks import Ranks

# Two xdist workers share CI's two cores: torch's default of a thread per core in each worker (and in the processes
# the tests start) oversubscribes them, and OpenMP's spinning threads then take turns with the other worker's
# (tests/losses, tests/packing and trainer/test_forward.py: 133 s of CPU at the default, 83 s at one thread).
# Runs that train set their own threads (trainer.cpu_threads), launched servers theirs (server.cpu_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Nothing is downloaded (CI's .ci/run sets this too): a Hub id a test composes (+recipe=deepmath) then fails at once
# instead of after the resolver's timeouts (test_cli's vLLM command: 25 s on a machine without network, 1.7 s).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long files first, then the other end-to-end ones, then files with slow tests: `--dist loadfile` hands each
    worker whole files in this order (pyproject turns off xdist's own order, fewest tests last, which left the
    one-test runs of minutes for the end, where they were the critical path; and tests/trainer, last by name, held
    half a minute per file there), so that the suite ends on short files that even out the two workers."""
    items.sort(key=lambda item: tuple(item.get_closest_marker(name) is None for name in ("long", "e2e", "slow")))


@pytest.fixture(scope="session", autouse=True)
def server_token() -> Iterator[str]:
    """$ASYNCRL_SERVER_TOKEN for the session: test servers start with it, clients and CLIs send it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(TOKEN_ENV, raising=False)
        yield ensure_token()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[Ranks]:
    """This process as a world of one (a one-process run's trainer), for the tests of a module."""
    with Ranks.alone() as ranks:
        yield ranks


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test servers' --weights-dir: pytest's temporary root, under which every test stages its weights."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def random_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.assets.tiny_model import build_model, build_tokenizer, save_tiny_model

    path = tmp_path_factory.mktemp("random-tiny")
    tokenizer = build_tokenizer()
    save_tiny_model(build_model(tokenizer, seed=0), tokenizer, path)
    return path


@pytest.fixture
def model(random_tiny_model_dir: Path) -> torch.nn.Module:
    """The random tiny model in float32, loaded for each test (the weight-sync tests change its weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight by seeded noise: new weights for a sync to carry."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def served_vs_local(base_url: str, model: torch.nn.Module, name: str) -> float:
    """Max |server logprob - local logprob| over a sampled completion (temperature 1: processed = raw)."""
    prompt = [4, 30, 31, 32, 5]

    async def generate():
        async with GenerationClient(base_url, name, timeout_s=60) as client:
            return await client.complete(prompt, SamplingParams(max_tokens=12, logprobs=0, seed=3))

    out = asyncio.run(generate())
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    local = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    return float((local - torch.tensor(out.logprobs)).abs().max())


@pytest.fixture(scope="session")
def random_tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``asyncrl.assets.tiny_vlm``'s random checkpoint (seed 0): a Qwen3.5 vision-language model (gated-DeltaNet
    hybrid text model, one-block vision tower) that takes images."""
    from asyncrl.assets.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("random-tiny-vlm"), seed=0)


@pytest.fixture(scope="session")
def arithmetic_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.assets.arithmetic import write_splits

    path = tmp_path_factory.mktemp("arith")
    write_splits(path, seed=0, n_train=300, n_eval=40)
    return path


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_classifier(num_labels=1)``: the directory of a random LlamaForSequenceClassification (a reward model
    when num_labels=1) saved with the shipped tiny-arith tokenizer and its chat template; one per label count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from asyncrl.assets import asset_path

    made: dict[int, Path] = {}

    def make(num_labels: int = 1) -> Path:
        if num_labels not in made:
            tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-arith"))
            config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            with torch.random.fork_rng():
                torch.manual_seed(num_labels)
                model = LlamaForSequenceClassification(config)
            path = tmp_path_factory.mktemp("classifier") / f"tiny-rm-{num_labels}"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[num_labels] = path
        return made[num_labels]

    return make


def serve_session(model_dir: Path, weights_root: Path, log_dir: Path) -> Iterator[ServerProcess]:
    """`python -m asyncrl.engine` on ``model_dir`` (served under the name a run's config gives it), with the
    settings the CLI launches it with, until the session ends."""
    from asyncrl.serving.command import served_name
    from asyncrl.serving.process import free_port

    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(model_dir), "--port", str(port),
            "--device", "cpu", "--weights-dir", str(weights_root),
            "--served-model-name", served_name(str(model_dir))]  # fmt: skip
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log_dir / "server.log",
                       env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=120) as process:  # fmt: skip
        yield process


def restore(server: ServerProcess, model_dir: Path) -> ServerProcess:
    """Reload the model's own checkpoint into ``server``, weight version "default": the state of a newly started
    server, whatever ran before."""
    from asyncrl.client import ControlClient, ServerError

    with ControlClient(server.base_url, timeout_s=60) as control:
        control.init_weight_transfer({"backend": "builtin"})
        control.pause("keep", clear_cache=True)
        try:
            control.start_weight_update()
        except ServerError as error:  # a test that failed a round on purpose left its update open: close it
            if "already active" not in str(error):
                raise
            control.finish_weight_update("default")
            control.start_weight_update()
        control.update_weights({"path": str(model_dir / "model.safetensors")})
        control.finish_weight_update("default")
        control.resume()
    return server


@pytest.fixture(scope="session")
def session_server(
    random_tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server on the random tiny model; use it through `fresh_server` or `tiny_server`."""
    yield from serve_session(random_tiny_model_dir, weights_root, tmp_path_factory.mktemp("tiny-server"))


@pytest.fixture(scope="session")
def fresh_server(session_server: ServerProcess, random_tiny_model_dir: Path) -> Callable[[], ServerProcess]:
    """Call it before each use: the session server back on the base weights."""
    return lambda: restore(session_server, random_tiny_model_dir)


@pytest.fixture(scope="session")
def replica_server(
    random_tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A second server on the random tiny model, beside ``session_server``: a run attached to both has two replicas
    sharing one weights directory (use them through `fresh_replicas`)."""
    yield from serve_session(random_tiny_model_dir, weights_root, tmp_path_factory.mktemp("replica-server"))


@pytest.fixture(scope="session")
def fresh_replicas(
    session_server: ServerProcess, replica_server: ServerProcess, random_tiny_model_dir: Path
) -> Callable[[], list[ServerProcess]]:
    """Call it before each use: both servers back on the base weights."""
    return lambda: [restore(server, random_tiny_model_dir) for server in (session_server, replica_server)]


@pytest.fixture(scope="session")
def vlm_session_server(
    random_tiny_vlm_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server on the tiny hybrid vision-language checkpoint; use it through `fresh_vlm_server`."""
    yield from serve_session(random_tiny_vlm_dir, weights_root, tmp_path_factory.mktemp("vlm-server"))


@pytest.fixture(scope="session")
def fresh_vlm_server(vlm_session_server: ServerProcess, random_tiny_vlm_dir: Path) -> Callable[[], ServerProcess]:
    """Call it before each use: the hybrid server back on its checkpoint's weights."""
    return lambda: restore(vlm_session_server, random_tiny_vlm_dir)


@pytest.fixture(scope="module")
def tiny_server(fresh_server: Callable[[], ServerProcess]) -> ServerProcess:
    """The session server on the base weights, once per test module."""
    return fresh_server()


@pytest.fixture
def serve_app() -> Callable[[Any], Any]:
    """`with serve_app(app) as base_url:` serves a FastAPI stub in a thread for the block."""
    return serve_in_thread


def _children() -> set[int]:
    """Live child processes of this test process (a server or a worker that a failed run left behind)."""
    found = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return {pid for pid in found if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}


@pytest.fixture
def invoke() -> Iterator:
    """Run `asyncrl ARGS` in this process; the signal handlers a job installs are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    before = _children()

    def run(args: list[str]):  # noqa: ANN202
        return CliRunner().invoke(app, args)

    yield run
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    assert _children() <= before
