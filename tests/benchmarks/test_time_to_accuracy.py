"""benchmarks/time_to_accuracy.py's own logic, without running either tool (CI installs no TRL): the task files,
the command asyncrl gets, the saves read from each tool's timings, the curves with the saves subtracted, the time
to reach an accuracy, both goals and the documented device calls."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import ModuleType

import pytest


def test_task_files_are_seeded_disjoint_and_scored_by_the_accuracy_reward(
    time_to_accuracy: ModuleType, tmp_path: Path
) -> None:
    train, held_out = time_to_accuracy.task_rows(seed=0, n_train=3000, n_eval=200)
    assert len(train) == 3000 and len(held_out) == 200
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held_out}
    assert {"+", "-"} <= {r["prompt"][0]["content"].split()[3] for r in held_out}
    assert all(int(r["solution"]) >= 0 for r in train + held_out)
    row = time_to_accuracy.task_row(47, "-", 12)
    assert row == {"prompt": [{"role": "user", "content": "What is 47 - 12? Put your final answer within \\boxed{}."}],
                   "solution": "35"}  # fmt: skip
    first = [p.read_bytes() for p in time_to_accuracy.write_task(tmp_path / "a", seed=3, n_train=50, n_eval=10)]
    again = [p.read_bytes() for p in time_to_accuracy.write_task(tmp_path / "b", seed=3, n_train=50, n_eval=10)]
    other = [p.read_bytes() for p in time_to_accuracy.write_task(tmp_path / "c", seed=4, n_train=50, n_eval=10)]
    assert first == again and first != other
    scores = time_to_accuracy.judge([row, row], ["so \\boxed{35}", "it is 35"])
    assert scores == {"accuracy": 0.5, "boxed": 0.5}


def test_a_model_without_a_chat_template_gets_plain_prompts_judged_alike(
    time_to_accuracy: ModuleType, tmp_path: Path
) -> None:
    row = time_to_accuracy.task_row(47, "-", 12, plain=True)
    question = "Question: What is 47 - 12? Put your final answer within \\boxed{}.\nAnswer:"
    assert row["prompt"].endswith(" 6 + 2 = 8, so \\boxed{8}\n\n" + question) and row["solution"] == "35"
    assert row["prompt"].startswith("Question: What is 3 + 4? Put your final answer within \\boxed{}.\nAnswer: "
                                    "3 + 4 = 7, so \\boxed{7}\n\n")  # fmt: skip
    assert " 8 - 5 = 3, so \\boxed{3}\n\n" in row["prompt"]  # each example worked on its answer line
    assert row["prompt"].count("\\boxed{}") == 4  # three solved examples, then the question
    assert time_to_accuracy.judge([row, row], [" \\boxed{35}", " 35"]) == {"accuracy": 0.5, "boxed": 0.5}
    _, held_out = time_to_accuracy.write_task(tmp_path, n_train=5, n_eval=5, plain=True)
    assert all(isinstance(json.loads(line)["prompt"], str) for line in held_out.read_text().splitlines())


def test_plain_answers_stop_at_their_line_for_both_tools_and_the_judge(time_to_accuracy: ModuleType) -> None:
    """A base model's plain answers end at the newline: asyncrl's command carries the stop (TRL builds its
    generation_kwargs from the same command), and the judge cuts there as vLLM stops."""
    from asyncrl.config.compose import compose, to_config

    plan = time_to_accuracy.Plan(steps=60, save_steps=10, trl_batch=(32, 1), max_tokens=256, lr=2e-5,
                                 eval_prompts=200, stop=(time_to_accuracy.PLAIN_STOP,))  # fmt: skip
    typed = time_to_accuracy.asyncrl_typed(Path("/m"), Path("/d"), plan, seed=0, rehearse=False)
    config = to_config(compose([arg for arg in typed[1:] if not arg.startswith("model.")] + ["model.name_or_path=/m"]))
    assert dict(config.sampling.generation_kwargs) == {"stop": ["\n"]}
    assert time_to_accuracy.cut_at_stop(" \\boxed{7}\n\nQuestion: What is", ["\n"]) == " \\boxed{7}"
    assert time_to_accuracy.cut_at_stop(" \\boxed{7}", ["\n"]) == " \\boxed{7}"


def test_small_operands_make_a_smaller_task_and_too_many_held_out_prompts_are_refused(
    time_to_accuracy: ModuleType,
) -> None:
    train, held_out = time_to_accuracy.task_rows(seed=0, n_train=4000, n_eval=40, plain=True, high=9)
    assert len(train) + len(held_out) == 100 + 55 - 3  # every sum and non-negative difference but the examples
    assert all("What is 3 + 4?" not in row["prompt"].rsplit("Question:", 1)[1] for row in train + held_out)
    with pytest.raises(SystemExit, match="--eval-prompts 100: operands 0..9 make 152 problems"):
        time_to_accuracy.task_rows(seed=0, n_train=10, n_eval=100, plain=True, high=9)


def test_asyncrl_gets_the_issues_command_and_the_matched_settings(time_to_accuracy: ModuleType) -> None:
    plan = time_to_accuracy.Plan(steps=60, save_steps=10, trl_batch=(32, 1), max_tokens=256, lr=2e-5, eval_prompts=200)
    typed = time_to_accuracy.asyncrl_typed(Path("/m"), Path("/d"), plan, seed=1, rehearse=False)
    assert shlex.join(typed) == (
        "train +recipe=deepmath model.name_or_path=/m data.path=/d/train.jsonl data.eval_path=/d/eval.jsonl "
        "sampling.max_completion_length=256 reward=accuracy_format packing.token_budget=4096 "
        "trainer.learning_rate=2e-05 trainer.samples_per_step=32 trainer.max_steps=60 trainer.seed=1 "
        "trainer.save_steps=10"
    )
    rehearsal = time_to_accuracy.asyncrl_typed(Path("/m"), Path("/d"), plan, 0, rehearse=True)
    assert rehearsal[-2] == "server=builtin" and rehearsal[-1].startswith("server.port=")
    assert plan.workload().samples == 60 * 32 and plan.workload().trl_batch == (32, 1)


def test_saves_are_read_from_each_tools_timings(time_to_accuracy: ModuleType, tmp_path: Path) -> None:
    trl = {"rows": [{"step": 1, "end_s": 10.0}, {"step": 2, "end_s": 12.0}], "saves": [(2, 12.5)]}
    assert time_to_accuracy.trl_saves(trl) == [{"step": 2, "dir": "checkpoint-2", "end_s": 12.5, "save_s": 0.5}]
    folder = tmp_path / "checkpoints"
    watch = time_to_accuracy.SaveWatch(folder)
    watch.look()  # no folder yet
    folder.mkdir()
    (folder / "step_000002.tmp").mkdir()
    watch.look()
    (folder / "step_000002.tmp").rename(folder / "step_000002")
    (folder / "step_000004.tmp").mkdir()  # still saving when the run was stopped: not a save
    watch.look()
    watch.seen["step_000002.tmp"] = watch.seen["step_000002"] - 2.0  # the save took 2 s
    [save] = watch.saves(launched=watch.seen["step_000002"] - 30.0)
    assert save == {"step": 2, "dir": "checkpoints/step_000002", "end_s": 30.0, "save_s": 2.0}


def result(tool: str, seed: int, save_s: float, end: float) -> dict:
    """A run of 4 steps of 32 samples saved at steps 2 and 4, each save ``save_s`` long, the last ending at
    ``end`` s from launch."""
    return {"tool": tool, "run": f"{tool}-s{seed}", "seed": seed, "caches": "cold", "rc": 0, "failure": None,
            "command": f"asyncrl train trainer.seed={seed}", "plan": {"eval_prompts": 200},
            "rows": [{"step": s, "samples": 32} for s in (1, 2, 3, 4)],
            "saves": [{"step": 2, "dir": "checkpoint-2", "end_s": end / 2, "save_s": save_s},
                      {"step": 4, "dir": "checkpoint-4", "end_s": end, "save_s": save_s}]}  # fmt: skip


def test_a_curve_starts_at_the_base_model_and_subtracts_every_save_so_far(time_to_accuracy: ModuleType) -> None:
    points = time_to_accuracy.curve(result("trl", 0, 1.0, 100.0), {2: {"accuracy": 0.3}, 4: {"accuracy": 0.6}},
                                    {"accuracy": 0.1})  # fmt: skip
    P = time_to_accuracy.Point
    assert points == [P(0, 0.0, 0.0, 0.1), P(2, 64.0, 49.0, 0.3), P(4, 128.0, 98.0, 0.6)]
    assert time_to_accuracy.reach(points, 0.3) == 49.0 and time_to_accuracy.reach(points, 0.6) == 98.0
    assert time_to_accuracy.reach(points, 0.05) == 0.0 and time_to_accuracy.reach(points, 0.7) is None
    unjudged = time_to_accuracy.curve(result("trl", 0, 1.0, 100.0), {4: {"accuracy": 0.6}}, None)
    assert unjudged == [P(4, 128.0, 98.0, 0.6)]


def test_goals_compare_asyncrl_to_trls_final_accuracy_and_at_equal_samples(time_to_accuracy: ModuleType) -> None:
    P = time_to_accuracy.Point
    curves = {
        "trl-s0": [P(0, 0, 0, 0.1), P(2, 64, 100, 0.3), P(4, 128, 200, 0.5)],
        "asyncrl-s0": [P(0, 0, 0, 0.1), P(2, 64, 40, 0.35), P(4, 128, 80, 0.55)],
        "trl-s1": [P(0, 0, 0, 0.1), P(2, 64, 90, 0.4), P(4, 128, 180, 0.4)],
        "asyncrl-s1": [P(0, 0, 0, 0.1), P(2, 64, 50, 0.2), P(4, 128, 100, 0.3)],
    }
    summary = time_to_accuracy.summarise(curves, prompts=200)
    seed0, seed1 = summary["goal1"]
    assert (seed0["target"], seed0["trl_s"], seed0["asyncrl_s"], seed0["ratio"]) == (0.5, 200, 80, 0.4)
    assert (seed1["target"], seed1["trl_s"], seed1["asyncrl_s"], seed1["ratio"]) == (0.4, 90, None, None)
    assert summary["ratio_mean"] == 0.4  # the seed asyncrl never reached it has no ratio
    at64, at128 = summary["goal2"]
    assert at64["samples"] == 64 and at64["diff"] == pytest.approx(0.275 - 0.35)
    assert at64["noise"] == pytest.approx(0.15)  # asyncrl's seeds: 0.35 and 0.2
    assert at128["diff"] == pytest.approx(0.425 - 0.45) and at128["noise"] == pytest.approx(0.25)
    results = {run: result(run.split("-s")[0], int(run[-1]), 0.0, 10.0) for run in curves}
    text = time_to_accuracy.table(results, curves, prompts=200)
    assert "| 0 | 0.500 | 200.0 | 80.0 | 0.40x | 0.550 |" in text
    assert "| 1 | 0.400 | 90.0 | not by 100.0 | - | 0.300 |" in text
    assert "Mean over seeds: 0.40x (goal <= 0.5x: met)" in text
    assert "| 64 | 0.300, 0.400 | 0.350, 0.200 | -0.075 | 0.150 | yes |" in text


def test_a_report_is_written_from_the_work_folders_files(time_to_accuracy: ModuleType, tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    (work / "results").mkdir(parents=True)
    for tool in time_to_accuracy.TOOLS:
        run = result(tool, 0, 0.5, 60.0)
        if tool == "asyncrl":  # its own before/after evaluation (accuracy + format), which the evaluator checks
            run["own_eval"] = {"before": {"eval/greedy_reward": 0.5}, "after": {"eval/greedy_reward": 1.4},
                               "after_step": 4}  # fmt: skip
        (work / "results" / f"{tool}-s0.json").write_text(json.dumps(run))
        for step, accuracy in ((2, 0.25), (4, 0.5)):
            path = work / "evals" / f"{tool}-s0" / f"step_{step:06d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"accuracy": accuracy, "boxed": 1.0, "evaluator": "hf"}))
    (work / "evals" / "base.json").write_text(json.dumps({"accuracy": 0.0, "boxed": 0.5, "evaluator": "hf"}))
    everything = time_to_accuracy.collect(work)
    text = time_to_accuracy.report(everything, out)
    assert "| trl-s0 | cold | 4 | 128 | 59.0 | 1.0 | 0.500 | 1.000 |" in text
    assert ("- asyncrl-s0: asyncrl's eval.json greedy reward vs this evaluator's accuracy + boxed: before (step 0) "
            "0.500 vs 0.500; after (step 4) 1.400 vs 1.500") in text  # fmt: skip
    assert "different evaluators" not in text
    assert json.loads((out / "time_to_accuracy.json").read_text()) == everything
    assert (out / "time_to_accuracy.png").stat().st_size > 0
    assert time_to_accuracy.eval_jobs(work, tmp_path / "model") == []  # judged, or no weights to judge


def test_the_documented_gpu_calls_parse(time_to_accuracy: ModuleType) -> None:
    """Each ``$T ...`` of the docstring's plan is a valid command line, a call's runs within its 570 s deadline."""
    calls = [[part.strip().rstrip(";").split() for part in quoted.split("$T ")[1:]]
             for quoted in time_to_accuracy.__doc__.split("``") if "$T " in quoted]  # fmt: skip
    assert [len(c) for c in calls] == [3, 3, 1]  # b, c, d
    parser = time_to_accuracy.build_parser()
    for call in calls:
        parsed = [parser.parse_args(["--model", "/m", "--deadline", "0", *argv]) for argv in call]
        assert all(set(filter(None, a.tools.split(","))) <= set(time_to_accuracy.TOOLS) for a in parsed)
        assert parsed[-1].eval and sum(a.run_timeout for a in parsed if a.tools) <= 570
    assert time_to_accuracy.within_deadline(300.0, None) == 300.0
    assert 99.0 < time_to_accuracy.within_deadline(300.0, time_to_accuracy.time.time() + 115.0) <= 100.0


def test_the_real_model_row_is_the_own_task_walk_through_and_must_learn(acceptance: ModuleType, tmp_path: Path) -> None:
    """benchmarks/acceptance.py's ``real-model`` row: README's own-task command on the real checkpoint, 40 steps
    on a GPU, passing only when eval.json's held-out greedy reward rose by 0.3."""
    [row] = [r for r in acceptance.ROWS if r.name == "real-model"]
    ctx = acceptance.Context(tmp_path, steps=10, rehearse=False, row_timeout=240.0, vllm=True)
    model = acceptance.shape_path(row.shape, ctx)
    assert model == Path("/tmp/real-checkpoints/smollm2-135m-instruct") and row.runs == 2
    assert acceptance.typed(row, ctx, model) == [
        "train", "+recipe=deepmath", f"model.name_or_path={model}", "data.path=train.jsonl",
        "data.eval_path=eval.jsonl", "reward=accuracy_format", "sampling.max_completion_length=256",
        "packing.token_budget=4096", "trainer.learning_rate=2e-5", "trainer.max_steps=40",
    ]  # fmt: skip
    rehearsal = acceptance.Context(tmp_path, steps=4, rehearse=True, row_timeout=240.0, vllm=False)
    assert acceptance.shape_path(row.shape, rehearsal).name == "tiny-arith"
    assert acceptance.typed(row, rehearsal, model)[-4:] == [
        "trainer.max_steps=4", "sampling.max_completion_length=24", "data.num_eval_prompts=40", "server=builtin"
    ]  # fmt: skip
    path = tmp_path / "eval.json"
    for after, problem in ((0.6, "held-out greedy reward rose +0.200, less than 0.3"), (0.75, None)):
        path.write_text(json.dumps({"before": {"eval/greedy_reward": 0.4}, "after": {"eval/greedy_reward": after},
                                    "before_step": 0, "after_step": 40}))  # fmt: skip
        assert acceptance.learned(path, judged=True) == (f"held-out greedy reward 0.400 -> {after:.3f} (step 40)",
                                                          problem)  # fmt: skip
    said, problem = acceptance.learned(path, judged=False)
    assert said.endswith("not judged in the rehearsal (stand-in model)") and problem is None
    path.unlink()
    assert acceptance.learned(path, judged=True)[1] == "no eval.json: nothing says whether it learned"
