"""benchmarks/vs_trl.py's own logic, without running either tool (CI installs no TRL): the command asyncrl gets, the
figures read from per-step rows and the table's ratios and reward curves."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def test_asyncrl_gets_the_recipe_and_only_the_matched_settings(vs_trl: ModuleType) -> None:
    work = vs_trl.Workload(steps=10, samples_per_step=256, max_tokens=256, lr=1e-5, trl_batch=(32, 8))
    args = vs_trl.asyncrl_args(Path("/ck"), work, rehearse=False)
    assert args == ["train", "+recipe=deepmath", "model.name_or_path=/ck", "data=arithmetic", "data.eval_path=null",
                    "reward=length", "sampling.max_completion_length=256", "trainer.learning_rate=1e-05",
                    "trainer.samples_per_step=256", "trainer.max_steps=10"]  # fmt: skip
    assert vs_trl.asyncrl_args(Path("/ck"), work, rehearse=True)[-1] == "server=builtin"
    assert vs_trl.Workload.from_json(vs_trl.dataclasses.asdict(work)) == work


def rows(tool: str, ends: list[float], rewards: list[float]) -> list[dict[str, float | None]]:
    return [
        {"step": i + 1, "end_s": end, "samples": 16, "reward": float(reward), "trained_tokens": 160.0,
         "mean_length": 10.0, "generated_tokens": 200.0 if tool == "asyncrl" else 160.0, "step_s": 2.0,
         **({"clock_s": end - 30.0, "staleness": 1.5} if tool == "asyncrl" else {})}
        for i, (end, reward) in enumerate(zip(ends, rewards, strict=True))
    ]  # fmt: skip


def test_summarise_reads_steady_steps_on_each_tools_clock(vs_trl: ModuleType) -> None:
    trl = {"tool": "trl", "rows": rows("trl", [20.0, 24.0, 28.0, 32.0], [1, 2, 3, 4]), "sync_s": [0.5, 0.7]}
    got = vs_trl.summarise(trl, target=64)
    assert got["samples_per_s"] == 48 / 12 and got["trained_per_s"] == 480 / 12 and got["generated_per_s"] == 40.0
    assert got["late_samples_per_s"] == 32 / 8 and got["time_to_n_s"] == 32.0 and got["first_step_s"] == 20.0
    assert got["sync_s"] == 0.6 and got["staleness"] is None and got["peak_gib"] is None
    fast = {"tool": "asyncrl", "rows": rows("asyncrl", [40.0, 41.0, 42.0, 43.0], [1, 1, 1, 1]), "sync_s": []}
    got = vs_trl.summarise(fast, target=64)
    assert got["samples_per_s"] == 16.0 and got["generated_per_s"] == 100.0  # 200 tokens over 2 s steps
    assert got["time_to_n_s"] == 43.0 and got["sync_s"] is None and got["staleness"] == 1.5
    assert "time_to_n_s" not in vs_trl.summarise(fast, target=65)  # never reached


def test_table_ratios_favour_asyncrl_above_one_and_lists_both_curves(vs_trl: ModuleType) -> None:
    work = vs_trl.Workload(steps=4, samples_per_step=16, max_tokens=16, lr=1e-5, trl_batch=(8, 2))
    results = {
        "trl": {"tool": "trl", "rc": 0, "rows": rows("trl", [20.0, 24.0, 28.0, 32.0], [1, 2, 3, 4]), "sync_s": [],
                "versions": {"trl": "1.16.0"}},
        "asyncrl": {"tool": "asyncrl", "rc": 0, "rows": rows("asyncrl", [40.0, 41.0, 42.0], [5, 6, 7]),
                    "sync_s": [], "command": "asyncrl train x=1"},
    }  # fmt: skip
    text = vs_trl.table("qwen3-0.6b", results, work)
    assert "| samples/s (steps 2-last) | 4.0 | 16.0 | 4.00x |" in text
    assert "| time to N samples s (from launch) | 32.0 | - |  |" in text  # asyncrl short of N: no ratio
    assert "| first step s (from launch) | 20.0 | 40.0 | 0.50x |" in text  # times: TRL / asyncrl
    assert "| 4 | 4.000 | - |" in text and "| 1 | 1.000 | 5.000 |" in text
    assert "- asyncrl: `asyncrl train x=1`" in text and "trl 1.16.0" in text
    results["asyncrl"].update(rc=1, rows=[], failure="Traceback: boom")
    assert "asyncrl failed (exit 1)" in vs_trl.table("qwen3-0.6b", results, work)


def test_the_documented_gpu_calls_parse(vs_trl: ModuleType) -> None:
    """Each call of the docstring's H200 plan is a valid command line (the GPU session has no time to find out)."""
    calls = [line.split() for line in vs_trl.__doc__.splitlines() if line.strip().startswith("--shapes")]
    assert len(calls) == 5
    for call in calls:
        args = vs_trl.build_parser().parse_args(["--work", "/tmp/vt", "--out", "/tmp/o", *call])
        assert set(args.shapes.split(",")) <= set(vs_trl.SHAPES) and set(args.tools.split(",")) <= set(vs_trl.TOOLS)
        assert args.run_timeout <= 540  # a minute of the call's 600 s left for the build and the table


def test_caches_are_removed_for_a_cold_run_and_kept_with_warm(vs_trl: ModuleType, tmp_path: Path) -> None:
    args = vs_trl.build_parser().parse_args(["--work", str(tmp_path)])
    args.work = tmp_path
    caches = vs_trl.caches_of("qwen3-0.6b", "asyncrl", args)
    (caches / "triton").mkdir(parents=True)
    args.warm = True
    assert vs_trl.caches_of("qwen3-0.6b", "asyncrl", args) == caches and (caches / "triton").is_dir()
    args.warm = False
    assert not vs_trl.caches_of("qwen3-0.6b", "asyncrl", args).exists()
    assert vs_trl.env(caches)["ASYNCRL_CACHE_DIR"] == str(caches / "asyncrl")


def test_the_table_says_which_caches_each_tool_started_with(vs_trl: ModuleType) -> None:
    work = vs_trl.Workload(steps=2, samples_per_step=16, max_tokens=16, lr=1e-5, trl_batch=(8, 2))
    results = {"trl": {"tool": "trl", "rc": 0, "rows": rows("trl", [20.0, 24.0], [1, 2]), "sync_s": []},
               "asyncrl": {"tool": "asyncrl", "rc": 0, "rows": rows("asyncrl", [40.0, 41.0], [1, 2]), "sync_s": [],
                           "command": "asyncrl train", "caches": "warm"}}  # fmt: skip
    text = vs_trl.table("qwen3.5-2b", results, work)
    assert "| compile caches at launch | cold | warm | |" in text
    assert "| first step s (from launch) | 20.0 | 40.0 | not comparable: caches differ |" in text
    assert "| samples/s (steps 2-last) | 4.0 | 16.0 | 4.00x |" in text  # the steady state still compares


def test_trls_llm_gets_the_flags_asyncrls_launch_passes(vs_trl: ModuleType, monkeypatch: object) -> None:
    """A vision-language hybrid: text-only limits, and the Triton GDN prefill where flashinfer is missing."""
    import sys
    import types

    seen: dict[str, object] = {}
    module = types.SimpleNamespace(LLM=lambda *a, **k: seen.update(k))
    monkeypatch.setitem(sys.modules, "trl.generation", types.SimpleNamespace(vllm_generation=module))
    monkeypatch.setitem(sys.modules, "trl.generation.vllm_generation", module)
    monkeypatch.setattr(vs_trl, "flashinfer_importable", lambda: False)
    vs_trl.as_asyncrl_launches(vs_trl.CheckpointKind(vision_language=True, gated_deltanet=True))
    module.LLM(model="m", seed=0)
    assert seen == {"limit_mm_per_prompt": {"image": 0, "video": 0}, "gdn_prefill_backend": "triton", "model": "m",
                    "seed": 0}  # fmt: skip
    seen.clear()
    module.LLM = lambda *a, **k: seen.update(k)
    vs_trl.as_asyncrl_launches(vs_trl.CheckpointKind())
    module.LLM(model="m")
    assert seen == {"model": "m"}


def test_the_table_gives_asyncrls_start_up_by_phase(vs_trl: ModuleType) -> None:
    """Where vLLM launched against the warm-up: the phases of asyncrl's first step's record, in launch order."""
    first = {"step": 1, "perf/startup_warm_up_s": 250.2, "perf/startup_job_s": 14.0, "perf/step_s": 3.0,
             "perf/startup_model_loaded_s": 30.5, "perf/startup_server_launched_s": 31.0}  # fmt: skip
    phases = vs_trl.startup_phases(first)
    assert list(phases.items()) == [("job", 14.0), ("model_loaded", 30.5), ("server_launched", 31.0),
                                    ("warm_up", 250.2)]  # fmt: skip
    work = vs_trl.Workload(steps=2, samples_per_step=16, max_tokens=16, lr=1e-5, trl_batch=(8, 2))
    results = {"asyncrl": {"tool": "asyncrl", "rc": 0, "rows": rows("asyncrl", [40.0, 41.0], [1, 2]), "sync_s": [],
                           "command": "asyncrl train", "startup": phases}}  # fmt: skip
    told = "job 14.0, model loaded 30.5, server launched 31.0, warm up 250.2."
    assert f"asyncrl's start-up, seconds from its launch (the warm-up: its length): {told}" in vs_trl.table(
        "qwen3.5-2b", results, work
    )
