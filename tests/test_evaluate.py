"""Held-out evaluation's requests: what every server asyncrl launches accepts; its progress as it goes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from asyncrl import evaluate
from asyncrl.client import Completion
from asyncrl.config.compose import compose, to_config
from asyncrl.metrics import read_jsonl
from asyncrl.serving.command import served_name


def test_evaluation_never_asks_for_temperature_zero(monkeypatch):
    """vLLM >= 0.28 with --return-sampling-mask refuses temperature 0 and top_k 0: greedy is top-1 sampling."""
    sent: list[Any] = []

    async def complete_all(
        client: Any, prompts: list[list[int]], params: list[Any], concurrency: int, done: Callable[[int], None]
    ) -> list[Any]:
        sent.extend(params)
        return [Completion([1], None, None, None, "stop", ids) for ids in prompts]

    async def mean_reward(*args: Any) -> float:
        return 0.5

    monkeypatch.setattr(evaluate, "render_prompt", lambda tokenizer, messages, kwargs: [3, 4, 5])
    monkeypatch.setattr(evaluate, "_complete_all", complete_all)
    monkeypatch.setattr(evaluate, "_mean_reward", mean_reward)
    config = to_config(compose(["sampling.top_k=20", "sampling.temperature=0.7", "data.num_eval_prompts=2"]))
    rows = [{"prompt": [{"role": "user", "content": "1+1"}]}] * 3
    results = evaluate.evaluate(config, "http://unused", "m", None, rows, [], max_model_len=64)
    assert results == {"eval/greedy_reward": 0.5, "eval/sampled_reward": 0.5}
    greedy, sampled = sent[:2], sent[2:]
    assert {(p.temperature, p.top_k) for p in greedy} == {(1.0, 1)}
    assert {(p.temperature, p.top_k) for p in sampled} == {(0.7, 20)} and len(sampled) == 2


def test_num_generations_eval_samples_each_prompt_that_many_times(monkeypatch):
    """TRL's num_generations_eval: the sampled reward averages N seeded completions per prompt; greedy draws one."""
    sent: list[list[Any]] = []
    scored: list[list[str]] = []

    async def complete_all(
        client: Any, prompts: list[list[int]], params: list[Any], concurrency: int, done: Callable[[int], None]
    ) -> list[Any]:
        sent.append(params)
        return [Completion([1], None, None, None, "stop", ids) for ids in prompts]

    async def mean_reward(rows: list[dict[str, Any]], *args: Any) -> float:
        scored.append([row["answer"] for row in rows])
        return 0.5

    monkeypatch.setattr(evaluate, "render_prompt", lambda tokenizer, messages, kwargs: [3, 4, 5])
    monkeypatch.setattr(evaluate, "_complete_all", complete_all)
    monkeypatch.setattr(evaluate, "_mean_reward", mean_reward)
    config = to_config(compose(["sampling.num_generations_eval=3", "data.num_eval_prompts=2"]))
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "answer": answer} for answer in ("a", "b")]
    evaluate.evaluate(config, "http://unused", "m", None, rows, [], max_model_len=64)
    greedy, sampled = sent
    assert len(greedy) == 2 and len(sampled) == 6 and len({p.seed for p in sampled}) == 6
    assert scored == [["a", "b"], ["a", "a", "a", "b", "b", "b"]]  # each completion scored against its own row


def test_the_closing_line_names_where_the_run_started_and_what_each_score_measures():
    before, after = {"eval/greedy_reward": 1.0, "eval/sampled_reward": 0.325}, {"eval/greedy_reward": 1.0,
                                                                               "eval/sampled_reward": 0.9}  # fmt: skip
    fresh = evaluate.EvalRecord(before, 0, after=after, after_step=60)
    assert fresh.summary(200, 1.0).startswith(
        "held-out reward on 200 prompts, base model -> step 60: sampled 0.325 -> 0.900; greedy 1.000 -> 1.000 "
        "(sampled: one completion at temperature 1, the pass@1 training raises; greedy: the most likely completion"
    )
    resumed = evaluate.EvalRecord(before, 30, resumed=True, after=after, after_step=60)
    assert resumed.summary(200, 0.7).startswith("held-out reward on 200 prompts, checkpoint step 30 -> step 60")
    assert resumed.to_json() == {"before": before, "after": after, "before_model": "checkpoint step 30",
                                 "before_step": 30, "after_step": 60}  # fmt: skip


def test_the_evaluation_tells_its_progress_as_completions_come_back(
    tiny_server, random_tiny_model_dir, arithmetic_data_dir
):
    """Each pass counts its prompts as their completions return (the console shows it: a long evaluation was
    silent for minutes)."""
    config = to_config(compose(["sampling.max_completion_length=4", "data.num_eval_prompts=3",
                                "server.max_num_seqs=2"]))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)
    rows = read_jsonl(arithmetic_data_dir / "eval.jsonl")
    told: list[tuple[str, int, int]] = []
    model = served_name(str(random_tiny_model_dir))
    evaluate.evaluate(config, tiny_server.base_url, model, tokenizer, rows, [], 256, lambda *a: told.append(a))
    assert told == [(label, done, 3) for label in ("greedy", "sampled") for done in (1, 2, 3)]
