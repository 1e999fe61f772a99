"""Startup checks: the built-in server configured to disagree with the config, and a scripted vLLM's config."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from tiny import SERVED_NAME, build_tiny_model, build_tokenizer

from asyncrl.client import ControlClient
from asyncrl.config.compose import compose, to_config
from asyncrl.plan.assemble import build_plan, plan_run, sized
from asyncrl.serving.checks import ServerCheckError, check_server, lora_problem
from asyncrl.serving.vllm import WORKER_EXTENSION


def attached(url: str, *overrides: str) -> Any:
    """An attached server its user names built-in (server.backend=builtin: nothing measures prompts with a tokenizer
    named like the fake model)."""
    return to_config(compose(["server.launch=false", f"server.base_url={url}", f"model.name_or_path={SERVED_NAME}",
                              "server.backend=builtin",
                              *overrides]))  # fmt: skip


def attached_vllm(url: str, *overrides: str) -> Any:
    """An attached vLLM, as its user names it (server.backend=vllm); server.max_model_len is set, so nothing measures
    prompts with a tokenizer named like the fake model."""
    return attached(url, "server.backend=vllm", "server.max_model_len=4096", *overrides)


def run_checks(config: Any) -> Any:
    """The checks against a job's plan (sized: the expected vLLM command in the hints takes its context)."""
    with ControlClient(config.server.base_url, timeout_s=30) as control:
        return check_server(sized(build_plan(config)), control)


# ---- the built-in server -------------------------------------------------------------------------------------


def test_builtin_server_that_agrees_passes_and_returns_candidate_sets(live_server):
    facts = run_checks(attached(live_server.base_url, "server=builtin"))
    assert (facts.backend, facts.weight_transfer, facts.max_model_len, facts.candidate_sets) == (
        "builtin", "builtin", 512, False)  # fmt: skip
    assert run_checks(attached(live_server.base_url, "sampling.top_k=5")).candidate_sets


def test_wrong_served_name_names_the_flag(live_server):
    with pytest.raises(ServerCheckError, match="not 'other-model'.*--served-model-name other-model"):
        run_checks(to_config(compose(["server.launch=false", "server.backend=builtin",
                                      f"server.base_url={live_server.base_url}",
                                      "model.name_or_path=other-model"])))  # fmt: skip


def test_too_short_max_model_len_names_the_flag(live_server):
    with pytest.raises(ServerCheckError, match="max_model_len 512 is below the 1024.*--max-model-len 1024"):
        run_checks(attached(live_server.base_url, "server.max_model_len=1024"))


def test_launched_server_mismatch_names_the_config_key(live_server):
    config = attached(live_server.base_url, "server.max_model_len=1024")
    config.server.launch = True
    with pytest.raises(ServerCheckError, match="set server.max_model_len=1024"):
        run_checks(config)
    config.server.backend = type(config.server.backend)("vllm")
    with pytest.raises(ServerCheckError, match="server.backend=vllm but the server .* reports asyncrl-builtin"):
        run_checks(config)
    with pytest.raises(
        ServerCheckError,
        match="server.backend=vllm but the server .* reports asyncrl-builtin.*: set server.backend=builtin$",
    ):  # attached: a backend named is checked too
        run_checks(attached_vllm(live_server.base_url))


def test_builtin_server_without_dev_endpoints_names_dev_mode(serve_app):
    from asyncrl.engine.api import BuiltinServer, build_app
    from asyncrl.engine.core import Engine, EngineConfig

    engine = Engine(build_tiny_model(), EngineConfig(512, 4, 2048, frozenset({1})))
    server = BuiltinServer(engine, build_tokenizer(), served_model_name=SERVED_NAME, model_path="tiny",
                           max_logprobs=20)  # fmt: skip
    app = build_app(server)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") not in ("/is_paused", "/pause")]
    with serve_app(app) as url, pytest.raises(ServerCheckError, match="no /is_paused.*VLLM_SERVER_DEV_MODE=1"):
        run_checks(attached(url))


# ---- a scripted vLLM: /server_info decides -------------------------------------------------------------------


def vllm_info(**changes: Any) -> dict[str, Any]:
    info = {
        "vllm_config": {
            "model_config": {"logprobs_mode": "processed_logprobs", "max_logprobs": 20},
            "weight_transfer_config": {"backend": "ipc"},
            "lora_config": None,
        },
        "vllm_env": {"VLLM_SERVER_DEV_MODE": True, "VLLM_ALLOW_INSECURE_SERIALIZATION": True},
    }
    for path, value in changes.items():
        node = info
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return info


def fake_vllm(version: str, info: dict[str, Any], generate: Any = None) -> FastAPI:
    app = FastAPI()
    card = {"id": SERVED_NAME, "object": "model", "max_model_len": 4096}
    app.get("/version")(lambda: {"version": version})
    app.get("/v1/models")(lambda: {"object": "list", "data": [card]})
    app.get("/is_paused")(lambda: {"is_paused": False})
    app.get("/get_world_size")(lambda: {"world_size": 1})
    app.get("/server_info")(lambda: info)
    if generate is not None:
        app.post("/inference/v1/generate")(lambda: generate)
    return app


VLLM_CASES = {
    "raw logprobs": (vllm_info(vllm_config__model_config__logprobs_mode="raw_logprobs"), [],
                     "returns raw_logprobs.*--logprobs-mode processed_logprobs"),
    "no transfer engine": (vllm_info(vllm_config__weight_transfer_config=None), [],
                           "no weight-transfer engine.*--weight-transfer-config"),
    "other transfer backend": (vllm_info(), ["server.weight_transfer=nccl"], "started with backend ipc"),
    "ipc without pickles": (vllm_info(vllm_env={}), [], "VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
    "max logprobs": (vllm_info(vllm_config__model_config__max_logprobs=4), [], "--max-logprobs 8"),
    "lora off": (vllm_info(), ["lora=default", "lora.sync=adapter"],
                 "LoRA off.*--enable-lora --max-lora-rank 32 --max-loras 6"),
    "ipc to several trainer ranks": (vllm_info(), ["trainer.num_processes=2"],
                                     "ipc.*the trainer has 2 ranks.*--weight-transfer-config '{\"backend\":\"nccl\"}'"),
    "quantization": (vllm_info(), ["server.quantization=fp8"],
                     "server.quantization=fp8 but the server reports quantization none.*--quantization fp8"),
    "lora rank": (vllm_info(vllm_config__lora_config={"max_lora_rank": 8, "max_loras": 6}),
                  ["lora=default", "lora.sync=adapter"], "max_lora_rank 8 is below lora.r=32.*--max-lora-rank 32"),
}  # fmt: skip


@pytest.mark.parametrize("case", VLLM_CASES)
def test_vllm_config_disagreements_name_the_flag_and_the_restart_command(case, monkeypatch, serve_app):
    info, overrides, message = VLLM_CASES[case]
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.26.0")
    with serve_app(fake_vllm("0.26.0", info)) as url, pytest.raises(ServerCheckError) as raised:
        run_checks(attached_vllm(url, "server.vllm_version=0.26.0", *overrides))
    assert raised.match(message)
    assert "the command this config expects" in str(raised.value) and "vllm.entrypoints.cli.main serve" in str(
        raised.value)  # fmt: skip


def test_vllm_that_agrees_reports_its_transfer_backend(monkeypatch, caplog, serve_app):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.26.0")
    with serve_app(fake_vllm("0.26.0", vllm_info())) as url:
        facts = run_checks(attached_vllm(url, "sampling.top_k=20"))
    assert (facts.backend, facts.weight_transfer, facts.candidate_sets) == ("vllm", "ipc", False)
    assert "cannot return per-token candidate sets" in caplog.text  # 0.26 has no sampling mask: warned
    assert (facts.worker_extension, facts.quantization, facts.gpus) == ("", "", 1)
    extended = vllm_info(vllm_config__parallel_config={"worker_extension_cls": WORKER_EXTENSION,
                                                       "tensor_parallel_size": 2, "data_parallel_size": 2},
                         vllm_config__model_config__quantization="fp8")  # fmt: skip
    with serve_app(fake_vllm("0.26.0", extended)) as url:
        facts = run_checks(attached_vllm(url))
        assert run_checks(attached_vllm(url, "server.quantization=fp8")) == facts  # the config's, as reported
    assert (facts.worker_extension, facts.quantization, facts.gpus) == (WORKER_EXTENSION, "fp8", 4)


@pytest.mark.parametrize(("server", "trainer", "message"), [
    ("0.25.1", "0.25.1", "asyncrl needs >= 0.26"),
    ("0.26.0", "0.28.0", "server runs vLLM 0.26.0 but the trainer has 0.28.0.*pip install vllm==0.26.0"),
    ("0.26.0", None, "the trainer has no vLLM"),
])  # fmt: skip
def test_version_rules(server, trainer, message, monkeypatch, serve_app):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: trainer)
    with serve_app(fake_vllm(server, vllm_info())) as url, pytest.raises(ServerCheckError, match=message):
        run_checks(attached_vllm(url, "server.vllm_version=0.33.0"))


@pytest.mark.parametrize(
    ("version", "warned"), [("0.26.0", False), ("0.28.0", False), ("0.30.1", True), ("0.33.0", False), ("0.34.0", True)]
)
def test_a_release_not_run_here_gets_one_warning_naming_the_verified_ones(version, warned, monkeypatch, caplog,
                                                                          serve_app):  # fmt: skip
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: version)
    with serve_app(fake_vllm(version, vllm_info())) as url:
        run_checks(attached_vllm(url))
    lines = [r.getMessage() for r in caplog.records if "has not been run with asyncrl" in r.getMessage()]
    expected = (f"vLLM {version} has not been run with asyncrl here (verified: 0.26, 0.28, 0.33; README, "
                "'vLLM versions'): its version-switched code paths follow vLLM's source only")  # fmt: skip
    assert lines == ([expected] if warned else [])


@pytest.mark.parametrize(("generate", "message"), [
    (None, "answered HTTP (404|405).*--enable-scale-out"),
    (JSONResponse({"error": "disabled"}, status_code=403), "answered HTTP 403.*--enable-scale-out"),
    ({"choices": [{"token_ids": [3], "sampling_mask": None}]}, "no sampling_mask.*--return-sampling-mask"),
])  # fmt: skip
def test_candidate_set_flags_on_a_recent_vllm(generate, message, monkeypatch, serve_app):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.33.0")
    app = fake_vllm("0.33.0", vllm_info(), generate if generate is not None else None)
    with serve_app(app) as url, pytest.raises(ServerCheckError, match=message):
        run_checks(attached_vllm(url, "sampling.top_k=20"))
    ok = fake_vllm("0.33.0", vllm_info(), {"choices": [{"token_ids": [3], "sampling_mask": [[3, 4]]}]})
    with serve_app(ok) as url:
        assert run_checks(attached_vllm(url, "sampling.top_k=20")).candidate_sets


def test_a_failing_server_is_reported_with_its_status(serve_app):
    app = FastAPI()
    app.get("/version")(lambda: Response(status_code=500))
    with serve_app(app) as url, pytest.raises(Exception, match="HTTP 500"):
        run_checks(attached(url))


def test_one_lora_rule_answers_the_startup_checks_and_the_sync_choice():
    """The run needs max_staleness + 2 adapter slots (6 here), whatever larger server.max_loras it would launch
    with; vLLM's runtime-loading switch reads as the other switches do ("yes" included)."""
    plan = plan_run(compose(["lora=default", "lora.sync=adapter", "server.max_loras=8"]))
    config, flow = plan.config, plan.flow
    enough, env = {"max_lora_rank": 32, "max_loras": 6}, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}
    assert lora_problem(config, enough, env, "vllm", flow) is None
    assert lora_problem(config, {"max_lora_rank": 32, "max_loras": 5}, {}, "builtin", flow) == (
        "the server holds 5 adapters; 6 versions are alive at once (staleness.max_staleness + 2)",
        "--max-loras 8",
    )
    assert lora_problem(config, enough, {}, "vllm", flow) == (
        "the server refuses runtime adapter loading",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    )
