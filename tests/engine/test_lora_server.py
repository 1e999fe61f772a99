"""Runtime LoRA adapters on the built-in server: vLLM's load/unload endpoints, errors and model cards; requests
select an adapter by ``model`` and rows under different adapters share a batch with the right logprobs."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import SERVED_NAME, build_tiny_model

from asyncrl.client import ROLLOUT_MODEL, GenerationClient, SamplingParams, auth_headers, policy_model
from asyncrl.config.compose import compose
from asyncrl.engine.__main__ import parse_args
from asyncrl.plan.assemble import plan_run
from asyncrl.serving.command import builtin_command
from asyncrl.serving.process import ServerProcess, free_port

PROMPT = [5, 9, 14, 20, 33]
MAX_LORAS = 3


def save_adapter(path: Path, seed: int, r: int = 4, targets: str | list[str] = "all-linear") -> torch.nn.Module:
    """A peft adapter with random (non-zero) weights on the tiny model, saved at ``path``."""
    torch.manual_seed(seed)
    model = get_peft_model(build_tiny_model(), LoraConfig(r=r, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": (1, 4, "all-linear"), "b": (2, 8, ["q_proj", "v_proj"]), "c": (3, 4, "all-linear"),
             "d": (4, 4, "all-linear"), "wide": (5, 32, "all-linear")}  # fmt: skip
    return {name: (root / name, save_adapter(root / name, seed, r, t)) for name, (seed, r, t) in specs.items()}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(tiny_model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port), "--device", "cpu", "--enable-lora", "--max-loras", str(MAX_LORAS),
            "--max-lora-rank", "8", "--weights-dir", str(weights_root)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("lora-server-log") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log_path, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process.base_url


def call(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=60, headers=auth_headers())


def load(base_url: str, name: str, path: Path, **extra: Any) -> httpx.Response:
    return call(base_url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(base_url: str, name: str) -> httpx.Response:
    return call(base_url, "/v1/unload_lora_adapter", {"lora_name": name})


def sample(base_url: str, model: str, max_tokens: int = 10, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0,
            "seed": 11, "return_token_ids": True, **extra}  # fmt: skip
    response = call(base_url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def logprob_error(choice: dict[str, Any], model: torch.nn.Module) -> float:
    """Largest gap between the served logprobs and ``model``'s, on the tokens the server sampled."""
    tokens = choice["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].double()
    local = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return float((local - torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)).abs().max())


def running(base_url: str) -> float:
    lines = httpx.get(f"{base_url}/metrics").text.splitlines()
    return next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running{"))


@pytest.fixture
def clean(lora_server: str):
    """Every test starts and ends with no adapter resident."""
    yield lora_server
    for card in httpx.get(f"{lora_server}/v1/models").json()["data"]:
        if card["parent"] is not None:
            assert unload(lora_server, card["id"]).status_code == 200


def test_requests_select_their_adapter_in_one_shared_batch(clean, adapters):
    base_url = clean
    for name in ("a", "b"):
        response = load(base_url, name, adapters[name][0])
        assert response.status_code == 200 and response.text == f"Success: LoRA adapter '{name}' added successfully."
    cards = {card["id"]: card for card in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert cards["a"]["parent"] == SERVED_NAME and cards["a"]["root"] == str(adapters["a"][0])
    assert cards["a"]["max_model_len"] is None and cards[SERVED_NAME]["parent"] is None
    models = {"a": adapters["a"][1], "b": adapters["b"][1], SERVED_NAME: build_tiny_model()}
    with ThreadPoolExecutor(6) as pool:  # two of each at once: rows under three adapters decode together
        futures = [(name, pool.submit(sample, base_url, name, 24)) for name in [*models, *models]]
        results = [(name, future.result()) for name, future in futures]
    rows_max = next(line for line in httpx.get(f"{base_url}/metrics").text.splitlines()
                    if line.startswith("asyncrl:batch_rows_max{"))  # fmt: skip
    assert float(rows_max.rsplit(" ", 1)[1]) >= 3  # two requests per model: 3 rows in a forward mix adapters
    for name, result in results:
        assert result["model"] == name
        assert logprob_error(result["choices"][0], models[name]) <= 1e-4, name
    base_choice = sample(base_url, SERVED_NAME)["choices"][0]
    assert logprob_error(base_choice, models["a"]) > 1e-2  # the adapters do change the distribution


def test_load_and_unload_errors_follow_vllm(clean, adapters, tmp_path):
    base_url = clean
    assert load(base_url, "a", adapters["a"][0]).status_code == 200
    duplicate = load(base_url, "a", adapters["c"][0])
    assert duplicate.status_code == 400 and "load_inplace" in duplicate.json()["error"]["message"]
    missing = load(base_url, "x", tmp_path / "nowhere")
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    too_wide = load(base_url, "w", adapters["wide"][0])
    assert too_wide.status_code == 400 and "max_lora_rank 8" in too_wide.json()["error"]["message"]
    assert load(base_url, SERVED_NAME, adapters["c"][0]).status_code == 400
    gone = unload(base_url, "nope")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert load(base_url, "c", adapters["c"][0]).status_code == 200
    assert load(base_url, "d", adapters["d"][0]).status_code == 200
    full = load(base_url, "b", adapters["b"][0])
    assert full.status_code == 400 and f"--max-loras {MAX_LORAS}" in full.json()["error"]["message"]
    assert unload(base_url, "a").status_code == 200
    unknown = call(base_url, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 2})
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]


def test_adapter_paths_outside_the_weights_dir_are_refused_alike(clean, adapters, tmp_path, weights_root):
    """Outside --weights-dir, missing, a file, a symlink out of it, an adapter whose weights link out: one 404."""
    outside = Path(tempfile.mkdtemp(prefix="asyncrl-outside-"))  # under /tmp, beside pytest's root
    try:
        shutil.copytree(adapters["a"][0], outside / "a")
        (tmp_path / "escape").symlink_to(outside / "a")
        (tmp_path / "linked").mkdir()
        for file in (outside / "a").iterdir():
            (tmp_path / "linked" / file.name).symlink_to(file)
        refused = [outside / "a", outside / "missing", tmp_path / "missing", adapters["a"][0] / "adapter_config.json",
                   tmp_path / "escape", tmp_path / "linked", Path("/etc")]  # fmt: skip
        answers = {(r.status_code, r.json()["error"]["message"]) for r in (load(clean, "x", p) for p in refused)}
    finally:
        shutil.rmtree(outside)
    assert answers == {(404, f"Loading lora x failed: No adapter found at lora_path: the server loads adapter "
                             f"directories only from inside its --weights-dir {weights_root.resolve()}")}  # fmt: skip
    assert [card["id"] for card in httpx.get(f"{clean}/v1/models").json()["data"]] == [SERVED_NAME]


def test_load_inplace_replaces_the_weights_under_the_same_name(clean, adapters):
    base_url = clean
    assert load(base_url, "a", adapters["a"][0]).status_code == 200
    assert load(base_url, "a", adapters["c"][0], load_inplace=True).status_code == 200
    assert logprob_error(sample(base_url, "a")["choices"][0], adapters["c"][1]) <= 1e-4


def test_unloading_ends_the_adapters_requests_with_abort(clean, adapters):
    base_url = clean
    for _ in range(10):  # the 400 tokens can finish before the unload lands (a loaded machine): try again
        assert load(base_url, "a", adapters["a"][0]).status_code == 200
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda out=result: out.update(sample(base_url, "a", 400, ignore_eos=True)))
        thread.start()
        deadline = time.monotonic() + 30
        while running(base_url) < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        assert unload(base_url, "a").status_code == 200
        thread.join(60)
        choice = result["choices"][0]
        if choice["finish_reason"] != "length":
            break
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 400


def test_merged_weight_updates_still_load_while_adapters_are_resident(clean, adapters, tiny_model_dir):
    base_url = clean
    assert load(base_url, "b", adapters["b"][0]).status_code == 200
    with httpx.Client(base_url=base_url, timeout=60, headers=auth_headers()) as http:
        for path, body in (("/init_weight_transfer_engine", {"init_info": {"backend": "builtin"}}),
                           ("/pause?mode=keep", None), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": {"path": str(tiny_model_dir / "model.safetensors")}}),
                           ("/finish_weight_update", {}), ("/resume", None)):  # fmt: skip
            response = http.post(path, json=body)
            assert response.status_code == 200, (path, response.text)
    assert logprob_error(sample(base_url, "b")["choices"][0], adapters["b"][1]) <= 1e-4


def test_rollouts_name_their_policy_and_end_when_it_is_unloaded(clean, adapters):
    base_url = clean
    assert load(base_url, "asyncrl-run-v1", adapters["a"][0]).status_code == 200
    assert policy_model(SERVED_NAME, "asyncrl-run", 1) == "asyncrl-run-v1"
    assert policy_model(SERVED_NAME, "asyncrl-run", 0) == policy_model(SERVED_NAME, None, 3) == SERVED_NAME
    params = SamplingParams(max_tokens=8, logprobs=0, seed=3, top_k=20, return_sampling_mask=True)

    async def turn(client: GenerationClient) -> Any:
        ROLLOUT_MODEL.set("asyncrl-run-v1")  # what the worker sets for a group that started at version 1
        return await client.sample(PROMPT, params)

    async def rollout_then_unload() -> tuple[Any, Any, Any]:
        async with GenerationClient(base_url, SERVED_NAME, timeout_s=60) as client:
            first = await asyncio.create_task(turn(client))
            assert unload(base_url, "asyncrl-run-v1").status_code == 200
            retired = await asyncio.create_task(turn(client))
            base = await client.sample(PROMPT, params)  # outside the rollout's task: the base model
            return first, retired, (base, client.candidate_sets)

    first, retired, (base, candidate_sets) = asyncio.run(rollout_then_unload())
    assert first.finish_reason == "length" and first.sampling_masks is not None
    with torch.no_grad():
        logits = adapters["a"][1](torch.tensor([PROMPT + first.token_ids])).logits[0, len(PROMPT) - 1]
    top = torch.topk(logits, 20).indices
    expected = torch.log_softmax(logits[top].double(), -1)[(top == first.token_ids[0]).nonzero()[0, 0]]
    assert abs(first.logprobs[0] - float(expected)) <= 1e-4  # the adapter's distribution, not the base's
    assert retired.finish_reason == "abort" and retired.token_ids == []
    assert base.finish_reason == "length" and candidate_sets is True


def test_the_launched_builtin_server_gets_lora_flags_unless_sync_is_merged(tmp_path):
    def argv(*overrides: str) -> list[str]:
        return builtin_command(plan_run(compose(["model.name_or_path=m", "lora=default", "lora.r=8", *overrides]))).argv

    for sync in ("auto", "adapter"):
        args = parse_args(argv(f"lora.sync={sync}")[3:])
        assert args.enable_lora and (args.max_lora_rank, args.max_loras) == (8, 6)  # max_staleness 4 + 2
    assert "--enable-lora" not in argv("lora.sync=merged") and "--enable-lora" not in argv("lora.enabled=false")
