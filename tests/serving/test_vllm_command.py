"""Golden tests of the generated `vllm serve` command and environment, and the rules behind each flag (the
checkpoint's kind, read from its config.json, included)."""

from __future__ import annotations

import importlib
import logging
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hydra.errors import HydraException

from asyncrl.assets.model_families import hybrid_text_config, moe_config
from asyncrl.assets.tiny_model import build_tokenizer
from asyncrl.assets.tiny_vlm import build_vlm_config, build_vlm_tokenizer
from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.messages import config_error_line
from asyncrl.plan.assemble import build_plan, placed, plan_run, sized
from asyncrl.plan.decide import split_gpus
from asyncrl.serving.choice import server_command
from asyncrl.serving.vllm import (
    WORKER_EXTENSION,
    CheckpointKind,
    api_server_count,
    checkpoint_kind,
    install_command,
    parse_version,
    shared_gpu_share,
    vllm_command,
)
from asyncrl.weights.vllm_extension import WeightBufferExtension

BASE = ["server=vllm", "model.name_or_path=Qwen/Qwen3-4B", "sampling.max_completion_length=1024"]
SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-4B",
         "--served-model-name", "Qwen/Qwen3-4B", "--host", "127.0.0.1", "--port", "8000", "--seed", "42"]  # fmt: skip
PLAIN = CheckpointKind()
COMMON = ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]


def command(overrides: list[str], version: str = "0.33.0", gpus: tuple[str, ...] = ("0", "1"),
            checkpoint: CheckpointKind = PLAIN):  # fmt: skip
    plan = sized(placed(plan_run(compose([*BASE, *overrides])), list(gpus)), prompt_tokens=200)
    return vllm_command(plan, version=version, checkpoint=checkpoint)


def flags(*parts: str) -> list[str]:
    return list(parts)


GOLDEN = {
    "plain": (
        [],
        "0.33.0",
        ("0", "1"),
        SERVE
        + flags(
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1224",
            "--max-logprobs",
            "20",
            *COMMON,
            "--weight-transfer-config",
            '{"backend": "nccl"}',
            "--gpu-memory-utilization",
            "0.9",
            "--api-server-count",
            "8",
        ),
        {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0"},
    ),
    "top_p": (
        ["sampling.top_p=0.95", "sampling.top_k=512", "server.dtype=bfloat16"],
        "0.33.0",
        ("0", "1"),
        SERVE
        + flags(
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1224",
            "--max-logprobs",
            "20",
            *COMMON,
            "--weight-transfer-config",
            '{"backend": "nccl"}',
            "--gpu-memory-utilization",
            "0.9",
            "--api-server-count",
            "8",
            "--return-sampling-mask",
            "--enable-scale-out",
        ),
        {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"},
    ),
    "lora_adapter": (
        ["lora=default", "lora.r=24", "lora.sync=adapter", "staleness.max_staleness=2"],
        "0.33.0",
        ("0", "1"),
        SERVE
        + flags(
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1224",
            "--max-logprobs",
            "20",
            *COMMON,
            "--weight-transfer-config",
            '{"backend": "nccl"}',
            "--gpu-memory-utilization",
            "0.9",
            "--api-server-count",
            "1",
            "--enable-lora",
            "--max-lora-rank",
            "32",
            "--max-loras",
            "4",
        ),
        {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ),
    "tp2": (
        ["server.tensor_parallel_size=2", "sampling.num_sampler_logprobs=32"],
        "0.31.0",
        ("4", "5", "6", "7"),
        None,
        None,
    ),
    "shared_gpu": (
        ["server.gpu_memory_utilization=0.3", "server.dtype=bfloat16", "sampling.top_k=20"],
        "0.26.0",
        ("3",),
        SERVE
        + flags(
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1224",
            "--max-logprobs",
            "20",
            *COMMON,
            "--weight-transfer-config",
            '{"backend": "ipc"}',
            "--gpu-memory-utilization",
            "0.3",
            "--worker-extension-cls",
            "asyncrl.weights.vllm_extension.WeightBufferExtension",
        ),
        {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "3", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    ),
    "external": (
        ["server.launch=false", "server.base_url=http://10.0.0.5:9000", "server.max_model_len=4096"],
        "0.33.0",
        (),
        [*SERVE[:7], "--host", "10.0.0.5", "--port", "9000", "--seed", "42"]
        + flags(
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--max-logprobs",
            "20",
            *COMMON,
            "--weight-transfer-config",
            '{"backend": "nccl"}',
            "--gpu-memory-utilization",
            "0.9",
            "--api-server-count",
            "8",
        ),
        {"VLLM_SERVER_DEV_MODE": "1"},
    ),
}


@pytest.mark.parametrize("name", [n for n in GOLDEN if GOLDEN[n][3] is not None])
def test_golden_command(name):
    overrides, version, gpus, argv, env = GOLDEN[name]
    cmd = command(overrides, version, gpus)
    assert cmd.backend == "vllm"
    assert cmd.argv == argv
    assert cmd.env == env


def test_golden_tensor_parallel():
    """TP=2 takes the first two visible GPUs; 0.31 keeps vLLM's API-server default; logprobs cap follows sampling."""
    overrides, version, gpus, _, _ = GOLDEN["tp2"]
    with pytest.raises(ConfigError, match="server.max_logprobs"):
        command(overrides, version, gpus)  # 32 top logprobs exceed the server's 20: validation names the key
    cmd = command([*overrides, "server.max_logprobs=32"], version, gpus)
    assert cmd.argv == SERVE + flags(
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "1224",
        "--max-logprobs",
        "32",
        *COMMON,
        "--weight-transfer-config",
        '{"backend": "nccl"}',
        "--gpu-memory-utilization",
        "0.9",
        "--tensor-parallel-size",
        "2",
    )
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "4,5"}


def test_extra_args_come_last_and_data_parallel_is_passed():
    cmd = command(["server.data_parallel_size=2", "server.extra_args=[--enforce-eager]"], gpus=("0", "1", "2"))
    assert cmd.argv[-5:] == ["--data-parallel-size", "2", "--api-server-count", "8", "--enforce-eager"]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_quantization_is_passed_and_a_quantized_server_gets_no_in_place_loader():
    """The worker extension loads outside vLLM's weight-update session, which a quantized server needs to
    re-quantize (weights/vllm_transports.py): on a shared GPU it is left out, whatever server.ipc_direct_load says."""
    for gpus, transfer in ((("0",), "ipc"), (("0", "1"), "nccl")):
        argv = command(["server.quantization=fp8"], gpus=gpus).argv
        assert argv[argv.index("--quantization") + 1] == "fp8"
        assert transfer in argv[argv.index("--weight-transfer-config") + 1]
        assert "--worker-extension-cls" not in argv
    assert "--worker-extension-cls" in command([], gpus=("0",)).argv
    assert "--quantization" not in command([], gpus=("0",)).argv


@pytest.mark.parametrize(("version", "expected"), [
    ("0.26.0", []), ("0.28.0", ["--return-sampling-mask"]), ("0.29.0", ["--return-sampling-mask"]),
    ("0.30.0", ["--return-sampling-mask", "--enable-scale-out"]),
])  # fmt: skip
def test_candidate_set_flags_follow_the_release(version, expected):
    argv = command(["sampling.top_k=50"], version).argv
    assert [a for a in argv if a in ("--return-sampling-mask", "--enable-scale-out")] == expected


def test_api_server_count_rules():
    lora = plan_run(compose([*BASE, "lora=default", "lora.sync=adapter"]))
    assert api_server_count(lora, "0.33.0") == 1  # runtime LoRA loading refuses more than one
    merged = plan_run(compose([*BASE, "lora=default"]))  # auto = merged until adapter sync exists
    assert api_server_count(merged, "0.33.0") == 8
    plain = plan_run(compose(BASE))
    assert api_server_count(plain, "0.32.0") == 8 and api_server_count(plain, "0.31.0") is None
    explicit = plan_run(compose([*BASE, "server.api_server_count=3"]))
    assert api_server_count(explicit, "0.26.0") == 3
    with pytest.raises(ConfigError, match="server.api_server_count=4"):
        to_config(compose([*BASE, "lora=default", "server.api_server_count=4"]))


def test_gpu_split_and_transfer_choice_errors():
    config = to_config(compose([*BASE, "server.tensor_parallel_size=2"]))
    with pytest.raises(ConfigError, match="needs 2 GPU"):
        split_gpus(config, ["0"])
    assert split_gpus(config, ["0", "1"]).shared  # the trainer shares GPU 0 with the server
    with pytest.raises(ConfigError, match="ipc needs the trainer on the server's only GPU"):
        command(["server.tensor_parallel_size=2"], gpus=("0", "1"))
    with pytest.raises(ConfigError, match="NCCL cannot pair"):
        command(["server.weight_transfer=nccl"], gpus=("0",))
    with pytest.raises(ConfigError, match="trainer.gpus=2"):
        split_gpus(to_config(compose([*BASE, "trainer.gpus=2"])), ["0", "1"])


def test_server_command_dispatches_and_needs_a_version(monkeypatch):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: None)
    with pytest.raises(ConfigError, match="server.vllm_version"):
        server_command(plan_run(compose([*BASE, "server.max_model_len=2048"])))
    with pytest.raises(ConfigError, match="too old"):
        command([], version="0.25.1")
    assert parse_version("v0.27.1.dev3+cu130") == (0, 27, 1)


def test_vllm_is_installed_through_the_projects_pinned_extra():
    """The extra leaves out the releases asyncrl was not tested with; from the checkout (the README's install) its
    path makes the command right wherever the user runs it."""
    checkout = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"][0].startswith("vllm>=0.26,!=") and install_command() == f"pip install -e '{checkout}[vllm]'"
    with pytest.raises(ConfigError, match=re.escape(f"asyncrl needs vLLM >= 0.26 ({install_command()})")):
        command([], version="0.25.1")


def test_a_launch_needs_vllm_and_a_gpu_on_this_machine(monkeypatch):
    """Checked before anything loads; on a CPU machine the GPU check is the one that fails once vLLM is there."""
    from asyncrl.serving.vllm import check_launchable

    config = to_config(compose(BASE))
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: None)
    with pytest.raises(ConfigError, match=r"vllm is not installed here: .* \(server=builtin\)$"):
        check_launchable(config)
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.25.1")
    with pytest.raises(ConfigError, match="too old"):
        check_launchable(config)
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"torch sees no CUDA GPU here: .* \(server=builtin\)$"):
        check_launchable(config)


@pytest.mark.parametrize(("override", "key"), [
    ("server.gpu_memory_utilization=1.5", "server.gpu_memory_utilization"),
    ("server.tensor_parallel_size=0", "server.tensor_parallel_size"),
    ("server.gpus=1", "server.gpus=1"),
    ("trainer.gpus=0", "trainer.gpus"),
])  # fmt: skip
def test_vllm_server_settings_are_validated(override, key):
    with pytest.raises(ConfigError, match=key):
        to_config(compose([*BASE, "server.data_parallel_size=2", override]))


def test_the_trainer_gets_the_gpus_after_the_servers():
    config = to_config(compose([*BASE, "server.tensor_parallel_size=2"]))
    assert split_gpus(config, ["0", "1", "2", "3"]).trainer == ["2", "3"]
    assert split_gpus(to_config(compose(BASE)), ["5"]).trainer == ["5"]  # one GPU: shared, so ipc


def test_each_replica_gets_its_own_gpus_and_port_and_the_trainer_the_next():
    replicas = ["server.replicas=2", "server.tensor_parallel_size=2"]
    plan = sized(placed(plan_run(compose([*BASE, *replicas])), ["0", "1", "2", "3", "4"]), prompt_tokens=200)
    config = plan.config
    for replica, (port, visible) in enumerate([("8000", "0,1"), ("8001", "2,3")]):
        made = vllm_command(plan, version="0.33.0", checkpoint=PLAIN, replica=replica)
        assert made.env["CUDA_VISIBLE_DEVICES"] == visible
        assert made.argv[made.argv.index("--port") + 1] == port
        assert "nccl" in made.argv[made.argv.index("--weight-transfer-config") + 1]
    assert plan.gpu_split is not None and plan.gpu_split.trainer == ["4"]
    with pytest.raises(ConfigError, match=r"needs 4 GPU\(s\) .* x server.replicas=2\) but 3 are visible"):
        split_gpus(config, ["0", "1", "2"])
    with pytest.raises(ConfigError, match="ipc needs the trainer on the server's only GPU"):
        command(["server.replicas=2"], gpus=("0", "1"))  # two servers leave the trainer no GPU of its own


def test_ipc_launches_vllm_with_the_in_place_loader_unless_turned_off():
    shared = ["server.dtype=bfloat16"]
    assert "--worker-extension-cls" in command(shared, "0.26.0", ("0",)).argv
    assert "--worker-extension-cls" not in command([*shared, "server.ipc_direct_load=false"], "0.26.0", ("0",)).argv
    assert "--worker-extension-cls" not in command(shared, "0.26.0", ("0", "1")).argv  # nccl: own GPUs
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightBufferExtension


def test_the_checkpoint_kind_comes_from_its_config():
    tokenizer, vlm_tokenizer = build_tokenizer(), build_vlm_tokenizer()
    assert CheckpointKind.of(build_vlm_config(vlm_tokenizer)) == CheckpointKind(
        vision_language=True, gated_deltanet=True
    )
    assert CheckpointKind.of(build_vlm_config(vlm_tokenizer, layer_types=["full_attention"] * 4)) == CheckpointKind(
        vision_language=True)  # fmt: skip
    assert CheckpointKind.of(hybrid_text_config(tokenizer)) == CheckpointKind(gated_deltanet=True)
    assert CheckpointKind.of(moe_config(tokenizer)) == CheckpointKind()


TEXT_ONLY = ["--limit-mm-per-prompt", '{"image": 0, "video": 0}']
TRITON_GDN = ["--gdn-prefill-backend", "triton"]


@pytest.mark.parametrize(("kind", "flashinfer", "expected"), [
    (CheckpointKind(), False, []),
    (CheckpointKind(vision_language=True), True, TEXT_ONLY),
    (CheckpointKind(gated_deltanet=True), False, TRITON_GDN),
    (CheckpointKind(gated_deltanet=True), True, []),  # vLLM's default GDN prefill imports flashinfer
    (CheckpointKind(vision_language=True, gated_deltanet=True), False, TEXT_ONLY + TRITON_GDN),
])  # fmt: skip
def test_vision_language_and_gated_deltanet_checkpoints_get_their_flags(kind, flashinfer, expected, monkeypatch):
    monkeypatch.setattr("asyncrl.serving.vllm.flashinfer_importable", lambda: flashinfer)
    assert command([], checkpoint=kind).argv == command([]).argv + expected


def test_the_launch_reads_the_checkpoint_config(random_tiny_vlm_dir, random_tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("asyncrl.serving.vllm.flashinfer_importable", lambda: False)
    vlm = to_config(compose([*BASE, f"model.name_or_path={random_tiny_vlm_dir}"]))
    assert checkpoint_kind(build_plan(vlm)) == CheckpointKind(vision_language=True, gated_deltanet=True)
    argv = vllm_command(sized(placed(build_plan(vlm), ["0", "1"]), prompt_tokens=200), version="0.26.0").argv
    assert " ".join(TEXT_ONLY + TRITON_GDN) in " ".join(argv)
    assert checkpoint_kind(plan_run(compose([f"model.name_or_path={random_tiny_model_dir}"]))) == CheckpointKind()
    attached = to_config(
        compose(
            [
                *BASE,
                "model.name_or_path=not-on-this-machine",
                "server.launch=false",
                "server.base_url=http://10.0.0.5:9000",
            ]
        )
    )
    assert checkpoint_kind(build_plan(attached)) == CheckpointKind()  # the expected-command hint never waits
    with pytest.raises(ConfigError, match=r"^model.name_or_path=.*empty: cannot read its config.json"):
        checkpoint_kind(plan_run(compose([*BASE, f"model.name_or_path={tmp_path / 'empty'}"])))


def test_served_adapters_reserve_lora_slots_only_in_their_target_modules(random_tiny_model_dir, random_tiny_vlm_dir):
    """vLLM left alone also wraps the tied embeddings and LM head (and fails its warm-up when the vocabulary is
    smaller than the hidden size, as in the embedded model); the flag names exactly what peft adapts."""
    linear = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapter = ["lora=default", "lora.sync=adapter"]
    tiny = to_config(compose([*BASE, f"model.name_or_path={random_tiny_model_dir}", *adapter]))
    assert checkpoint_kind(build_plan(tiny)).lora_modules == tuple(linear)
    argv = vllm_command(sized(placed(build_plan(tiny), ["0", "1"]), prompt_tokens=200), version="0.26.0").argv
    assert argv[argv.index("--lora-target-modules") + 1 :][: len(linear)] == linear
    listed = to_config(compose([*BASE, f"model.name_or_path={random_tiny_model_dir}", *adapter,
                                "lora.target_modules=[q_proj,v_proj]"]))  # fmt: skip
    assert checkpoint_kind(build_plan(listed)).lora_modules == ("q_proj", "v_proj")
    merged = to_config(compose([*BASE, f"model.name_or_path={random_tiny_model_dir}", "lora=default"]))
    assert checkpoint_kind(build_plan(merged)).lora_modules == ()  # merged sync: vLLM runs without LoRA
    vlm = to_config(compose([*BASE, f"model.name_or_path={random_tiny_vlm_dir}", *adapter]))
    modules = checkpoint_kind(build_plan(vlm)).lora_modules
    assert {"q_proj", "o_proj", "down_proj"} <= set(modules)  # the text model's attention and MLP
    assert not {"qkv", "proj", "linear_fc1"} & set(modules)  # never the vision tower (frozen, not adapted)


def test_a_shared_gpu_gives_vllm_what_the_trainers_measured_footprint_leaves(random_tiny_model_dir, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    from asyncrl.footprint import GIB, TrainerMemory, record_memory

    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    plan = plan_run(compose([*BASE, f"model.name_or_path={random_tiny_model_dir}", "packing=flat"]))
    config, dtype = plan.config, plan.serving_dtype
    assert shared_gpu_share(plan, 1224, dtype)[0] == 0.3  # not measured yet (a printed command)
    budget = plan.components.packer.rows(1224)[1]  # the warm-up's rows beside a server of 1224 tokens

    def share(peak: float, context: float = 1.0) -> tuple[float, str]:
        record_memory(config, budget, TrainerMemory(int(peak * GIB), int(context * GIB), 140 * GIB))
        return shared_gpu_share(plan, 1224, dtype)

    assert share(50) == (0.51, "the trainer's measured peak 50.0 GiB + 1.0 GiB CUDA context + margin = 66.3 of the "
                               "GPU's 140.0 GiB, and 1.0 GiB for vLLM's CUDA context")  # fmt: skip
    assert share(1)[0] == 0.9  # never more than on a GPU of its own
    assert shared_gpu_share(plan, 4096, dtype)[0] == 0.3  # another row size is another shape: measured again
    with pytest.raises(ConfigError, match=r"one GPU cannot hold both: .* leaves 1\.2 GiB, and vLLM needs 2\.0"):
        share(105)


def test_utilization_follows_the_split_unless_set(caplog):
    def utilization(overrides: list[str], gpus: tuple[str, ...]) -> str:
        argv = command(overrides, "0.26.0", gpus).argv
        return argv[argv.index("--gpu-memory-utilization") + 1]

    assert utilization([], ("0", "1")) == "0.9"  # own GPUs
    with caplog.at_level("INFO", logger="asyncrl.serving.vllm"):
        assert utilization(["model.name_or_path=/no/model"], ("0",)) == "0.3"  # shared, nothing to measure
    assert (
        "vLLM shares GPU 0 with the trainer: --gpu-memory-utilization 0.3 (the trainer's footprint is not "
        in caplog.text
    )
    assert utilization(["server.gpu_memory_utilization=0.5"], ("0",)) == "0.5"


def test_a_float32_server_of_a_gated_deltanet_model_is_refused_before_launch():
    with pytest.raises(ConfigError, match="server.dtype=float32: vLLM's gated-DeltaNet kernels"):
        command(["server.dtype=float32"], checkpoint=CheckpointKind(gated_deltanet=True))
    argv = command(["server.dtype=float32"]).argv  # an attention-only model may serve in float32 when asked
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_model_impl_reaches_vllm_as_its_flag_and_auto_leaves_vllms_default():
    """TRL's vllm_model_impl: server.model_impl is vLLM's --model-impl; another value is refused when composed."""
    for impl in ("transformers", "vllm"):
        argv = command([f"server.model_impl={impl}"]).argv
        assert argv[argv.index("--model-impl") + 1] == impl and argv.count("--model-impl") == 1
    assert "--model-impl" not in command([]).argv
    with pytest.raises(HydraException) as refused:  # Hydra refuses it when composing: the CLI's one line says
        to_config(compose([*BASE, "server.model_impl=terratorch"]))
    assert config_error_line(refused.value).startswith("server.model_impl: Invalid value 'terratorch', expected one")


def test_a_vision_language_run_with_images_lets_vllm_take_its_most_images(tmp_path, monkeypatch):
    """--limit-mm-per-prompt from the data: the most images one training or held-out prompt has, no video."""
    import json

    from asyncrl.assets.tiny_vlm import save_tiny_vlm

    monkeypatch.setattr("asyncrl.serving.vllm.flashinfer_importable", lambda: True)
    model = save_tiny_vlm(tmp_path / "vlm")
    prompt = [{"role": "user", "content": "How many?"}]
    rows = [{"prompt": prompt, "images": ["a.png"] * n, "solution": str(n)} for n in (1, 3, 2)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": prompt, "image": "a.png", "solution": "1"}))
    config = to_config(compose([*BASE, f"model.name_or_path={model}", f"data.path={tmp_path / 'train.jsonl'}",
                                f"data.eval_path={tmp_path / 'eval.jsonl'}", "data.max_prompt_length=64"]))  # fmt: skip
    plan = sized(placed(build_plan(config), ["0", "1"]))
    assert plan.prompt_images == 3
    argv = vllm_command(plan, version="0.33.0").argv
    assert " ".join(["--limit-mm-per-prompt", '{"image": 3, "video": 0}']) in " ".join(argv)


def test_imports_without_bytecode_where_none_is_written_are_one_warning_with_the_command_that_compiles_them(
    tmp_path, monkeypatch, caplog
):  # fmt: skip
    from asyncrl.serving.vllm import uncompiled_imports, warn_uncompiled_imports

    package = tmp_path / "uncompiled_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    assert uncompiled_imports(("uncompiled_pkg",)) == []  # the first import writes what the later ones read
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # what vLLM's processes inherit
    assert uncompiled_imports(("uncompiled_pkg", "no_such_package_here")) == [package]
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        warn_uncompiled_imports(("uncompiled_pkg",))
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    command = warned.split("compile them once with: ")[1]
    assert "(uncompiled_pkg)" in warned and shlex.split(command)[1:] == ["-m", "compileall", "-q", "-j", "0",
                                                                          str(package)]  # fmt: skip
    subprocess.run(shlex.split(command), check=True)  # the command as given
    assert uncompiled_imports(("uncompiled_pkg",)) == []
