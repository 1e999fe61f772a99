"""benchmarks/e2e.py's comparison of a quantized server with the bf16 one, from made-up summaries (the runs need a
GPU and vLLM)."""

from __future__ import annotations

import json
import math
from types import ModuleType
from typing import Any


def run(name: str, tokens: float, step_s: float, logp: float, sync_s: float) -> dict[str, Any]:
    return {"name": name, "gen_tokens_per_s": tokens, "samples_per_step": 100.0, "steady_step_s": step_s,
            "logp_diff": logp, "sync_s": sync_s}  # fmt: skip


def test_the_quantized_server_is_compared_run_by_run_against_the_goal(e2e: ModuleType) -> None:
    bf16 = {"label": "vllm", "standalone_tokens_per_s": 8000.0,
            "runs": [run("staleness1", 4000, 5.0, 0.002, 0.06), run("staleness2", 5000, 4.0, 0.002, 0.07),
                     {"name": "staleness4", "failed": "timeout"}]}  # fmt: skip
    fp8 = {"label": "fp8", "standalone_tokens_per_s": 12000.0,
           "runs": [run("fp8_staleness2", 6000, 2.0, 0.005, 0.2), run("fp8_staleness1", 5200, 4.0, 0.004, 0.2),
                    {"name": "fp8_staleness0", "failed": 1}, run("fp8_staleness4", 7000, 3.0, 0.001, 0.1)]}  # fmt: skip
    rows = {row["name"]: row for row in e2e.quantized_rows(bf16, fp8)}
    assert list(rows) == ["server alone", "staleness2", "staleness1", "staleness0", "staleness4"]
    assert e2e.ratio(rows["server alone"]["tokens"]) == 1.5 and "goal" not in rows["server alone"]
    # staleness2: 6000 / 5000 = 1.2x tokens (short of 1.3x), samples 50 / 25 per s, logp 2.5x (over 2x)
    two = rows["staleness2"]
    assert (two["tokens"], two["samples"], two["logp"], two["sync"]) == ((5000, 6000), (25, 50), (0.002, 0.005),
                                                                          (0.07, 0.2))  # fmt: skip
    assert two["goal"] is False
    assert rows["staleness1"]["goal"] is True  # 5200 / 4000 = 1.3x tokens, logp 0.004 / 0.002 = 2x: both at the edge
    assert rows["staleness0"] == {"name": "staleness0", "failed": 1}  # a quantized run that failed stays a row
    assert rows["staleness4"]["failed"] == "no bf16 run of that name"  # the bf16 one timed out
    assert math.isnan(e2e.ratio((0.0, 1.0)))


def test_slow_steps_are_those_over_twice_the_later_steps_median(e2e: ModuleType) -> None:
    """The first step compiles and is left out; step 6's 9.7 s among ~1 s steps is the mid-run stall to explain."""
    assert e2e.slow_steps([40.0, 1.0, 1.1, 0.9, 1.0, 9.7, 1.2]) == [6]
    assert e2e.slow_steps([40.0, 1.0, 1.1, 1.9]) == [] and e2e.slow_steps([3.0]) == []


def test_compile_lines_are_what_compile_watch_logged(e2e: ModuleType) -> None:
    log = (
        "[2026-12-02 15:31:11,147][asyncrl.trainer.forward][INFO] - torch.compile: 3.6 s compiling (dynamo, compile "
        "id 0/0, from modeling_layers.py:108 in __call__) during row 2\n[...][asyncrl][INFO] - step 1\n"
    )
    assert e2e.compile_lines(log) == ["3.6 s compiling (dynamo, compile id 0/0, from modeling_layers.py:108 in "
                                      "__call__) during row 2"]  # fmt: skip


def test_the_baseline_server_comes_from_an_earlier_result_or_its_partial(e2e: ModuleType, tmp_path) -> None:
    server = {"backend": "vllm", "label": "vllm", "standalone_tokens_per_s": 9096.0, "runs": []}
    (tmp_path / "e2e.json").write_text(json.dumps({"args": {}, "server": server, "quantized_server": {}}))
    (tmp_path / "partial_vllm.json").write_text(json.dumps(server))
    assert e2e.baseline_server(tmp_path / "e2e.json") == server == e2e.baseline_server(tmp_path / "partial_vllm.json")


def test_a_cut_runs_log_is_kept_under_out_with_the_steps_it_logged(e2e: ModuleType, tmp_path) -> None:
    """The work directory stays on the device machine: a run cut by --run-timeout must leave its launch.log in
    --out, or nobody can say where its time went."""
    args = type("Args", (), {"out": tmp_path / "out"})()
    args.out.mkdir()
    run_dir = tmp_path / "runs" / "staleness2"
    run_dir.mkdir(parents=True)
    assert e2e.keep_log(args, run_dir, "staleness2") == 0 and not list(args.out.iterdir())  # cut before any output
    (run_dir / "launch.log").write_text("warm-up step (16384 tokens) in 301.4 s\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert e2e.keep_log(args, run_dir, "staleness2") == 2
    assert (args.out / "launch_staleness2.log").read_text() == "warm-up step (16384 tokens) in 301.4 s\n"


def test_the_saturated_rates_are_compared_where_both_servers_have_one(e2e: ModuleType) -> None:
    """Session 26's 2B figures were tail-bound (256 requests at 256 in flight): the saturated rate, the server's own
    counter while the concurrency stayed full, is its own row; results from before it have none."""
    bf16 = {"label": "vllm", "standalone_tokens_per_s": 5855.0, "saturated_tokens_per_s": 9000.0, "runs": []}
    fp8 = {"label": "fp8", "standalone_tokens_per_s": 6832.0, "saturated_tokens_per_s": 12600.0, "runs": []}
    rows = e2e.quantized_rows(bf16, fp8)
    assert [row["name"] for row in rows] == ["server alone", "server alone, saturated"]
    assert math.isclose(e2e.ratio(rows[1]["tokens"]), 1.4)
    del bf16["saturated_tokens_per_s"]
    assert [row["name"] for row in e2e.quantized_rows(bf16, fp8)] == ["server alone"]


def test_a_table_compares_a_quantized_call_with_a_baseline_from_another_call(e2e: ModuleType, tmp_path) -> None:
    """Session 27: the fp8 call was compared with session 24's bf16 server; the same code's bf16 server, measured
    in a later call, replaces it when the table is printed again."""
    older = {"backend": "vllm", "label": "vllm", "standalone_tokens_per_s": 9096.0, "runs": []}
    fp8 = {"backend": "vllm", "label": "fp8", "standalone_tokens_per_s": 10852.0, "runs": []}
    same_code = {"backend": "vllm", "label": "vllm", "standalone_tokens_per_s": 11290.0, "runs": []}
    (tmp_path / "fp8.json").write_text(json.dumps({"server": older, "quantized_server": fp8}))
    (tmp_path / "bf16.json").write_text(json.dumps({"server": same_code}))
    assert e2e.table_result([tmp_path / "fp8.json"], None)["server"]["standalone_tokens_per_s"] == 9096.0
    result = e2e.table_result([tmp_path / "fp8.json"], tmp_path / "bf16.json")
    assert result["server"] == same_code and result["quantized_server"] == fp8


def test_the_server_logs_warnings_come_back_with_their_counts_without_their_time(e2e: ModuleType, tmp_path) -> None:
    """The server's log stays on the device machine; a layer that a quantized server's sync left out is a warning
    there (vLLM's layerwise reload keeps its old weights), so the result carries the log's warnings."""
    (tmp_path / "server.log").write_text(
        "INFO 12-03 18:40:01 [api_server.py:1] serving\n"
        "(EngineCore pid=7) WARNING 12-03 18:41:00 [layerwise.py:270] QKVParallelLinear: Failed to load weights\n"
        "(EngineCore pid=7) WARNING 12-03 18:41:09 [layerwise.py:270] QKVParallelLinear: Failed to load weights\n"
    )
    (tmp_path / "server_1.log").write_text("ERROR 12-03 18:42:00 [engine.py:9] boom\nplain line\n")
    warnings = e2e.server_warnings([tmp_path / "server.log", tmp_path / "server_1.log"])
    assert warnings == {"WARNING QKVParallelLinear: Failed to load weights": 2, "ERROR boom": 1}
    assert e2e.server_warnings([tmp_path / "server.log"], limit=0) == {}
